"""A live worker recorded under mixed traffic, then replayed on a fresh core: the share of its
decisions the replay reproduces (issue 51's target: 100%).

The traffic: four sleep-handler models on two device slots (loads of 50-200 ms), Poisson
arrivals with on/off bursts over Zipf popularity, a quarter of the requests on the batch line,
and a tenth of the callers giving up before their answer (a timeout shorter than a load: the
SDK sends a cancel notice). The worker runs in this process with ``record=``; ``jetbatch replay``
does the same check on a file.

    python -m bench.scheduler.replay_live --duration 30 --rate 60
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness
from jetbatch import sdk
from jetbatch.sidecar.recording import FlightRecorder, replay_file

MODELS = {
    f"m{i}": {
        "handler": "sleep", "max_batch_size": 8, "max_delay_ms": 5,
        "options": {"load_cost_s": load_s, "batch_cost_s": 0.005, "item_cost_s": 0.0005},
    }
    for i, load_s in enumerate((0.05, 0.1, 0.15, 0.2))
}  # fmt: skip


def arrivals(rate: float, duration_s: float, seed: int) -> list[tuple[float, str, str, float]]:
    """(at, model, priority, timeout) for each request: Poisson at ``rate``, tripled in the on
    half of every 10 s, Zipf(1.1) over the models."""
    rng = random.Random(seed)
    names = list(MODELS)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(names))]
    out, t = [], 0.0
    while t < duration_s:
        on = (t % 10.0) < 5.0
        t += rng.expovariate(rate * (1.5 if on else 0.5))
        priority = "batch" if rng.random() < 0.25 else "interactive"
        timeout = 0.03 if rng.random() < 0.1 else 20.0  # a tenth give up before a load ends
        out.append((t, rng.choices(names, weights)[0], priority, timeout))
    return out


async def drive(url: str, prefix: str, plan: list[tuple[float, str, str, float]]) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    async with sdk.Client.connect(url, prefix=prefix) as client:
        start = time.monotonic() + 0.5

        async def one(at: float, model: str, priority: str, timeout: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            try:
                await client.infer(b"x", model=model, timeout=timeout, priority=priority)
                kind = "ok"
            except sdk.JetbatchError as exc:
                kind = type(exc).__name__
            outcomes[kind] = outcomes.get(kind, 0) + 1

        await asyncio.gather(*(one(*p) for p in plan))
    return outcomes


async def run(url: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    cfg = harness.config({"models": MODELS, "worker": {"max_resident_models": 2}}, tag="rl")
    recorder = FlightRecorder(path)
    plan = arrivals(args.rate, args.duration, args.seed)
    try:
        async with harness.in_process(cfg, url, record=recorder) as worker:
            outcomes = await drive(url, cfg.nats.prefix, plan)
            loads = worker.stats["loads"]
    finally:
        recorder.close()
    return {"requests": len(plan), "outcomes": outcomes, "loads": loads, "recorded_bytes": path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of traffic")
    parser.add_argument("--rate", type=float, default=60.0, help="mean requests a second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="append the run's record to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, harness.server() as server:
        path = Path(tmp) / "worker.jsonl"
        record = asyncio.run(run(server.url, args, path))
        result = replay_file(path)
    record.update(
        bench="replay_live", duration_s=args.duration, rate=args.rate, events=result.events, actions=result.matched,
        by_action=result.by_action, reproduced=result.ok, truncated=result.truncated,
        divergence=None if result.divergence is None else result.divergence.line,
    )  # fmt: skip
    harness.emit(record, args.json)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
