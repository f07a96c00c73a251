"""Priority classes: interactive requests among batch ones, simulated and live, side by side.

The issue's workload: 8 models, cold loads 0.1-2 s spaced geometrically (batch costs growing with
the load cost, as in ``bench.scheduler.open``), Zipf(1.1) popularity, Poisson arrivals at a
utilisation ρ of 0.7 (full-batch compute), one model slot, no warm tier. Each run is simulated
twice on the same arrivals: without classes (every request interactive, as requests without the
header are) and with ``--share`` of them interactive, the rest batch. Reported per seed:

- interactive p50 / p99 with classes against the p99 of all requests without them (the classes
  are drawn at random, so the no-class p99 is that of the same requests);
- batch-class throughput (its completions over the run) against the same requests' without classes;
- the longest wait of a batch-class request, against the longest wait without classes;
- ``p99_floor_s``: no policy can give the interactive class a lower p99 on this workload: with
  every request computed (ρ of the device) only ``1 − ρ`` of it is left for loads, and a model
  loaded every T seconds leaves a request arriving at a random time waiting up to T. Cutting the
  interactive tail to x needs every model but the rarest 1% of interactive traffic visited every
  x seconds: sum of their load costs / (1 − ρ) ≤ x (see docs/scheduler.md).

``--live``: the same shape shrunk to run in minutes (loads ×``--live-scale``, ``--live-duration`` s)
against a real nats-server and one ``jetbatch worker`` process on the ``sleep`` handler, each
request sent at its trace time with its class; the simulator runs the same trace beside it.

    python -m bench.scheduler.priority --seeds 1,2,3                  # the simulator, the issue's workload
    python -m bench.scheduler.priority --seeds 1 --live               # and the live worker beside it
    python -m bench.scheduler.priority --variants 1.0,0.5,0.25        # interactive_bound_share trade-off
    python -m bench.scheduler.priority --seeds 2 --duration 10 --live --live-duration 30 --live-layout in-process
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from jetbatch.sidecar.config import load_config
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.simulator import Workload, build_workload, simulate
from jetbatch.sidecar.simulator.report import SimResult

from bench import harness
from bench.harness import emit, in_process, processes, server, worker_stats

N_MODELS = 8


def costs(scale: float = 1.0) -> dict[str, dict[str, float]]:
    """Per model: load 0.1-2 s (× ``scale``), batch costs as ``bench.scheduler.open``."""
    out = {}
    for k in range(N_MODELS):
        load = 0.1 * 20 ** (k / (N_MODELS - 1))
        out[f"m{k}"] = {
            "load_cost_s": round(load * scale, 4),
            "batch_cost_s": round(0.01 + 0.02 * load, 4),
            "item_cost_s": round(0.001 + 0.002 * load, 5),
            "max_batch_size": 16,
        }
    return out


def workload(seed: int, share: float | None, duration_s: float, scale: float = 1.0, options: dict[str, Any] | None = None) -> Workload:
    arrivals: dict[str, Any] = {"kind": "poisson", "utilization": 0.7, "zipf": 1.1, "duration_s": duration_s, "seed": seed}
    if share is not None:
        arrivals["interactive_share"] = share
    return build_workload({"models": costs(scale), "budget": {"max_models": 1}, "arrivals": arrivals, "policy": options or {}})


def p99_floor_s(w: Workload, busy_share: float) -> float:
    """The lowest interactive p99 any policy can give ``w`` (the module docstring's argument):
    the cheapest set of models to visit every x seconds so that at most 1% of the interactive
    requests wait longer, paid from the device time computing leaves."""
    classes = w.interactive or (True,) * len(w.arrivals)
    counts: dict[str, int] = {}
    for (_, model), urgent in zip(w.arrivals, classes):
        if urgent:
            counts[model] = counts.get(model, 0) + 1
    total = sum(counts.values())
    share = {m: c / total for m, c in counts.items()}
    # Skip (visit less often) the models whose interactive share per second of load is least,
    # while their requests stay within the 1% allowed to wait longer.
    left, cost = 0.01, 0.0
    for m in sorted(share, key=lambda m: share[m] / w.models[m].load_cost_s):
        skipped = min(1.0, left / share[m])
        left -= skipped * share[m]
        cost += (1.0 - skipped) * w.models[m].load_cost_s
    return cost / max(1e-9, 1.0 - busy_share)


def _by_class(r: SimResult) -> dict[str, list[float]]:
    return r.latency_by_class or {"interactive": r.latencies_s}


def compare(plain: SimResult, classed: SimResult, w: Workload) -> dict[str, Any]:
    """Interactive tail, batch throughput and batch wait with classes, against no classes."""
    lat = _by_class(classed)
    n_batch = len(lat.get("batch", []))
    busy = sum(end - start for start, end, *_ in plain.batches) / max(plain.makespan_s, 1e-9)
    return {
        "interactive_p50_s": percentile(lat["interactive"], 0.5),
        "interactive_p99_s": percentile(lat["interactive"], 0.99),
        "batch_p50_s": percentile(lat.get("batch", [0.0]), 0.5),
        "batch_p99_s": percentile(lat.get("batch", [0.0]), 0.99),
        "no_classes_p50_s": percentile(plain.latencies_s, 0.5),
        "no_classes_p99_s": percentile(plain.latencies_s, 0.99),
        "interactive_p99_ratio": percentile(lat["interactive"], 0.99) / percentile(plain.latencies_s, 0.99),
        # The same batch-class requests, computed over each run's makespan.
        "batch_throughput_ratio": (n_batch / classed.makespan_s) / (n_batch / plain.makespan_s) if n_batch else 1.0,
        "batch_max_latency_s": max(lat.get("batch", [0.0])),
        "no_classes_max_latency_s": max(plain.latencies_s),
        "loads": classed.loads, "no_classes_loads": plain.loads,
        "busy_share": busy,
        "p99_floor_s": p99_floor_s(w, busy),
        "served_fraction": classed.served_fraction(),
    }  # fmt: skip


def simulated(seed: int, share: float, duration_s: float, options: dict[str, Any]) -> dict[str, Any]:
    w = workload(seed, share, duration_s, options=options)
    plain = simulate(replace(w, interactive=()), "cost-aware")
    classed = simulate(w, "cost-aware")
    return compare(plain, classed, w)


# --- live --------------------------------------------------------------------------------------


def write_config(directory: Path, prefix: str, scale: float) -> Path:
    """The live config of :func:`workload`: each model on the ``sleep`` handler at its costs, one slot, no warm tier."""
    models = {}
    for name, c in costs(scale).items():
        cost = {k: c[k] for k in ("load_cost_s", "batch_cost_s", "item_cost_s")}
        models[name] = {"handler": "sleep", "max_batch_size": 16, "max_delay_s": 0.005, **cost, "options": cost}
    worker = {"max_resident_models": 1, "prefetch_weights": False, "host_memory_budget_bytes": 0}
    return harness.write_config({"nats": {"prefix": prefix}, "worker": worker, "models": models}, directory, prefix)


async def replay(url: str, prefix: str, w: Workload, timeout_s: float) -> dict[str, list[float]]:
    """Each request at its trace time with its class; latencies per class (open loop), and the
    failed requests (timed out or refused) under ``failed``."""
    classes = tuple("interactive" if urgent else "batch" for urgent in (w.interactive or (True,) * len(w.arrivals)))
    run = await harness.replay(url, prefix, w.arrivals, timeout_s, classes=classes)
    return {"interactive": [], "batch": [], **run.by_class, "failed": [0.0] * (run.timed_out + run.failed)}


async def _in_process(url: str, config: Path, prefix: str, trace: Workload, timeout_s: float) -> tuple[dict[str, list[float]], dict[str, int]]:
    async with in_process(load_config(str(config)), url) as worker:
        lat = await replay(url, prefix, trace, timeout_s)
        return lat, worker.stats.snapshot()


def live(seed: int, share: float, duration_s: float, scale: float, timeout_s: float, layout: str = "processes") -> dict[str, Any]:
    """The shrunk workload, without and with classes, live and simulated on the same traces;
    ``layout``: the worker in its own process, or on the producer's event loop."""
    w = workload(seed, share, duration_s, scale)
    out: dict[str, Any] = {}
    with server() as nats, tempfile.TemporaryDirectory() as tmp:
        for label, trace in (("no_classes", replace(w, interactive=())), ("classes", w)):
            prefix = f"prio{label[:2]}{seed}"
            config = write_config(Path(tmp), prefix, scale)
            if layout == "in-process":
                lat, stats = asyncio.run(_in_process(nats.url, config, prefix, trace, timeout_s))
            else:
                with processes(config, nats.url, classifier=False, store_dir=Path(tmp) / f"store-{label}", http_port=-1):
                    lat = asyncio.run(replay(nats.url, prefix, trace, timeout_s))
                    stats = asyncio.run(worker_stats(nats.url, prefix))
            sim = simulate(trace, "cost-aware")
            sim_lat = _by_class(sim)
            out[label] = {
                "live": {c: {"n": len(v), "p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)} for c, v in lat.items() if v and c != "failed"},
                "failed": len(lat["failed"]),
                "loads": {"live": stats.get("loads"), "simulated": sim.loads},
                "simulated": {c: {"n": len(v), "p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)} for c, v in sim_lat.items()},
            }  # fmt: skip
    for side in ("live", "simulated"):
        base = out["no_classes"][side]["interactive"]["p99_s"]
        out[f"{side}_interactive_p99_ratio"] = out["classes"][side]["interactive"]["p99_s"] / base
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--share", type=float, default=0.2, help="the interactive share")
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals")
    parser.add_argument("--variants", default="", help="interactive_bound_share values to compare (default: the policy's)")
    parser.add_argument("--live", action="store_true", help="also run the shrunk workload live, beside its simulation")
    parser.add_argument("--live-scale", type=float, default=0.25, help="load costs × this, live")
    parser.add_argument("--live-duration", type=float, default=90.0)
    parser.add_argument("--live-layout", choices=["processes", "in-process"], default="processes", help="the worker in its own process, or on the producer's loop")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    variants: list[dict[str, Any]] = [{}] + [{"interactive_bound_share": float(v)} for v in args.variants.split(",") if v]
    record: dict[str, Any] = {"bench": "priority", "share": args.share, "duration_s": args.duration, "seeds": seeds, "runs": []}
    for options in variants:
        for seed in seeds:
            record["runs"].append({"seed": seed, "options": options, **simulated(seed, args.share, args.duration, options)})
    if args.live:
        record["live"] = {seed: live(seed, args.share, args.live_duration, args.live_scale, args.timeout, args.live_layout) for seed in seeds}
    emit(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
