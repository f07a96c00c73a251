"""Scale-out: 1 vs 2 vs 3 workers on one workload, and coordinated placement against
uncoordinated (every worker scheduling alone), all in one run on one embedded nats-server.

The handler is `sleep` (load and compute are sleeps), so the workers' throughput is bounded by
their simulated device time, not by this machine's two cores. Run:

    python -m bench.scale.scaleout [--duration 10] [--concurrency 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from jetbatch.sidecar.dev.loadtest import run_bench

from bench import harness

MODELS = ("m1", "m2", "m3")


def write_config(directory: Path, prefix: str, *, coordinate: bool, policy: str | None) -> Path:
    worker = {"max_resident_models": 1, "poll_interval_ms": 100, "heartbeat_s": 0.5, "coordinate": coordinate, "policy": policy}
    cost = {"load_cost_s": 0.5, "batch_cost_s": 0.02, "item_cost_s": 0.001}
    model = {"handler": "sleep", "max_batch_size": 16, "max_delay_ms": 5, **cost, "max_wait_ms": 3000, "options": cost}
    return harness.write_config({"nats": {"prefix": prefix}, "worker": worker, "models": dict.fromkeys(MODELS, model)}, directory, prefix)


def scenario(url: str, directory: Path, name: str, workers: int, coordinate: bool, args: argparse.Namespace) -> dict[str, float]:
    prefix = f"s{name}"
    config = write_config(directory, prefix, coordinate=coordinate, policy=args.policy)
    with harness.processes(config, url, workers=workers) as dep:
        result = asyncio.run(
            run_bench(dep.url, mix={m: 1 / len(MODELS) for m in MODELS}, duration_s=args.duration,
                      concurrency=args.concurrency, prefix=prefix)
        )  # fmt: skip
        loads = asyncio.run(harness.worker_stats(dep.url, prefix, wait_s=0.5)).get("loads", 0)
    s = result.summary()
    return {
        "workers": workers,
        "coordinated": coordinate,
        "throughput_rps": s["throughput_rps"],
        "p99_ms": s["p99_ms"],
        "loads": loads,
        "loads_per_minute": loads / (s["elapsed_s"] / 60.0),
        "mean_batch": s["mean_batch_size"],
        "errors": sum(s["errors"].values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--policy", default=None, help="worker policy (default: the config default)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, harness.server() as server:
        directory = Path(tmp)
        for name, workers, coordinate in (("w1", 1, True), ("w2", 2, True), ("w3", 3, True), ("u3", 3, False)):
            rows.append(scenario(server.url, directory, name, workers, coordinate, args))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["throughput_rps"]
    coordinated, uncoordinated = rows[2], rows[3]
    summary = {
        "rows": rows,
        "speedup_2_workers": rows[1]["throughput_rps"] / base,
        "speedup_3_workers": rows[2]["throughput_rps"] / base,
        "uncoordinated_over_coordinated_loads": uncoordinated["loads"] / max(coordinated["loads"], 1),
        "coordinated_over_uncoordinated_throughput": coordinated["throughput_rps"] / max(uncoordinated["throughput_rps"], 1e-9),
    }
    harness.emit(summary, args.json)


if __name__ == "__main__":
    main()
