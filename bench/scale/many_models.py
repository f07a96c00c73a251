"""Many registered models on one worker: the live worker against its simulator on one trace.

One worker process (`jetbatch worker`, the `sleep` handler: load and batch are sleeps of known
length, so the device time is the workload's, not this machine's) or `--workers N`, one
nats-server with its default configuration (1 MiB `max_payload`, as compose's) or `--cluster`
(3 nodes, streams with 3 replicas),
`--models N` registered models, Zipf(1.1) popularity and Poisson arrivals at `--rate` req/s for
`--duration` s. The same arrivals are fed to the simulator (with the control plane's measured
costs, ``Workload.control``) and, with ``--ideal``, to the simulator with a free control plane.
Before the traffic, the idle CPU of the worker and of nats-server is read from /proc over
`--idle-s` seconds, and the time from the worker's start to its readiness; after it, the
resident memory of each worker (now and its peak) and server.

    python -m bench.scale.many_models --models 200 --rate 40 --duration 60 [--json out.json] [--trace-out trace.json]
    python -m bench.scale.many_models --models 1000 --rate 20 --workers 4 --cluster

``--trace-out`` writes the trace and costs in the format ``bench.peers.vs_ray`` reads, so Ray
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
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.simulator import simulate
from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL, Control, build_workload

from bench import harness
from bench.harness import cpu_s, emit, worker_stats
from bench.harness.simulated import COSTS, scale_workload, sleep_sections


def run(args: argparse.Namespace) -> dict[str, Any]:
    costs = {**COSTS, **{k: getattr(args, k) for k in COSTS if getattr(args, k, None) is not None}}
    shape = {"costs": costs, "warm": not args.no_warm, "max_wait_s": args.max_wait_s}
    raw = scale_workload(args.models, args.rate, args.duration, args.seed, args.slots, args.workers, zipf=args.zipf, **shape)
    raw["workers"]["shards"] = args.shards
    if args.consumers == "eager" or args.consumer_create_s is not None:
        # What the simulated workers pay for a model's first load: nothing when the consumers
        # were all made at startup, else the cost given.
        raw["control"] = {"consumer_create_s": 0.0 if args.consumers == "eager" else args.consumer_create_s}
    workload = build_workload(raw)
    record: dict[str, Any] = {
        "bench": "scale", "models": args.models, "rate": args.rate, "duration_s": args.duration,
        "requests": len(workload.arrivals), "slots": args.slots, "seed": args.seed, "zipf": args.zipf, "costs": costs,
        "workers": args.workers, "shards": args.shards, "cluster": args.cluster, "consumers": args.consumers,
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
        # Servers with nats-server's default configuration (1 MiB max_payload, as compose keeps
        # it), not jetbatch's embedded 8 MiB one: a ceiling of the default must show here.
        cluster = stack.enter_context(harness.cluster(3, base_dir=Path(tmp) / "cluster", max_payload=None)) if args.cluster else None
        server = None if cluster else stack.enter_context(harness.server(store_dir=Path(tmp) / "nats", max_payload=None))
        sections = sleep_sections(prefix, args.models, args.slots, replicas=3 if cluster else 1, consumers=args.consumers, **shape)
        # Sharded: worker i registers models m_i, m_(i + workers)..., as the simulated ones do
        # (and no config lists them all: 100 000 models are past a config file's size limit).
        shards = [
            harness.write_config({**sections, "models": dict(list(sections["models"].items())[i :: args.workers])}, tmp, f"scale-{i}")
            for i in range(args.workers)
        ] if args.shards else None  # fmt: skip
        config = shards[0] if shards else harness.write_config(sections, tmp, "scale")
        started = time.monotonic()
        dep = stack.enter_context(harness.processes(
            config, cluster.url if cluster else server.url if server else None, classifier=False, store_dir=Path(tmp) / "store", http_port=-1, workers=args.workers,
            worker_config_paths=shards, ready_timeout_s=args.startup_timeout,
        ))  # fmt: skip
        record["ready_s"] = time.monotonic() - started
        workers = [p.pid for name, p in dep.procs.items() if name.startswith("worker")]
        servers = [n.pid for n in cluster.nodes] if cluster else [server.pid] if server else []

        def alive(pids: list[int]) -> list[int]:
            return [p for p in pids if Path(f"/proc/{p}").exists()]  # a node killed on purpose (--kill-node-at) is not read

        def cores() -> dict[str, float]:
            return {"workers": sum(cpu_s(p) for p in workers), "nats_servers": sum(cpu_s(p) for p in alive(servers))}

        time.sleep(2.0)  # let startup's last calls settle before reading idle CPU
        c0, t0 = cores(), time.monotonic()
        time.sleep(args.idle_s)
        elapsed = time.monotonic() - t0
        record["idle_cores"] = {k: (v - c0[k]) / elapsed for k, v in cores().items()}
        c0, t0 = cores(), time.monotonic()
        if cluster is not None and args.kill_node_at is not None:
            # A node lost mid-traffic: whoever was connected to it reconnects to the others, its
            # streams elect new leaders where it led, and nothing may be lost.
            killer = threading.Timer(args.kill_node_at, cluster.nodes[-1].kill)
            killer.start()
            stack.callback(killer.cancel)
            record["killed_node_at_s"] = args.kill_node_at
        replayed = asyncio.run(harness.replay(dep.url, prefix, workload.arrivals, args.timeout))
        latencies, timed_out, failed = replayed.latencies_s, replayed.timed_out, replayed.failed
        elapsed = time.monotonic() - t0
        record["busy_cores"] = {k: (v - c0[k]) / elapsed for k, v in cores().items()}
        record["live"] = {
            "mean_s": sum(latencies) / max(len(latencies), 1),
            "p50_s": percentile(latencies, 0.5), "p90_s": percentile(latencies, 0.9), "p99_s": percentile(latencies, 0.99),
            "answered": len(latencies), "timed_out": timed_out, "failed": failed,
        }  # fmt: skip
        stats = asyncio.run(worker_stats(dep.url, prefix))
        # Memory after the traffic: now and the peak, per worker and per server (MiB).
        record["rss_mib"] = {
            "workers": [round(harness.rss_kib(p) / 1024, 1) for p in workers],
            "workers_peak": [round(harness.rss_kib(p, "VmHWM") / 1024, 1) for p in workers],
            "nats_servers": [round(harness.rss_kib(p) / 1024, 1) for p in alive(servers)],
        }  # fmt: skip
    decisions = max(stats.get("decisions", 0), 1)
    record["live"]["loads"] = stats.get("loads")
    record["live"]["batch_mean"] = stats.get("requests", 0) / max(stats.get("batches", 0), 1)
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
        "batch_mean": sum(b[3] for b in measured.batches) / max(len(measured.batches), 1),
    }  # fmt: skip
    live = record["live"]
    for key in ("simulated", "simulated_measured"):
        simd = record[key]
        record[f"live_over_{key}"] = {
            "mean": live["mean_s"] / simd["mean_s"], "p50": live["p50_s"] / simd["p50_s"], "p99": live["p99_s"] / simd["p99_s"],
            "loads": live["loads"] / max(simd["loads"], 1),
            **({"batch_mean": live["batch_mean"] / simd["batch_mean"]} if simd.get("batch_mean") else {}),
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
    parser.add_argument("--kill-node-at", type=float, default=None, help="with --cluster: kill -9 one node this many seconds into the traffic")
    parser.add_argument("--shards", action="store_true", help="each model registered by one worker only (model i by worker i mod N)")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds the workers have to report ready")
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
    parser.add_argument("--trace-out", help="write the trace for bench/peers/vs_ray.py")
    args = parser.parse_args(argv)
    record = run(args)
    emit(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
