"""How busy the worker keeps its device when a batch's compute is off the CPU (as on a GPU).

A worker process serves a sleep model (``--batch-cost-s`` a batch, whatever its size, like a
small model on a GPU), the producer (this process, the SDK) keeps ``--concurrency`` requests in
flight, several batches' worth, so the device could compute back to back. The device's limit is
``max_batch_size / batch_cost_s`` requests a second; the figure is the rate reached as a share of
it, with the mean batch size and how long storing one batch's answers took (the worker's own
``answer`` counter). Everything the device does not compute while requests wait is the worker's
own I/O between batches. To compare two checkouts, run the module from each, alternating.

    python -m bench.overhead.device_busy [--batch-cost-s 0.008] [--requests 5000] [--concurrency 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from jetbatch import sdk

from bench import harness

MAX_BATCH = 64


def _config(directory: Path, prefix: str, batch_cost_s: float) -> Path:
    model = {"handler": "sleep", "max_batch_size": MAX_BATCH, "max_delay_s": 0.002, "load_cost_s": 0.01, "batch_cost_s": batch_cost_s, "item_cost_s": 0.0}
    return harness.write_config({"nats": {"prefix": prefix}, "worker": {"poll_interval_ms": 250}, "models": {"m": model}}, directory, prefix)


async def _drive(url: str, prefix: str, n: int, concurrency: int) -> tuple[float, dict[str, int]]:
    async with sdk.Client.connect(url, prefix=prefix) as client:
        await client.infer(b"warm", model="m", timeout=60)  # the model loaded before timing
        run = await harness.gather(lambda: client.infer(b"x" * 256, model="m", timeout=60), n, concurrency)
    return run.rate, await harness.worker_stats(url, prefix, wait_s=0.5)


def one_round(url: str, n: int, concurrency: int, batch_cost_s: float) -> dict[str, Any]:
    prefix = harness.fresh_prefix("busy")
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp), prefix, batch_cost_s)
        with harness.processes(config, url, store_dir=Path(tmp) / "store", http_port=-1):
            rate, stats = asyncio.run(_drive(url, prefix, n, concurrency))
    limit = MAX_BATCH / batch_cost_s
    return {
        "rate": rate, "device_limit_rps": limit, "device_busy": rate / limit,
        "mean_batch": stats.get("requests", 0) / max(1, stats.get("batches", 0)),
        "answer_ms": stats.get("answer_us", 0) / max(1, stats.get("answer_n", 0)) / 1000,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-cost-s", type=float, default=0.008, help="the model's compute a batch (off the CPU)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=4 * MAX_BATCH)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    with harness.server() as server:
        rounds = [one_round(server.url, args.requests, args.concurrency, args.batch_cost_s) for _ in range(args.rounds)]
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    harness.emit({"bench": "device_busy", "batch_cost_s": args.batch_cost_s, "requests": args.requests,
                  "concurrency": args.concurrency, "median": median, "rounds": rounds}, args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
