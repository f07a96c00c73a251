"""Small bursts against a deployed worker: does each request of a burst join a batch within its
window, or wait for the next count of its queue?

A burst is 2 or 3 requests from one client (alternately), the i-th sent i x ``offset`` after the
first, then an idle pause; the offsets put the later requests inside the first one's batch
window, at its close and just after it. Sparse bursty traffic is where a request's arrival event
and the fetch that counts its queue race: a request left out of its window waited for the
worker's next count of the queue, up to ``idle_refresh_s`` (docs/benchmarks.md in git, "A request
stored while its window is open"). The worker runs in its own process (identity handler, batches
of up to 64), as in ``compose.yaml``.

Reported: the requests answered later than ``max_delay`` + ``--slack-ms`` (on an idle host every
one is answered within a few milliseconds of its window), the slowest, and for each offset the
median and maximum latency and the worker's own queue wait at the maximum.

    python -m bench.overhead.bursts [--max-delay-s 0.002] [--trials 20] [--slack-ms 20] [--offsets 0.05,0.25,...]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jetbatch import sdk

from bench import harness
from bench.harness.rounds import ident_config

# The later requests' offsets, as fractions of max_delay: inside the window, at its close, after.
OFFSETS = (0.05, 0.25, 0.5, 0.8, 0.95, 1.0, 1.05, 1.2, 1.5, 2.0)


async def _one(client: sdk.Client, delay_s: float, out: list[tuple[float, float]]) -> None:
    await asyncio.sleep(delay_s)
    started = time.perf_counter()
    result = await client.infer_result(b"x", model="ident", timeout=60)
    out.append((time.perf_counter() - started, result.batch.queue_wait_ms / 1000))


async def _bursts(url: str, prefix: str, offsets_s: list[float], trials: int, seed: int) -> dict[float, list[tuple[float, float]]]:
    rng = random.Random(seed)
    by_offset: dict[float, list[tuple[float, float]]] = {o: [] for o in offsets_s}
    async with sdk.Client.connect(url, prefix=prefix) as client:
        for _ in range(5):
            await client.infer(b"x", model="ident", timeout=60)  # loaded, every path warm
        for trial in range(trials):
            for offset in offsets_s:
                size = 3 if trial % 2 else 2
                await asyncio.gather(*(_one(client, i * offset, by_offset[offset]) for i in range(size)))
                await asyncio.sleep(0.02 + rng.random() * 0.01)  # idle between bursts
    return by_offset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-delay-s", type=float, default=0.002, help="the worker's batch window")
    parser.add_argument("--trials", type=int, default=20, help="bursts at each offset")
    parser.add_argument("--slack-ms", type=float, default=20.0, help="a request later than max_delay + this counts as late")
    parser.add_argument("--offsets", help="the later requests' offsets, comma-separated fractions of max_delay")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    fractions = [float(x) for x in args.offsets.split(",")] if args.offsets else list(OFFSETS)
    offsets_s = [f * args.max_delay_s for f in fractions]
    prefix = harness.fresh_prefix("bst")
    with harness.server() as server, tempfile.TemporaryDirectory() as tmp:
        config = ident_config(Path(tmp), prefix, False, args.max_delay_s)
        with harness.processes(config, server.url, classifier=False, store_dir=Path(tmp) / "store", http_port=-1):
            by_offset = asyncio.run(_bursts(server.url, prefix, offsets_s, args.trials, args.seed))
    limit_s = args.max_delay_s + args.slack_ms / 1000
    late = [t for results in by_offset.values() for t, _ in results if t > limit_s]
    per_offset: dict[str, Any] = {}
    for offset, results in by_offset.items():
        worst = max(results)
        per_offset[f"{offset * 1000:.3f}"] = {
            "requests": len(results),
            "p50_ms": statistics.median(t for t, _ in results) * 1000,
            "max_ms": worst[0] * 1000,
            "max_queue_wait_ms": worst[1] * 1000,
            "late": sum(1 for t, _ in results if t > limit_s),
        }
    record = {
        "bench": "bursts", "max_delay_s": args.max_delay_s, "trials": args.trials, "slack_ms": args.slack_ms,
        "requests": sum(len(r) for r in by_offset.values()), "late": len(late),
        "slowest_ms": max((t for r in by_offset.values() for t, _ in r), default=0.0) * 1000, "by_offset_ms": per_offset,
    }  # fmt: skip
    harness.emit(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
