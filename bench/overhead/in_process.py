"""SDK → worker (identity model) against raw JetStream publish + fetch + reply + ack, side by side.

Both run in one process against one embedded nats-server, with the same payloads, the same
number of requests and the same producer concurrency; the raw side is the least a JetStream
request/reply needs (no scheduling, no handler thread, no batching window). Run:

    python -m bench.overhead.in_process [--requests 3000] [--concurrency 64] [--payload 256] [--rounds 3] [--classifier] [--compare-durable]
                             [--raw-stored] [--raw-twin] [--raw-relayed] [--raw-relayed-twin]
                             [--uvloop] [--profile out.pstats [--profile-only raw|jetbatch|classified]]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
from collections.abc import Awaitable
from typing import Any, TypeVar

from jetbatch import sdk
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.percentiles import percentile

from bench import harness
from bench.harness.raw import raw_lone_round_trip_ms, raw_round

T = TypeVar("T")
POLICY = "cost-aware"
POLL_MS = 250.0  # the default
PROFILER: Any = None
PROFILE_ONLY: str | None = None


async def profiled(kind: str, coro: Awaitable[T]) -> T:
    """Await ``coro`` with the profiler on when ``--profile-only`` names its kind of round."""
    on = PROFILER is not None and PROFILE_ONLY == kind
    if on:
        PROFILER.enable()
    try:
        return await coro
    finally:
        if on:
            PROFILER.disable()


def pct(values: list[float], q: float) -> float:
    return percentile(values, q / 100)


def _config(tag: str, max_batch: int, max_delay_ms: float = 2.0, **sections: Any) -> Config:
    return harness.config(
        {
            "worker": {"poll_interval_ms": POLL_MS, "policy": POLICY},
            "models": {"ident": {"handler": "identity", "max_batch_size": max_batch, "max_delay_ms": max_delay_ms}},
            **sections,
        },
        tag=tag,
    )


async def jetbatch_round(
    url: str, n: int, concurrency: int, payload: bytes, max_batch: int, *, durable: bool = True
) -> tuple[float, list[float], float]:
    cfg = _config("jb", max_batch, replies={"durable": durable})
    async with harness.in_process(cfg, url), sdk.Client.connect(url, prefix=cfg.nats.prefix) as client:
        await client.infer(payload, model="ident", timeout=30)  # load before timing
        run = await harness.gather(lambda: client.infer_result(payload, model="ident", timeout=30), n, concurrency)
    return run.rate, [r.latency_s for r in run.results], statistics.mean(r.batch.batch_size for r in run.results)


async def classified_round(url: str, n: int, concurrency: int, payload: bytes, max_batch: int) -> tuple[float, list[float]]:
    """SDK → classifier (rules router) → worker → reply: requests without a model."""
    cfg = _config("jc", max_batch, classifier={"router": "rules", "default_model": "ident", "max_batch_size": max_batch, "max_delay_ms": 2})
    async with harness.in_process(cfg, url, classifier=True), sdk.Client.connect(url, prefix=cfg.nats.prefix) as client:
        await client.infer(payload, timeout=30)
        run = await harness.gather(lambda: client.infer_result(payload, timeout=30), n, concurrency)
    return run.rate, [r.latency_s for r in run.results]


async def lone_request_overhead(url: str, max_delay_ms: float, rounds: int = 20) -> float:
    """Median latency of a lone request minus its batching window (ms)."""
    cfg = _config("jl", 16, max_delay_ms)
    async with harness.in_process(cfg, url), sdk.Client.connect(url, prefix=cfg.nats.prefix) as client:
        await client.infer(b"x", model="ident", timeout=30)
        run = await harness.gather(lambda: client.infer_result(b"x", model="ident", timeout=30), rounds, 1)
    return statistics.median(r.latency_s for r in run.results) * 1000 - max_delay_ms


async def main(args: argparse.Namespace) -> dict[str, object]:
    # What a sidecar process does once ready (sidecar/runtime.py): everything the imports made is
    # frozen out of the cyclic collector, whose full collections otherwise stop this one loop,
    # raw side and jetbatch side alike, for 65-75 ms (the p99 of a round).
    gc.freeze()
    payload = bytes(range(256)) * (args.payload // 256) + bytes(args.payload % 256)
    results: dict[str, list[float]] = {
        "raw_rps": [], "jb_rps": [], "ratio": [], "classified_rps": [], "classified_ratio": [], "volatile_rps": [], "durable_ratio": [],
        "stored_rps": [], "stored_ratio": [], "jb_over_stored": [], "relayed_ratio": [], "classified_over_relayed": [],
        "twin_ratio": [], "jb_over_twin": [], "relayed_twin_ratio": [], "classified_over_relayed_twin": [],
    }  # fmt: skip
    cls_lat: list[float] = []
    raw_lat: list[float] = []
    jb_lat: list[float] = []
    batch_means: list[float] = []
    with harness.server() as server:
        for _ in range(args.rounds):
            # Alternate the order so neither side always runs on a warmer machine.
            raw_rps, rl = await profiled("raw", raw_round(server.url, args.requests, args.concurrency, payload))
            jb_rps, jl, mean_batch = await profiled("jetbatch", jetbatch_round(server.url, args.requests, args.concurrency, payload, args.max_batch))
            results["raw_rps"].append(raw_rps)
            results["jb_rps"].append(jb_rps)
            results["ratio"].append(jb_rps / raw_rps)
            if args.raw_stored:
                s_rps, _ = await raw_round(server.url, args.requests, args.concurrency, payload, stored=True)
                results["stored_rps"].append(s_rps)
                results["stored_ratio"].append(s_rps / raw_rps)
                results["jb_over_stored"].append(jb_rps / s_rps)
            if args.raw_twin:
                t_rps, _ = await raw_round(server.url, args.requests, args.concurrency, payload, twin=True)
                results["twin_ratio"].append(t_rps / raw_rps)
                results["jb_over_twin"].append(jb_rps / t_rps)
            if args.compare_durable:
                v_rps, _, _ = await jetbatch_round(server.url, args.requests, args.concurrency, payload, args.max_batch, durable=False)
                results["volatile_rps"].append(v_rps)
                results["durable_ratio"].append(jb_rps / v_rps)
            if args.classifier:
                c_rps, cl = await profiled("classified", classified_round(server.url, args.requests, args.concurrency, payload, args.max_batch))
                results["classified_rps"].append(c_rps)
                results["classified_ratio"].append(c_rps / raw_rps)
                cls_lat += cl
                if args.raw_relayed:
                    r_rps, _ = await raw_round(server.url, args.requests, args.concurrency, payload, relayed=True)
                    results["relayed_ratio"].append(r_rps / raw_rps)
                    results["classified_over_relayed"].append(c_rps / r_rps)
                if args.raw_relayed_twin:
                    rt_rps, _ = await raw_round(server.url, args.requests, args.concurrency, payload, relayed=True, twin=True)
                    results["relayed_twin_ratio"].append(rt_rps / raw_rps)
                    results["classified_over_relayed_twin"].append(c_rps / rt_rps)
            raw_lat += rl
            jb_lat += jl
            batch_means.append(mean_batch)
        lone = await lone_request_overhead(server.url, max_delay_ms=5.0)
        raw_lone_ms = await raw_lone_round_trip_ms(server.url)
    summary = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "payload_bytes": args.payload,
        "raw_rps_median": statistics.median(results["raw_rps"]),
        "jetbatch_rps_median": statistics.median(results["jb_rps"]),
        "throughput_ratio_median": statistics.median(results["ratio"]),
        "ratios": [round(r, 3) for r in results["ratio"]],
        "raw_p50_ms": pct(raw_lat, 50) * 1000,
        "raw_p99_ms": pct(raw_lat, 99) * 1000,
        "jetbatch_p50_ms": pct(jb_lat, 50) * 1000,
        "jetbatch_p99_ms": pct(jb_lat, 99) * 1000,
        "jetbatch_mean_batch": statistics.mean(batch_means),
        "lone_request_overhead_ms_beyond_max_delay": lone,
        # The stored raw loop's lone round trip, in the same process: what the overhead above
        # cannot go under (the publish, the store, the fetch, the stored answer's delivery).
        "raw_stored_lone_p50_ms": raw_lone_ms,
    }
    if args.raw_stored:
        summary.update({
            "raw_stored_rps_median": statistics.median(results["stored_rps"]),
            "raw_stored_over_raw": [round(r, 3) for r in results["stored_ratio"]],
            "jetbatch_over_raw_stored": [round(r, 3) for r in results["jb_over_stored"]],
        })  # fmt: skip
    if args.raw_twin:
        summary.update({
            "raw_twin_over_raw": [round(r, 3) for r in results["twin_ratio"]],
            "jetbatch_over_raw_twin": [round(r, 3) for r in results["jb_over_twin"]],
        })  # fmt: skip
    if args.compare_durable:
        summary.update({
            "results_store_off_rps_median": statistics.median(results["volatile_rps"]),
            "results_store_on_vs_off_median": statistics.median(results["durable_ratio"]),
            "results_store_on_vs_off": [round(r, 3) for r in results["durable_ratio"]],
        })  # fmt: skip
    if args.classifier:
        summary.update({
            "classified_rps_median": statistics.median(results["classified_rps"]),
            "classified_ratio_median": statistics.median(results["classified_ratio"]),
            "classified_ratios": [round(r, 3) for r in results["classified_ratio"]],
            "classified_p50_ms": pct(cls_lat, 50) * 1000,
            "classified_p99_ms": pct(cls_lat, 99) * 1000,
        })  # fmt: skip
    if args.classifier and args.raw_relayed:
        summary.update({
            "raw_relayed_over_raw": [round(r, 3) for r in results["relayed_ratio"]],
            "classified_over_raw_relayed": [round(r, 3) for r in results["classified_over_relayed"]],
        })  # fmt: skip
    if args.classifier and args.raw_relayed_twin:
        summary.update({
            "raw_relayed_twin_over_raw": [round(r, 3) for r in results["relayed_twin_ratio"]],
            "classified_over_raw_relayed_twin": [round(r, 3) for r in results["classified_over_relayed_twin"]],
        })  # fmt: skip
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--payload", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policy", default="cost-aware")
    parser.add_argument("--classifier", action="store_true", help="also SDK → classifier → worker (requests without a model)")
    parser.add_argument("--raw-stored", action="store_true", help="also the raw loop with its replies stored (PubAck before the ack)")
    parser.add_argument("--raw-relayed", action="store_true",
                        help="with --classifier, also the raw twin of the classifier path: a raw relay in front of the stored raw loop")
    parser.add_argument("--raw-twin", action="store_true",
                        help="also the raw twin: the stored raw loop asking nats-server for the work jetbatch's protocol asks (bench.overhead.deployed's --raw-twin)")
    parser.add_argument("--raw-relayed-twin", action="store_true",
                        help="with --classifier, also the raw relayed loop with what --raw-twin adds: the twin of the classifier path")
    parser.add_argument("--compare-durable", action="store_true", help="also run with the results store off (replies.durable = false)")
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument("--uvloop", action="store_true", help="run everything on uvloop's event loop (jetbatch[fast])")
    parser.add_argument("--profile", default=None, metavar="FILE", help="cProfile the run into FILE (pstats)")
    parser.add_argument("--profile-only", choices=["raw", "jetbatch", "classified"], default=None,
                        help="profile only those rounds (default: the whole run)")
    ns = parser.parse_args()
    POLICY = ns.policy
    if ns.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if ns.profile:
        import cProfile

        PROFILER = cProfile.Profile()
        PROFILE_ONLY = ns.profile_only
        if PROFILE_ONLY is None:
            PROFILER.enable()
    out = asyncio.run(main(ns))
    if PROFILER is not None:
        PROFILER.disable()
        PROFILER.dump_stats(ns.profile)
    harness.emit(out, ns.json)
