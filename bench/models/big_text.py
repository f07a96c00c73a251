"""Megabyte texts to the transformers handler, at the worker: one worker process serving a small
Hugging Face classifier built here with a fixed seed (examples/huggingface, nothing downloaded)
and a sleep model ``m2`` under steady open-loop traffic (``--rate``), the classifier under a
light one of short texts. In alternating windows of ``--window-s`` (off, on, off, on, ...) the
"on" windows also send a ``--mb`` MB text to the classifier every ``--big-every-s``. Measured:
``m2``'s p50/p99 in the off and the on windows of the same run (side by side), the big texts'
outcomes and latency, and the worker process's RSS at start, its peak and at the end.

    python -m bench.models.big_text [--rounds 3] [--window-s 10] [--mb 7] [--rate 50]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from jetbatch import sdk
from jetbatch.sidecar.percentiles import percentile

from bench import harness
from examples.huggingface.build import WORDS, build


def _config(directory: Path, prefix: str) -> Path:
    hf = {"handler": "transformers", "path": str(build(directory / "hf")), "max_batch_size": 8, "max_delay_s": 0.01, "options": {"max_length": 64}}
    options = {"load_cost_s": 0.0, "batch_cost_s": 0.005, "item_cost_s": 0.0002}
    m2 = {"handler": "sleep", "max_batch_size": 16, "max_delay_ms": 5, "load_cost_s": 0.0, "options": options}
    return harness.write_config({"nats": {"prefix": prefix}, "models": {"hf": hf, "m2": m2}}, directory, prefix)


def _big_text(mb: float) -> str:
    rng = random.Random(0)
    words: list[str] = []
    size = 0
    while size < mb * 1024 * 1024:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


async def _run(url: str, prefix: str, worker_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    # Encoded once, and sent on a connection of its own: the caller's encoding and its 7 MB
    # publish are not what is measured (the m2 calls share this process).
    big = msgspec.msgpack.encode(_big_text(args.mb))
    m2_ms: dict[str, list[float]] = {"off": [], "on": []}
    outcomes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    big_s: list[float] = []
    rss: list[float] = []
    async with sdk.Client.connect(url, prefix=prefix) as client, sdk.Client.connect(url, prefix=prefix) as big_client:
        await client.infer("a good movie", model="hf", timeout=60)
        await client.infer(b"x", model="m2", timeout=60)
        rss_start = harness.rss_kib(worker_pid) / 1024
        window = "off"

        async def call(model: str, payload: Any, tag: str) -> None:
            sent = time.monotonic()
            try:
                if tag == "big":
                    await big_client.infer(payload, model=model, timeout=args.timeout_s, content_type="application/msgpack")
                else:
                    await client.infer(payload, model=model, timeout=args.timeout_s)
                outcome = "ok"
            except sdk.JetbatchError as exc:
                outcome = type(exc).__name__
            took = time.monotonic() - sent
            outcomes[tag][outcome] += 1
            if tag in m2_ms and outcome == "ok":
                m2_ms[tag].append(took * 1000)
            elif tag == "big":
                big_s.append(took)

        tasks: list[asyncio.Task[None]] = []
        began = time.monotonic()
        total_s = 2 * args.rounds * args.window_s
        i = 0
        next_big = began
        next_hf = began
        while (now := time.monotonic()) - began < total_s:
            window = "on" if int((now - began) // args.window_s) % 2 else "off"
            tasks.append(asyncio.ensure_future(call("m2", b"x", window)))
            if now >= next_hf:
                tasks.append(asyncio.ensure_future(call("hf", "the movie was good", "hf_short")))
                next_hf += 1 / args.hf_rate
            if window == "on" and now >= next_big:
                tasks.append(asyncio.ensure_future(call("hf", big, "big")))
                next_big = now + args.big_every_s
            if i % max(int(args.rate / 2), 1) == 0:
                rss.append(harness.rss_kib(worker_pid) / 1024)
            i += 1
            await asyncio.sleep(max(0.0, began + i / args.rate - time.monotonic()))
        await asyncio.gather(*tasks)
        rss_end = harness.rss_kib(worker_pid) / 1024

    def pct(values: list[float], q: float) -> float:
        return round(percentile(values, q), 1)

    p99_off, p99_on = pct(m2_ms["off"], 0.99), pct(m2_ms["on"], 0.99)
    return {
        "m2_p50_ms": {"off": pct(m2_ms["off"], 0.5), "on": pct(m2_ms["on"], 0.5)},
        "m2_p99_ms": {"off": p99_off, "on": p99_on}, "m2_p99_on_over_off": round(p99_on / p99_off, 2),
        "outcomes": {k: dict(v) for k, v in sorted(outcomes.items())},
        "big_p50_s": round(percentile(big_s, 0.5), 2), "big_max_s": round(max(big_s, default=float("nan")), 2),
        "worker_rss_mb": {"start": round(rss_start, 1), "peak": round(max(rss, default=rss_start), 1), "end": round(rss_end, 1)},
        "worker_rss_growth_mb": round(max(max(rss, default=rss_start), rss_end) - rss_start, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="off/on window pairs")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--mb", type=float, default=7.0, help="size of each big text, MB (the streams allow 8 MiB)")
    parser.add_argument("--big-every-s", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=50.0, help="m2's requests/s, all along")
    parser.add_argument("--hf-rate", type=float, default=5.0, help="short texts/s to the classifier, all along")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    prefix = harness.fresh_prefix("big")
    with (
        tempfile.TemporaryDirectory() as tmp,
        harness.server() as server,
        harness.processes(_config(Path(tmp), prefix), server.url, classifier=False) as dep,
    ):
        worker_pid = next(proc.pid for name, proc in dep.procs.items() if name.startswith("worker"))
        result = asyncio.run(_run(server.url, prefix, worker_pid, args))
    record = {"bench": "big_text", "mb": args.mb, "rounds": args.rounds, "window_s": args.window_s, "rate": args.rate,
              "big_every_s": args.big_every_s, **result}  # fmt: skip
    harness.emit(record, args.json)


if __name__ == "__main__":
    main()
