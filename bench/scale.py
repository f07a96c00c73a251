"""Many registered models on one worker: the live worker against its simulator on one trace.

One worker process (`jetbatch worker`, the `sleep` handler: load and batch are sleeps of known
length, so the device time is the workload's, not this machine's) or `--workers N`, one embedded
nats-server or `--cluster` (3 nodes, streams with 3 replicas),
`--models N` registered models, Zipf(1.1) popularity and Poisson arrivals at `--rate` req/s for
`--duration` s. The same arrivals are fed to the simulator (with the control plane's measured
costs, ``Workload.control``) and, with ``--ideal``, to the simulator with a free control plane.
Before the traffic, the idle CPU of the worker and of nats-server is read from /proc over
`--idle-s` seconds, and the time from the worker's start to its readiness.

    python -m bench.scale --models 200 --rate 40 --duration 60 [--json out.json] [--trace-out trace.json]
    python -m bench.scale --models 1000 --rate 20 --workers 4 --cluster

``--trace-out`` writes the trace and costs in the format ``bench/vs_ray.py`` reads, so Ray
Serve's multiplexing runs on the very same arrivals. Latency is measured from each request's
scheduled send time (open loop) to its answer; percentiles are nearest-rank.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.records import emit
from jetbatch import sdk
from jetbatch.sidecar.dev.deployment import Deployment
from jetbatch.sidecar.dev.natsserver import NatsCluster
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.simulator import simulate
from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL, Control, build_workload

COSTS = {"load_cost_s": 0.05, "batch_cost_s": 0.002, "item_cost_s": 0.0002, "max_batch_size": 16, "max_delay_s": 0.005}


def workload_raw(
    models: int, rate: float, duration_s: float, seed: int, slots: int, workers: int = 1, *,
    costs: dict[str, float] | None = None, zipf: float = 1.1, warm: bool = True, max_wait_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The simulator's workload of a run (``zipf`` 0: every model equally popular; ``warm``: a
    host tier big enough for every model, as the worker's default is for these tiny models)."""
    c = COSTS if costs is None else costs
    names = [f"m{i}" for i in range(models)]
    # The worker's warm tier is the sleep handler's tenth of a load; the simulator's default is the same.
    spec: dict[str, Any] = {k: c[k] for k in ("load_cost_s", "batch_cost_s", "item_cost_s", "max_batch_size", "max_delay_s")}
    if max_wait_s is not None:
        spec["max_wait_s"] = max_wait_s
    arrivals: dict[str, Any] = {"kind": "poisson", "rate": rate, "duration_s": duration_s, "seed": seed}
    if zipf > 0:
        arrivals["zipf"] = zipf
    return {
        "models": {n: dict(spec) for n in names},
        "budget": {"max_models": slots},
        "workers": {"count": workers},
        "host": {"budget_bytes": 1 << 40 if warm else 0, "prefetch": False},
        "arrivals": arrivals,
    }


def write_config(
    directory: Path, prefix: str, models: int, slots: int, replicas: int = 1, consumers: str = "on-demand", *,
    costs: dict[str, float] | None = None, warm: bool = True, max_wait_s: float | None = None,
) -> Path:  # fmt: skip
    c = COSTS if costs is None else costs
    lines = [
        f'[nats]\nprefix = "{prefix}"\n',
        f'[streams]\nreplicas = {replicas}\nconsumers = "{consumers}"\n',
        f"[worker]\nmax_resident_models = {slots}\nprefetch_weights = false\n" + ("" if warm else "host_memory_budget_bytes = 0\n"),
    ]
    opts = f"options = {{ load_cost_s = {c['load_cost_s']}, batch_cost_s = {c['batch_cost_s']}, item_cost_s = {c['item_cost_s']} }}"
    wait = f"max_wait_s = {max_wait_s}\n" if max_wait_s is not None else ""
    for i in range(models):
        lines.append(
            f'[models.m{i}]\nhandler = "sleep"\nmax_batch_size = {int(c["max_batch_size"])}\nmax_delay_s = {c["max_delay_s"]}\n{wait}'
            f"load_cost_s = {c['load_cost_s']}\nbatch_cost_s = {c['batch_cost_s']}\nitem_cost_s = {c['item_cost_s']}\n{opts}\n"
        )
    path = directory / "scale.toml"
    path.write_text("\n".join(lines))
    return path


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def worker_stats(url: str, prefix: str) -> dict[str, int]:
    """The workers' counters (their status reports, summed), including what decisions cost."""
    from jetbatch.sdk.connection import connect_nats
    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.status import collect_status

    nc = await connect_nats(url)
    try:
        reports = await collect_status(nc, Subjects(prefix), wait_s=1.0)
    finally:
        await nc.close()
    total: dict[str, int] = {}
    for r in reports:
        if r.role == "worker":
            for k, v in r.stats.items():
                total[k] = total.get(k, 0) + v
    return total


async def replay(url: str, prefix: str, arrivals: tuple[tuple[float, str], ...], timeout_s: float) -> tuple[list[float], int, int]:
    """Send each request at its trace time (open loop); latencies of the answered ones, and the
    counts of timed-out and failed requests."""
    latencies: list[float] = []
    timed_out = failed = 0
    async with sdk.Client.connect(url, prefix=prefix) as client:
        start = time.monotonic() + 0.5

        async def one(at: float, model: str) -> None:
            nonlocal timed_out, failed
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            try:
                await client.infer(b"x", model=model, timeout=timeout_s)
                latencies.append(time.monotonic() - (start + at))
            except sdk.RequestTimeout:
                timed_out += 1
            except sdk.JetbatchError:
                failed += 1

        await asyncio.gather(*(one(at, m) for at, m in arrivals))
    return latencies, timed_out, failed


def run(args: argparse.Namespace) -> dict[str, Any]:
    costs = {**COSTS, **{k: getattr(args, k) for k in COSTS if getattr(args, k, None) is not None}}
    shape = {"costs": costs, "warm": not args.no_warm, "max_wait_s": args.max_wait_s}
    raw = workload_raw(args.models, args.rate, args.duration, args.seed, args.slots, args.workers, zipf=args.zipf, **shape)
    if args.consumers == "eager" or args.consumer_create_s is not None:
        # What the simulated workers pay for a model's first load: nothing when the consumers
        # were all made at startup, else the cost given.
        raw["control"] = {"consumer_create_s": 0.0 if args.consumers == "eager" else args.consumer_create_s}
    workload = build_workload(raw)
    record: dict[str, Any] = {
        "bench": "scale", "models": args.models, "rate": args.rate, "duration_s": args.duration,
        "requests": len(workload.arrivals), "slots": args.slots, "seed": args.seed, "zipf": args.zipf, "costs": costs,
        "workers": args.workers, "cluster": args.cluster, "consumers": args.consumers,
    }  # fmt: skip
    if args.trace_out:
        Path(args.trace_out).write_text(json.dumps({
            "models": list(workload.models), "arrivals": [[t, m] for t, m in workload.arrivals],
            **costs, "max_resident_models": args.slots, "timeout_s": args.timeout,
        }))  # fmt: skip
    sim = simulate(workload, "cost-aware")
    record["simulated"] = {
        "mean_s": sum(sim.latencies_s) / max(len(sim.latencies_s), 1),
        "p50_s": percentile(sim.latencies_s, 0.5), "p99_s": percentile(sim.latencies_s, 0.99), "loads": sim.loads,
    }  # fmt: skip
    if args.ideal:
        from dataclasses import replace

        ideal = simulate(replace(workload, control=IDEAL_CONTROL), "cost-aware")
        record["simulated_ideal"] = {"p50_s": percentile(ideal.latencies_s, 0.5), "p99_s": percentile(ideal.latencies_s, 0.99), "loads": ideal.loads}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        prefix = f"scale{os.getpid()}"
        cluster = stack.enter_context(NatsCluster(3, base_dir=Path(tmp) / "cluster")) if args.cluster else None
        config = write_config(Path(tmp), prefix, args.models, args.slots, replicas=3 if cluster else 1, consumers=args.consumers, **shape)
        started = time.monotonic()
        dep = stack.enter_context(Deployment(
            config, classifier=False, store_dir=Path(tmp) / "store", http_port=-1, workers=args.workers,
            nats_url=cluster.url if cluster else None,
        ))  # fmt: skip
        record["ready_s"] = time.monotonic() - started
        workers = [p.pid for name, p in dep.procs.items() if name.startswith("worker")]
        servers = [n.pid for n in cluster.nodes] if cluster else [dep.server.pid]

        def cores() -> dict[str, float]:
            return {"workers": sum(cpu_s(p) for p in workers), "nats_servers": sum(cpu_s(p) for p in servers)}

        time.sleep(2.0)  # let startup's last calls settle before reading idle CPU
        c0, t0 = cores(), time.monotonic()
        time.sleep(args.idle_s)
        elapsed = time.monotonic() - t0
        record["idle_cores"] = {k: (v - c0[k]) / elapsed for k, v in cores().items()}
        c0, t0 = cores(), time.monotonic()
        latencies, timed_out, failed = asyncio.run(replay(dep.url, prefix, workload.arrivals, args.timeout))
        elapsed = time.monotonic() - t0
        record["busy_cores"] = {k: (v - c0[k]) / elapsed for k, v in cores().items()}
        record["live"] = {
            "mean_s": sum(latencies) / max(len(latencies), 1),
            "p50_s": percentile(latencies, 0.5), "p90_s": percentile(latencies, 0.9), "p99_s": percentile(latencies, 0.99),
            "answered": len(latencies), "timed_out": timed_out, "failed": failed,
        }  # fmt: skip
        stats = asyncio.run(worker_stats(dep.url, prefix))
    decisions = max(stats.get("decisions", 0), 1)
    record["live"]["loads"] = stats.get("loads")
    record["decision"] = {
        "count": stats.get("decisions", 0),
        "mean_s": stats.get("decision_us", 0) / 1e6 / decisions,
        "models_shown_mean": stats.get("models_shown", 0) / decisions,
    }  # fmt: skip
    # The same trace, simulated with the control-plane costs this run's workers measured
    # (Control.measured): the twin of this deployment, not of the one-server defaults.
    from dataclasses import replace

    record["control_measured"] = asdict(Control.measured(stats, workload.control))
    measured = simulate(replace(workload, control=Control.measured(stats, workload.control)), "cost-aware")
    record["simulated_measured"] = {
        "mean_s": sum(measured.latencies_s) / max(len(measured.latencies_s), 1),
        "p50_s": percentile(measured.latencies_s, 0.5), "p90_s": percentile(measured.latencies_s, 0.9),
        "p99_s": percentile(measured.latencies_s, 0.99), "loads": measured.loads,
    }  # fmt: skip
    live = record["live"]
    for key in ("simulated", "simulated_measured"):
        simd = record[key]
        record[f"live_over_{key}"] = {
            "mean": live["mean_s"] / simd["mean_s"], "p50": live["p50_s"] / simd["p50_s"], "p99": live["p99_s"] / simd["p99_s"],
            "loads": live["loads"] / max(simd["loads"], 1),
        }  # fmt: skip
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cluster", action="store_true", help="a 3-node cluster, streams with 3 replicas")
    parser.add_argument("--consumers", choices=["on-demand", "eager"], default="on-demand")
    parser.add_argument("--consumer-create-s", type=float, default=None, help="the simulator's cost of making a consumer (default: the workload's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity skew (0: every model alike)")
    for key in ("load_cost_s", "batch_cost_s", "item_cost_s", "max_batch_size", "max_delay_s"):
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, type=float, default=None, help=f"default {COSTS[key]}")
    parser.add_argument("--max-wait-s", type=float, default=None, help="the models' max_wait_s (default: from the traffic)")
    parser.add_argument("--no-warm", action="store_true", help="no host tier: every load is cold")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--ideal", action="store_true", help="also simulate with a free control plane")
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    parser.add_argument("--trace-out", help="write the trace for bench/vs_ray.py")
    args = parser.parse_args(argv)
    record = run(args)
    emit(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
