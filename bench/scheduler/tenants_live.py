"""Fair shares between tenants, live: ``bench.scheduler.tenants``'s flood shrunk to minutes, sent
through a real classifier to a real worker, with its simulation on the same arrivals beside it.

Four ``sleep`` models on one slot (loads 0.5 s × ``--load-scale``, batches of 16 at 20 ms + 2 ms
a request, × ``--batch-scale``; by default 0.2 s loads and 40 ms + 4 ms batches: the load-to-batch
ratio of loads × 0.2 at the simulated batch costs, at half their rates, so the flood's ~600
requests a second leave a shared 2-core machine to the sidecars); tenants a and b at 35% of capacity each, each sending through
the classifier on its own ingress (``sdk.Client.connect(url, prefix=..., tenant="a")``), every
request interactive and sent at its time (open loop, one Poisson stream per tenant as
``simulator/workloads.py`` draws them: the workload's ``arrivals`` and ``tenants`` are the trace),
each with a timeout far past any wait, so a request that never comes back is lost, not late.
Tenant a sends 10x for ``--flood-s`` after ``--calm-s``; ``--calm-s`` more follow. A flooded run
lasts about 3x the flood longer than its arrivals: a's excess drains after them.

Three live runs on fresh subject prefixes of one nats-server, each simulated on its own arrivals:

- **calm**: the same seeds without the surge (b's arrivals are the same requests);
- **shares**: the flood, the classifier's fair shares as configured (``[tenants]`` left at its
  defaults: equal weights, as the simulated workload's);
- **fcfs**: the flood with shares off. A live config cannot turn them off (``[tenants]`` absent
  still shares), so this run replaces the classifier's ``shares.admit`` with one that admits
  every request as it came (``tenancy.Verdict()``), as ``[tenancy] enabled = false`` does in the
  simulator.

Reported per run and tenant: p50 / p99 live and simulated (and live ÷ simulated), requests
demoted (``classifier.shares.demoted``; the simulator's ``by_tenant.demoted``), lost (timed out
or failed), loads, throughput (answered ÷ the time to the last answer); and b's p99 with the
flood ÷ calm, throughput with shares ÷ without, live and simulated. Each run is simulated twice:
with the default control costs, and told those the live worker measured (its status counters,
``Control.measured``), which leaves out what the worker's own bookkeeping explains.

    python -m bench.scheduler.tenants_live                         # ~4 min: calm 35 s, 2 floods of ~80 s
    python -m bench.scheduler.tenants_live --seed 2 --json out.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from jetbatch import sdk
from jetbatch.sidecar.config import load_config
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.simulator import Workload, build_workload, simulate
from jetbatch.sidecar.simulator.workloads import Control
from jetbatch.sidecar.tenancy import Verdict

from bench import harness
from bench.harness import emit, server

N_MODELS = 4
RUNS = ("calm", "shares", "fcfs")


def costs(load_scale: float, batch_scale: float) -> dict[str, dict[str, float]]:
    """Per model: ``bench.scheduler.tenants``'s costs, loads × ``load_scale``, batches × ``batch_scale``."""
    one = {"load_cost_s": 0.5 * load_scale, "batch_cost_s": 0.02 * batch_scale, "item_cost_s": 0.002 * batch_scale}
    return {f"m{k}": dict(one) for k in range(N_MODELS)}


def workload(run: str, args: argparse.Namespace) -> Workload:
    """The run's arrivals (both tenants, in time order) and the simulator's rules for them."""
    duration_s = 2 * args.calm_s + args.flood_s
    tenants: dict[str, Any] = {"a": {"utilization": 0.35}, "b": {"utilization": 0.35}}
    if run != "calm":
        tenants["a"]["surge"] = {"factor": 10, "start_s": args.calm_s, "duration_s": args.flood_s}
    models = {name: {**c, "max_batch_size": 16} for name, c in costs(args.load_scale, args.batch_scale).items()}
    return build_workload({
        "models": models, "arrivals": {"kind": "poisson", "duration_s": duration_s, "seed": args.seed},
        "tenants": tenants, "tenancy": {"enabled": run != "fcfs"},
    })  # fmt: skip


def write_config(directory: Path, prefix: str, args: argparse.Namespace) -> Path:
    """The live config of :func:`workload`: each model on the ``sleep`` handler at its costs, one
    slot, no warm tier; the classifier forwards each request to the model it names."""
    models = {}
    for name, c in costs(args.load_scale, args.batch_scale).items():
        models[name] = {"handler": "sleep", "max_batch_size": 16, "max_delay_s": 0.005, **c, "options": c}
    worker = {"max_resident_models": 1, "prefetch_weights": False, "host_memory_budget_bytes": 0}
    classifier = {"max_delay_ms": 5, "router": "rules", "default_model": "m0"}
    return harness.write_config({"nats": {"prefix": prefix}, "worker": worker, "classifier": classifier, "models": models}, directory, prefix)


async def send(url: str, prefix: str, w: Workload, timeout_s: float, lead_s: float = 0.5) -> dict[str, Any]:
    """Each arrival at ``lead_s`` + its time through its tenant's client (open loop); per tenant
    the answered latencies (seconds from the arrival's time) and the lost; the last answer's time."""
    lat: dict[str, list[float]] = {t: [] for t in sorted(set(w.tenants))}
    lost = dict.fromkeys(lat, 0)
    last = [0.0]
    async with contextlib.AsyncExitStack() as stack:
        clients = {t: await stack.enter_async_context(sdk.Client.connect(url, prefix=prefix, tenant=t)) for t in lat}
        start = time.monotonic() + lead_s

        async def one(at: float, model: str, tenant: str) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            try:
                await clients[tenant].infer(b"x", model=model, timeout=timeout_s)
            except sdk.JetbatchError:
                lost[tenant] += 1
                return
            done = time.monotonic() - start
            lat[tenant].append(done - at)
            last[0] = max(last[0], done)

        await asyncio.gather(*(one(at, m, t) for (at, m), t in zip(w.arrivals, w.tenants)))
    return {"latencies_s": lat, "lost": lost, "makespan_s": last[0]}


async def live_run(url: str, config: Path, w: Workload, shares: bool, timeout_s: float, layout: str, store: Path) -> dict[str, Any]:
    cfg = load_config(str(config))
    prefix = cfg.nats.prefix
    async with harness.classifier_in_process(cfg, url) as classifier:
        if not shares:
            # First come, first served between tenants: every request admitted as it came.
            classifier.shares.admit = lambda *a, **k: Verdict()  # type: ignore[method-assign]
        if layout == "in-process":
            async with harness.in_process(cfg, url) as worker:
                sent = await send(url, prefix, w, timeout_s)
                stats = worker.stats.snapshot()
        else:
            with harness.processes(config, url, classifier=False, store_dir=store, http_port=-1):
                sent = await send(url, prefix, w, timeout_s)
                stats = await harness.worker_stats(url, prefix)
        sent["demoted"] = dict(classifier.shares.demoted)
        sent["loads"] = stats.get("loads")
        sent["stats"] = stats
    return sent


def _pcts(v: list[float]) -> dict[str, float]:
    return {"n": len(v), "p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)} if v else {"n": 0}


def simulated(w: Workload) -> dict[str, Any]:
    r = simulate(w, "cost-aware")
    by = r.summary(w)["by_tenant"]
    return {
        "tenants": {t: _pcts(r.latency_by_tenant.get(t, [])) for t in sorted(set(w.tenants))},
        "demoted": {t: by[t]["demoted"] for t in by if by[t]["demoted"]},
        "loads": r.loads,
        "throughput_rps": r.completed / r.makespan_s if r.makespan_s else 0.0,
        "lost": len(w.arrivals) - (r.completed + r.deadline_exceeded + r.cancelled + sum(r.refused_by_tenant.values())),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    record: dict[str, Any] = {
        "bench": "tenants_live", "seed": args.seed, "calm_s": args.calm_s, "flood_s": args.flood_s, "load_scale": args.load_scale,
        "batch_scale": args.batch_scale, "layout": args.layout, "runs": {},
    }  # fmt: skip
    with server() as nats, tempfile.TemporaryDirectory() as tmp:
        for name in args.runs.split(","):
            w = workload(name, args)
            config = write_config(Path(tmp), harness.fresh_prefix(f"tl{name}"), args)
            got = asyncio.run(live_run(nats.url, config, w, name != "fcfs", args.timeout, args.layout, Path(tmp) / f"store-{name}"))
            sim = simulated(w)
            # The same, told the control costs the live worker measured (its counters): what is
            # left between it and the live run is not the worker's own bookkeeping.
            told = simulated(replace(w, control=Control.measured(got["stats"], w.control)))
            live_t = {t: _pcts(v) for t, v in got["latencies_s"].items()}
            for t, p in live_t.items():
                for key, side in (("", sim), ("_measured_control", told)):
                    s = side["tenants"][t]
                    if p["n"] and s["n"]:
                        p[f"p50_ratio{key}"], p[f"p99_ratio{key}"] = p["p50_s"] / s["p50_s"], p["p99_s"] / s["p99_s"]
            answered = sum(p["n"] for p in live_t.values())
            record["runs"][name] = {
                "requests": len(w.arrivals),
                "live": {"tenants": live_t, "demoted": got["demoted"], "lost": got["lost"], "loads": got["loads"],
                         "throughput_rps": answered / got["makespan_s"] if got["makespan_s"] else 0.0},
                "simulated": sim,
                "simulated_measured_control": told,
            }  # fmt: skip
            print(f"{name}: {record['runs'][name]}", file=sys.stderr, flush=True)
    runs = record["runs"]

    def b_p99(run: str, side: str) -> float:
        return runs[run][side]["tenants"]["b"]["p99_s"]

    for side in ("live", "simulated", "simulated_measured_control"):
        if "calm" in runs and "shares" in runs:
            record[f"{side}_b_p99_flood_over_calm"] = b_p99("shares", side) / b_p99("calm", side)
            if "fcfs" in runs:
                record[f"{side}_b_p99_flood_over_calm_fcfs"] = b_p99("fcfs", side) / b_p99("calm", side)
        if "shares" in runs and "fcfs" in runs:
            record[f"{side}_throughput_shares_over_fcfs"] = runs["shares"][side]["throughput_rps"] / runs["fcfs"][side]["throughput_rps"]
    record["lost"] = sum(sum(r["live"]["lost"].values()) + r["simulated"]["lost"] for r in runs.values())
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calm-s", type=float, default=10.0, help="seconds before the flood, and after it")
    parser.add_argument("--flood-s", type=float, default=15.0, help="how long tenant a sends 10x")
    parser.add_argument("--load-scale", type=float, default=0.4, help="load costs × this (0.5 s in bench.scheduler.tenants)")
    parser.add_argument("--batch-scale", type=float, default=2.0, help="batch costs × this (the rates ÷ it: less CPU live)")
    parser.add_argument("--runs", default=",".join(RUNS), help="which of calm, shares, fcfs")
    parser.add_argument("--layout", choices=["processes", "in-process"], default="processes", help="the worker in its own process, or on this loop")
    parser.add_argument("--timeout", type=float, default=600.0, help="each request's timeout: far past any wait, so none is lost")
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    emit(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
