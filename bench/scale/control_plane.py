"""What the live worker's control plane costs, stage by stage: the figures behind the simulator's
``Workload.control`` defaults (sidecar/simulator/workloads.py).

One worker in this process (the `sleep` handler), one embedded nats-server, ``--models`` models
with Zipf(1.1) Poisson traffic (as ``bench.scale.many_models``). Each stage of the worker is timed by wrapping
its coroutine: the decision (from the worker's own counters), the load path around the model's
own load, the fetch before a batch, the answers after it. The client runs in the same process,
so absolute latencies are higher than ``bench.scale.many_models``'s; the per-stage costs are what matter.

    python -m bench.scale.control_plane --models 1000 --rate 20 --duration 20
    python -m bench.scale.control_plane --models 1000 --rate 20 --duration 30 --workers 4 --cluster
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from jetbatch.sidecar import cluster
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.simulator.workloads import build_workload
from jetbatch.sidecar.worker import execution, loop, residency

from bench import harness
from bench.harness.simulated import scale_workload, sleep_sections

STAGES = [
    (loop.Worker, "_load"),
    (loop.Worker, "_consumer"),
    (residency.Residency, "load"),
    (residency.Residency, "_load_locked"),
    (residency.Residency, "_evict"),
    (loop.Worker, "_serve"),
    (execution.BatchRunner, "finish"),
    (loop.Worker, "_refresh"),
    (loop.Worker, "_claim_load"),
    (cluster.ClusterView, "claim"),
    (cluster.ClusterView, "advertise"),
    (cluster.ClusterView, "release"),
]


def _timed(times: dict[str, list[float]], cls: type, name: str) -> Callable[[], None]:
    original = getattr(cls, name)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            times[name].append(time.perf_counter() - started)

    setattr(cls, name, wrapper)
    return lambda: setattr(cls, name, original)


def run(args: argparse.Namespace) -> dict[str, Any]:
    times: dict[str, list[float]] = collections.defaultdict(list)
    undo = [_timed(times, cls, name) for cls, name in STAGES]
    workload = build_workload(scale_workload(args.models, args.rate, args.duration, args.seed, args.slots, args.workers))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = harness.config(sleep_sections("cp", args.models, args.slots, replicas=3 if args.cluster else 1), tag="cp")
            servers = harness.cluster(3, base_dir=Path(tmp) / "cluster") if args.cluster else harness.server(store_dir=Path(tmp) / "store")
            with servers as server:

                async def main() -> dict[str, int]:
                    async with contextlib.AsyncExitStack() as stack:
                        workers = [
                            await stack.enter_async_context(harness.in_process(msgspec.structs.replace(config, worker=msgspec.structs.replace(config.worker, id=f"cp{i}")), server.url))
                            for i in range(args.workers)
                        ]  # fmt: skip
                        await harness.replay(server.url, config.nats.prefix, workload.arrivals, 60.0)
                    total: dict[str, int] = {}
                    for worker in workers:
                        for k, v in worker.stats.items():
                            total[k] = total.get(k, 0) + v
                    return total

                stats = asyncio.run(main())
    finally:
        for restore in undo:
            restore()
    stages = {name: {"n": len(v), "mean_ms": 1000 * sum(v) / len(v), "p50_ms": 1000 * percentile(v, 0.5)} for name, v in times.items() if v}
    decisions = max(stats.get("decisions", 0), 1)
    return {
        "bench": "control_plane", "models": args.models, "rate": args.rate, "duration_s": args.duration,
        "workers": args.workers, "cluster": args.cluster, "loads": stats.get("loads", 0),
        "decision_mean_ms": stats.get("decision_us", 0) / 1000 / decisions,
        "models_shown_mean": stats.get("models_shown", 0) / decisions,
        "stages": stages,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cluster", action="store_true", help="a 3-node cluster, streams with 3 replicas")
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    record = run(args)
    harness.emit(record, args.json)
    for name, s in record["stages"].items():
        print(f"{name:14s} n={s['n']:5d}  mean {s['mean_ms']:7.2f} ms  p50 {s['p50_ms']:7.2f} ms")
    print(f"decision: {record['decision_mean_ms']:.3f} ms with {record['models_shown_mean']:.1f} models shown")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
