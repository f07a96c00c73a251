"""SDK → worker (identity model) against raw JetStream publish + fetch + reply + ack, side by side.

Both run in one process against one embedded nats-server, with the same payloads, the same
number of requests and the same producer concurrency; the raw side is the least a JetStream
request/reply needs (no scheduling, no handler thread, no batching window). Run:

    python -m bench.overhead [--requests 3000] [--concurrency 64] [--payload 256] [--rounds 3] [--classifier] [--compare-durable]
                             [--raw-stored] [--raw-twin] [--raw-relayed] [--raw-relayed-twin]
                             [--uvloop] [--profile out.pstats [--profile-only raw|jetbatch|classified]]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, TypeVar

import nats

from bench import harness
from jetbatch import sdk
from jetbatch.sdk.protocol import ContentType, Headers, Status, batch_header, deadline_header
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.percentiles import percentile


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


async def _batches(psub: Any, stop: asyncio.Event | None) -> AsyncIterator[list[Any]]:
    """Each batch of up to 64 a raw loop fetches (nats-py's fetch, 0.2 s at most), until ``stop``
    is set (or forever)."""
    while stop is None or not stop.is_set():
        try:
            yield await psub.fetch(64, timeout=0.2)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either
            continue


def _answer_headers(m: Any, batch: str, size: int) -> dict[str, str]:
    """A jetbatch answer's five headers (protocol 3), built as a worker builds them: what
    ``protocol_headers`` gives the raw loop's replies, so that nats-server stores and delivers as
    many header bytes for both."""
    return {
        Headers.MODEL: "ident", Headers.BATCH: batch_header(batch, size, 2.046, False, "raw-10411"), Headers.STATUS: Status.OK.value,
        Headers.REQUEST_ID: m.headers[Headers.MSG_ID], Headers.CONTENT_TYPE: ContentType.BYTES.value,
    }  # fmt: skip


async def raw_replies(
    nc: Any, psub: Any, stop: asyncio.Event | None = None, *, stored: bool = False, protocol_headers: bool = False, prefix: str = ""
) -> None:
    """The raw consumer: fetch up to 64, publish each reply (to its ``Reply`` header), ack each;
    until ``stop`` is set (or forever). ``stored``: each reply is a JetStream publish into a
    results stream, and the batch's requests are acked once every reply's PubAck came: the least
    a loop does that acks a request only when its answer is safe (as jetbatch does).
    ``protocol_headers`` (stored only): the requests carry jetbatch's request headers and no
    ``Reply``; each reply goes to ``<prefix>.r.<Jetbatch-Reply-Key>.<Nats-Msg-Id>`` (as a worker
    builds an answer's subject) with the five headers of a jetbatch answer."""
    js = nc.jetstream()
    async for msgs in _batches(psub, stop):
        if protocol_headers:
            batch = os.urandom(8).hex()
            await asyncio.gather(*[
                await js.publish_async(
                    f"{prefix}.r.{m.headers[Headers.REPLY_KEY]}.{m.headers[Headers.MSG_ID]}", m.data,
                    headers=_answer_headers(m, batch, len(msgs)),
                )
                for m in msgs
            ])  # fmt: skip
        elif stored:
            await asyncio.gather(*[await js.publish_async(m.headers["Reply"], m.data) for m in msgs])
        else:
            for m in msgs:
                await nc.publish(m.headers["Reply"], m.data)
        for m in msgs:
            await m.ack()


async def raw_relay(nc: Any, psub: Any, prefix: str, stop: asyncio.Event | None = None) -> None:
    """The raw relay, the least a classifier's hop does: fetch up to 64 from the ingress stream,
    republish each to ``<prefix>.q`` with its headers (its ``Nats-Msg-Id`` too, so a retry is
    deduplicated) as JetStream publishes, and ack each request once every PubAck of its batch
    came; until ``stop`` is set (or forever)."""
    js = nc.jetstream()
    async for msgs in _batches(psub, stop):
        await asyncio.gather(*[await js.publish_async(f"{prefix}.q", m.data, headers=m.headers) for m in msgs])
        for m in msgs:
            await m.ack()


async def raw_relay_fast(nc: Any, psub: Any, prefix: str, stop: asyncio.Event | None = None, flow: int = 64) -> None:
    """The raw relay with each batch's republishes as one JetStream fast-ingest batch (ADR-50,
    nats-server 2.14+, a stream with ``allow_batched``): started on its first message (whose flow
    ack the relay must wait for), gap mode ``fail``, committed on its last, whose PubAck confirms
    the batch; between them the server acks every few messages (``flow`` at most). The requests
    are acked once the commit's PubAck came."""
    inbox = nc.new_inbox()
    replies: asyncio.Queue[Any] = asyncio.Queue()

    async def on(msg: Any) -> None:
        replies.put_nowait(json.loads(msg.data) if msg.data else {})

    await nc.subscribe(f"{inbox}.>", cb=on)
    async for msgs in _batches(psub, stop):
        uid = uuid.uuid4().hex[:16]
        n = len(msgs)
        for i, m in enumerate(msgs):
            op = 2 if i == n - 1 else 0 if i == 0 else 1
            await nc.publish(f"{prefix}.q", m.data, reply=f"{inbox}.{uid}.{flow}.fail.{i + 1}.{op}.$FI", headers=m.headers)
            if i == 0 and n > 1:
                started = await replies.get()  # the server's first flow ack, or why not
                if started.get("type") != "ack":
                    raise RuntimeError(f"fast batch not started: {started}")
        while True:
            r = await replies.get()
            if r.get("type") == "ack":
                continue  # a flow ack: the commit's PubAck confirms the batch
            if "stream" not in r:
                raise RuntimeError(f"commit: {r}")
            break
        for m in msgs:
            await m.ack()


async def add_raw_streams(
    js: Any, prefix: str, *, stored: bool, relayed: bool = False, fast_ingest: bool = False, republish: bool = False
) -> None:
    """The raw loop's request stream, with ``stored`` its results stream (file storage, as
    jetbatch's), and with ``relayed`` an ingress stream ``<prefix>.in`` in front of it (the
    classifier's hop); ``fast_ingest``: the request stream takes fast-ingest batches;
    ``republish``: it republishes each stored request's headers to ``<prefix>.arrived``, as
    jetbatch's models stream does for its arrival events (nobody listens: the server's part)."""
    again = {"src": f"{prefix}.q", "dest": f"{prefix}.arrived", "headers_only": True} if republish else None
    await js.add_stream(name=prefix.upper(), subjects=[f"{prefix}.q"], retention="workqueue", allow_batched=fast_ingest or None, republish=again)
    if stored:
        await js.add_stream(name=f"{prefix.upper()}_R", subjects=[f"{prefix}.r.>"], max_age=60)
    if relayed:
        await js.add_stream(name=f"{prefix.upper()}_IN", subjects=[f"{prefix}.in"], retention="workqueue")


async def raw_requests(
    nc: Any, prefix: str, n: int, concurrency: int, payload: bytes, *, first: int = 0, stored: bool = False, relayed: bool = False,
    random_ids: bool = False, protocol_headers: bool = False,
) -> tuple[float, list[float]]:
    """The raw producer: ``n`` JetStream publishes to ``<prefix>.q`` (with ``relayed``: to the
    relay's ``<prefix>.in``) with a reply-to header, at most ``concurrency`` awaiting their reply
    on one inbox (with ``stored``: on subjects of the results stream, where the replies are stored
    and delivered live at once, as jetbatch's answers are). Each request's id (its dedupe id and
    the last token of its reply subject) is ``r<i>``, or with ``random_ids`` 32 random hex
    characters, as the SDK makes them: a stored reply's subject then shares no prefix with the
    one before, which costs nats-server's subject index more. ``protocol_headers`` (stored only):
    each request carries the headers the SDK sends (``Nats-Msg-Id``, ``Jetbatch-Reply-Key``,
    ``Content-Type``, ``Jetbatch-Deadline``) and no ``Reply``: the consumer answers under the key.
    Returns the seconds and latencies."""
    js = nc.jetstream()
    key = uuid.uuid4().hex
    inbox = f"{prefix}.r.{key}" if stored else nc.new_inbox()
    waiting: dict[str, asyncio.Future[None]] = {}

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        fut = waiting.get(msg.subject.rsplit(".", 1)[-1])
        if fut and not fut.done():
            fut.set_result(None)

    sub = await nc.subscribe(f"{inbox}.*", cb=on_reply)
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        rid = os.urandom(16).hex() if random_ids else f"r{i}"
        async with gate:
            fut = asyncio.get_running_loop().create_future()
            waiting[rid] = fut
            t = time.perf_counter()
            if protocol_headers:
                headers = {
                    Headers.MSG_ID: rid, Headers.REPLY_KEY: key, Headers.CONTENT_TYPE: ContentType.BYTES.value,
                    Headers.DEADLINE: deadline_header(30.0),
                }  # fmt: skip
            else:
                headers = {"Nats-Msg-Id": rid, "Reply": f"{inbox}.{rid}"}
            await js.publish(f"{prefix}.in" if relayed else f"{prefix}.q", payload, headers=headers)
            await asyncio.wait_for(fut, 30)
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(first, first + n)))
    elapsed = time.perf_counter() - started
    await sub.unsubscribe()
    return elapsed, latencies


async def raw_round(
    url: str, n: int, concurrency: int, payload: bytes, *, stored: bool = False, relayed: bool = False, twin: bool = False
) -> tuple[float, list[float]]:
    """Producer: JetStream publish with a reply-to header, await the reply on one inbox.
    Consumer: fetch up to 64, publish each reply (``stored``: into a results stream), ack each.
    ``relayed`` (stored too): the producer publishes to an ingress stream and :func:`raw_relay`
    republishes each request to the consumer's, the raw twin of the classifier's hop. ``twin``
    (stored too): the raw loop asks nats-server for the work jetbatch's protocol asks, as
    ``bench.deployed --raw-twin`` does across processes: random request ids, the SDK's request
    headers, each answer under the request's key with a jetbatch answer's headers, and the request
    stream republishing each request's headers (the arrival events)."""
    prefix = f"raw{uuid.uuid4().hex[:6]}"
    stored = stored or relayed or twin
    nc = await nats.connect(url)
    js = nc.jetstream()
    await add_raw_streams(js, prefix, stored=stored, relayed=relayed, republish=twin)
    psub = await js.pull_subscribe(f"{prefix}.q", durable="c", stream=prefix.upper())
    stop = asyncio.Event()
    tasks = [asyncio.create_task(raw_replies(nc, psub, stop, stored=stored, protocol_headers=twin, prefix=prefix))]
    if relayed:
        rsub = await js.pull_subscribe(f"{prefix}.in", durable="relay", stream=f"{prefix.upper()}_IN")
        tasks.append(asyncio.create_task(raw_relay(nc, rsub, prefix, stop)))
    elapsed, latencies = await raw_requests(
        nc, prefix, n, concurrency, payload, stored=stored, relayed=relayed, random_ids=twin, protocol_headers=twin
    )
    stop.set()
    await asyncio.gather(*tasks)
    for name in (prefix.upper(), *((f"{prefix.upper()}_R",) if stored else ()), *((f"{prefix.upper()}_IN",) if relayed else ())):
        await js.delete_stream(name)
    await nc.close()
    return n / elapsed, latencies


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


async def raw_lone_round_trip_ms(url: str, rounds: int = 20) -> float:
    """Median round trip of the stored raw loop's requests sent one at a time (ms): the same path
    as a lone jetbatch request's, without a batch window (the floor under its overhead)."""
    prefix = f"rawl{uuid.uuid4().hex[:6]}"
    nc = await nats.connect(url)
    js = nc.jetstream()
    await add_raw_streams(js, prefix, stored=True)
    psub = await js.pull_subscribe(f"{prefix}.q", durable="c", stream=prefix.upper())
    stop = asyncio.Event()
    task = asyncio.create_task(raw_replies(nc, psub, stop, stored=True))
    latencies: list[float] = []
    for i in range(rounds + 1):  # the first one warms the path up
        latencies += (await raw_requests(nc, prefix, 1, 1, b"x", first=i, stored=True))[1][i == 0 :]
    stop.set()
    await task
    for name in (prefix.upper(), f"{prefix.upper()}_R"):
        await js.delete_stream(name)
    await nc.close()
    return statistics.median(latencies) * 1000


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
                        help="also the raw twin: the stored raw loop asking nats-server for the work jetbatch's protocol asks (bench.deployed's --raw-twin)")
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
