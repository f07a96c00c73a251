"""Scheduler figures, simulator and live system side by side in one run.

1. Closed burst, 4 models x 64 interleaved requests, max batch 16, load 0.5 s, batch 5 ms +
   0.1 ms/item, one slot: makespan against the offline lower bound, cost-aware vs fifo.
2. Poisson arrivals at 70% of capacity, 4 models, one slot: throughput against offered load,
   p99 against max_wait + one load + one batch, loads per minute, against fifo, round-robin and
   exhaustive.
3. Two slots, 6 models with Zipf popularity and tenfold load-cost differences: loads (and load
   seconds) per 1000 requests, cost-aware eviction against LRU.

The live runs use the `sleep` handler in a real worker on a real nats-server, with the same
costs; the live fifo burst is scaled down (4 x 16 requests) because fifo at full size takes over
two minutes of simulated loading. Run:

    python -m bench.scheduler.figures [--live-duration 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from jetbatch import sdk
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.simulator import build_workload, simulate
from jetbatch.sidecar.streams import ensure_model_consumer, ensure_streams
from jetbatch.sidecar.transport import connect

from bench import harness

LOAD_S, FIXED_S, ITEM_S, BATCH = 0.5, 0.005, 0.0001, 16
MODELS4 = {f"m{i}": {"load_cost_s": LOAD_S, "batch_cost_s": FIXED_S, "item_cost_s": ITEM_S, "max_batch_size": BATCH, "max_wait_s": 10.0} for i in range(4)}


def sim_figures() -> dict[str, Any]:
    out: dict[str, Any] = {}
    burst = build_workload({"models": MODELS4, "arrivals": {"kind": "burst", "per_model": 64}})
    out["burst"] = {p: simulate(burst, p).summary(burst) for p in ("cost-aware", "exhaustive", "fifo", "round-robin")}
    poisson = build_workload({"models": MODELS4, "arrivals": {"kind": "poisson", "utilization": 0.7, "duration_s": 120, "seed": 1}})
    out["poisson"] = {p: simulate(poisson, p).summary(poisson) for p in ("cost-aware", "exhaustive", "round-robin", "fifo")}
    out["poisson_offered_rps"] = len(poisson.arrivals) / 120
    zipf_models = {
        f"{kind}{i}": {"load_cost_s": 2.0 if kind == "big" else 0.2, "max_batch_size": BATCH, "max_wait_s": 5.0}
        for i in range(1, 4)
        for kind in ("big", "small")
    }
    for rate in (2.0, 10.0):
        zipf = build_workload({"models": zipf_models, "budget": {"max_models": 2}, "arrivals": {"kind": "poisson", "rate": rate, "duration_s": 300, "zipf": 1.1, "seed": 3}})
        out[f"zipf_rate_{rate:g}"] = {p: simulate(zipf, p).summary(zipf) for p in ("cost-aware", "cost-aware-lru")}
    out["tiers"] = tier_figures()
    return out


def tier_figures() -> dict[str, Any]:
    """The warm tier in the scheduler's figures: the closed burst and the Poisson workload above,
    with every load cold (no host tier) against a host tier with prefetch (the next model read
    while the device computes; a warm load costs a tenth of a cold one, the ratio
    bench/models/loading.py measures on CPU for a 134 MB model is 0.05-0.06)."""
    out: dict[str, Any] = {}
    warm_models = {name: {**m, "warm_load_cost_s": LOAD_S / 10, "memory_bytes": 1} for name, m in MODELS4.items()}
    for label, arrivals in (
        ("burst", {"kind": "burst", "per_model": 64}),
        ("poisson", {"kind": "poisson", "utilization": 0.7, "duration_s": 120, "seed": 1}),
    ):
        for tier, host in (("cold only", {}), ("warm tier + prefetch", {"host": {"budget_bytes": 4, "prefetch": True}})):
            w = build_workload({"models": warm_models, "arrivals": arrivals, **host})
            out[f"{label} / {tier}"] = simulate(w, "cost-aware").summary(w)
    return out


def live_config(policy: str, tag: str, n_models: int = 4) -> Config:
    model = {
        "handler": "sleep", "max_batch_size": BATCH, "max_delay_ms": 2, "load_cost_s": LOAD_S, "batch_cost_s": FIXED_S,
        "item_cost_s": ITEM_S, "max_wait_ms": 10_000, "options": {"load_cost_s": LOAD_S, "batch_cost_s": FIXED_S, "item_cost_s": ITEM_S},
    }  # fmt: skip
    return harness.config(
        {
            "streams": {"max_deliver": 1000, "ack_wait_s": 60},  # fifo naks the request that ends a run
            # No warm tier: the simulator's workload has none either, so both pay the same loads.
            "worker": {"policy": policy, "poll_interval_ms": 50, "max_resident_models": 1, "coordinate": False, "host_memory_budget_bytes": 0},
            "models": {f"m{i}": model for i in range(n_models)},
        },
        tag=tag,
    )


async def live_burst(url: str, policy: str, per_model: int) -> dict[str, float]:
    cfg = live_config(policy, "b")
    prefix = cfg.nats.prefix
    nc = await connect(cfg.nats, url)
    js = nc.jetstream()
    await ensure_streams(js, cfg.subjects, cfg.streams, cfg.models)
    for m in cfg.models:
        await ensure_model_consumer(js, cfg.subjects, cfg.streams, m)
    names = [f"m{k % 4}" for k in range(4 * per_model)]
    async with sdk.Client.connect(url, prefix=prefix) as client:
        # Publish one by one so the stream holds them interleaved in this order.
        calls = []
        for i, m in enumerate(names):
            calls.append(asyncio.ensure_future(client.infer_result(f"{i}".encode(), model=m, timeout=600)))
            while (await js.stream_info(cfg.subjects.models_stream)).state.messages < i + 1:
                await asyncio.sleep(0.001)
        # The clock starts when the worker can pull (not at its startup).
        async with harness.in_process(cfg, url) as worker:
            started = time.perf_counter()
            results = await asyncio.gather(*calls)
            makespan = time.perf_counter() - started
    await nc.close()
    bound = 4 * (LOAD_S + -(-per_model // BATCH) * FIXED_S + per_model * ITEM_S)
    return {"makespan_s": makespan, "lower_bound_s": bound, "ratio_to_bound": makespan / bound,
            "loads": worker.stats["loads"], "batches": len({r.batch.batch_id for r in results})}  # fmt: skip


async def live_poisson(url: str, policy: str, trace: tuple[tuple[float, str], ...], duration_s: float) -> dict[str, float]:
    """Replay ``trace`` (the simulator's own arrivals) against a live worker."""
    cfg = live_config(policy, "p")
    latencies: list[float] = []
    async with harness.in_process(cfg, url) as worker, sdk.Client.connect(url, prefix=cfg.nats.prefix) as client:

        async def one(m: str) -> None:
            try:
                r = await client.infer_result(b"x", model=m, timeout=duration_s + 60)
                latencies.append(r.latency_s)
            except sdk.RequestTimeout:
                pass

        tasks = []
        started = time.perf_counter()
        for at, model in trace:
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(model)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "offered_rps": len(trace) / duration_s,
        "throughput_rps": len(latencies) / elapsed,
        "answered": len(latencies),
        "sent": len(trace),
        "mean_ms": sum(latencies) / len(latencies) * 1000 if latencies else float("nan"),
        "p99_ms": percentile(latencies, 0.99) * 1000 if latencies else float("nan"),
        "loads_per_minute": worker.stats["loads"] / (elapsed / 60),
    }


async def live_figures(live_duration_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Live capacity reference: what the sleep handler sustains in full batches, without loads.
    capacity = BATCH / (FIXED_S + ITEM_S * BATCH)
    # On two shared cores the live worker and this load generator add their own per-request CPU
    # time; offer 70% of the *simulated* device capacity, capped at what one Python process
    # generates reliably here.
    rate = min(0.7 * capacity, 400.0)
    with harness.server() as server:
        out["burst_full_cost_aware"] = await live_burst(server.url, "cost-aware", 64)
        out["burst_small_cost_aware"] = await live_burst(server.url, "cost-aware", 16)
        out["burst_small_fifo"] = await live_burst(server.url, "fifo", 16)
        out["poisson_rate"] = rate
        # The same arrivals live and simulated: the simulator's trace, replayed.
        sim_poisson = build_workload({"models": MODELS4, "arrivals": {"kind": "poisson", "rate": rate, "duration_s": live_duration_s, "seed": 1}})
        for policy in ("cost-aware", "exhaustive", "round-robin"):
            out[f"poisson_{policy}"] = await live_poisson(server.url, policy, sim_poisson.arrivals, live_duration_s)
        # Live against simulated on the same trace at lower rates: where the live per-request CPU
        # (which the simulator does not model) matters less.
        for low in (100.0, 200.0):
            trace = build_workload({"models": MODELS4, "arrivals": {"kind": "poisson", "rate": low, "duration_s": 20, "seed": 1}})
            out[f"agreement_{low:g}"] = {
                "live": await live_poisson(server.url, "cost-aware", trace.arrivals, 20),
                "sim": simulate(trace, "cost-aware").summary(trace),
            }
    small = build_workload({"models": MODELS4, "arrivals": {"kind": "burst", "per_model": 16}})
    out["sim_burst_small"] = {p: simulate(small, p).summary(small) for p in ("cost-aware", "fifo")}
    out["sim_poisson_same_rate"] = {p: simulate(sim_poisson, p).summary(sim_poisson) for p in ("cost-aware", "exhaustive", "round-robin")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live-duration", type=float, default=20.0)
    parser.add_argument("--no-live", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {"sim": sim_figures()}
    if not args.no_live:
        result["live"] = asyncio.run(live_figures(args.live_duration))
    harness.emit(result, args.json)


if __name__ == "__main__":
    main()
