"""The hot path as deployed: producer, sidecars and nats-server each in its own process.

``bench.overhead`` runs producer, worker and server on one event loop. Here each is a process, as
in ``compose.yaml``: nats-server, a ``jetbatch worker`` (and a ``jetbatch classifier``), and the
producer (this process, the SDK). The raw baseline is laid out the same way: a consumer process
doing the least a JetStream request/reply needs (fetch up to 64, publish each reply, ack each;
``--raw-consumer``) and this process publishing with JetStream and awaiting replies on one
inbox. Same payloads, requests and concurrency; rounds alternate raw / jetbatch / classified. With
``--raw-stored``, each round also runs the raw loop storing its replies (a JetStream publish into
a results stream, the requests acked once the PubAcks came; the producer listens on the results
subjects), the least a loop does that acks a request only once its answer is safe. With
``--raw-relayed``, the raw twin of the classifier path: the producer publishes to an ingress
stream, a raw relay process (fetch up to 64, republish each with its headers as a JetStream
publish, ack each once the batch's PubAcks came) feeds the stored raw loop's consumer; it is what
SDK → classifier → worker is compared with beyond the one-hop raw loop; ``--relay-fast-ingest``
also runs it with the relay publishing each batch as a JetStream fast-ingest batch (ADR-50,
nats-server 2.14+: one flow ack every few messages instead of a PubAck each). With
``--raw-republished``, the stored raw loop once more with its request stream republishing each
stored request's headers, as jetbatch's models stream does for its arrival events: what that costs
nats-server (``server_us``) with nobody listening. With ``--raw-twin``, the stored raw loop asking
nats-server for the work jetbatch's protocol asks: random request ids as the SDK makes them, the
SDK's request headers (no ``Reply``: the consumer answers under the request's key, at the subject
a worker builds) and a jetbatch answer's five headers, its request stream republishing each
request's headers; jetbatch against it (``jetbatch_over_raw_twin``, each process's CPU) is what
jetbatch's own code costs beyond the server work and the transport; ``--raw-relayed-twin``, the
same for the raw relayed loop, against the classifier path.
After each jetbatch run, ``--lone`` requests one at a time (``--lone-gap-s`` apart): a lone
request's median latency beyond its batch windows (``lone_p50_over_max_delay_ms``; through the
classifier, both windows), and how much of that is its worker batch starting past the worker's
window (``lone_batch_start_over_max_delay_ms``, the queue wait the worker reports). The raw
rounds send as many lone requests the same way: their median round trip (``lone_p50_ms``) is the
floor under jetbatch's (the raw loop has no window to wait).

Reported per round: throughput, and each process's CPU seconds per request (from /proc): the
producer, the consumer side (raw consumer, or worker, and the classifier), nats-server; and the
messages the consumer side published and received per request (``consumer_published``,
``consumer_received``, from nats-server's ``/connz``, which counts messages, not PINGs; by
connection name in ``consumer_msgs_by_connection``: which hop pays what); for
jetbatch, how its worker formed batches (``worker_per_batch``: requests, fetches, decisions, pull
requests sent and pull requests ended by a status message a batch; ``worker_events_per_request``:
the arrival events it heard), from its status counters.

    python -m bench.deployed [--requests 5000] [--concurrency 64] [--payload 256] [--rounds 3] [--lone 20]
                             [--lone-gap-s 0] [--max-delay-s 0.002] [--raw-stored] [--raw-twin] [--raw-republished] [--raw-relayed [--relay-fast-ingest]] [--raw-relayed-twin]
                             [--batch-sizes]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
from jetbatch import sdk
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.status import collect_status

from bench import harness
from bench.overhead import (
    add_raw_streams,
    raw_relay,
    raw_relay_fast,
    raw_replies,
    raw_requests,
)
from bench.scale import cpu_s

ROOT = Path(__file__).resolve().parent.parent
MAX_DELAY_S = 0.002  # the worker's batch window unless --max-delay-s says otherwise
CLASSIFIER_MAX_DELAY_S = 0.002  # the classifier's


# --- the consumer side's messages ----------------------------------------------------------------

# Connections of the consumer side: the raw consumer's, and the sidecars' (``sidecar/cli``).
CONSUMER_NAMES = ("raw-consumer", "raw-relay", "jetbatch-worker", "jetbatch-worker-replies", "jetbatch-classifier", "jetbatch-classifier-replies")
_monitor_port: int | None = None  # nats-server's monitoring port (set by main)


def consumer_msgs() -> dict[int, tuple[str, int, int]]:
    """Messages each consumer-side connection published and was sent so far, with its name, by
    connection id."""
    if _monitor_port is None:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{_monitor_port}/connz?limit=4096", timeout=10) as r:
        conns = json.load(r).get("connections") or []
    return {c["cid"]: (c["name"], int(c["in_msgs"]), int(c["out_msgs"])) for c in conns if c.get("name") in CONSUMER_NAMES}


def _msgs_per_request(before: dict[int, tuple[str, int, int]], after: dict[int, tuple[str, int, int]], n: int) -> dict[str, Any]:
    """Messages the consumer side published and received a request, in all and by connection name
    (``consumer_msgs_by_connection``: ``[published, received]``; which hop pays what)."""
    by_name: dict[str, list[float]] = {}
    for cid, (name, published, received) in after.items():
        _, published_before, received_before = before.get(cid, (name, 0, 0))
        mine = by_name.setdefault(name, [0.0, 0.0])
        mine[0] += (published - published_before) / n
        mine[1] += (received - received_before) / n
    return {
        "consumer_published": sum(p for p, _ in by_name.values()),
        "consumer_received": sum(r for _, r in by_name.values()),
        "consumer_msgs_by_connection": {name: [round(p, 4), round(r, 4)] for name, (p, r) in sorted(by_name.items())},
    }


# --- the raw consumer (its own process) ----------------------------------------------------------


async def raw_consumer(url: str, prefix: str, stored: bool, protocol_headers: bool = False) -> None:
    """``bench.overhead``'s raw consumer in a process of its own, until killed."""
    nc = await nats.connect(url, name="raw-consumer")
    psub = await nc.jetstream().pull_subscribe(f"{prefix}.q", durable="c", stream=prefix.upper())
    print("ready", flush=True)
    await raw_replies(nc, psub, stored=stored, protocol_headers=protocol_headers, prefix=prefix)


async def relay(url: str, prefix: str, fast: bool = False) -> None:
    """``bench.overhead``'s raw relay (the classifier's hop) in a process of its own, until killed;
    ``fast``: its republishes as fast-ingest batches."""
    nc = await nats.connect(url, name="raw-relay")
    psub = await nc.jetstream().pull_subscribe(f"{prefix}.in", durable="relay", stream=f"{prefix.upper()}_IN")
    print("ready", flush=True)
    await (raw_relay_fast if fast else raw_relay)(nc, psub, prefix)


# --- the rounds ------------------------------------------------------------------------------------


async def _raw_producer(
    url: str, prefix: str, n: int, concurrency: int, payload: bytes, stored: bool, lone: int = 0, lone_gap_s: float = 0.0,
    relayed: bool = False, random_ids: bool = False, protocol_headers: bool = False,
) -> tuple[float, list[float]]:
    """``bench.overhead``'s raw producer, one warm-up request before the timed ones; then
    ``lone`` requests one at a time (as jetbatch's lone requests are sent), their latencies."""
    nc = await nats.connect(url)
    alone: list[float] = []
    how = {"stored": stored, "relayed": relayed, "random_ids": random_ids, "protocol_headers": protocol_headers}
    try:
        await raw_requests(nc, prefix, 1, 1, payload, first=n, **how)  # warm
        elapsed, _ = await raw_requests(nc, prefix, n, concurrency, payload, **how)
        for i in range(lone):
            alone.extend((await raw_requests(nc, prefix, 1, 1, payload, first=n + 1 + i, **how))[1])
            if lone_gap_s:
                await asyncio.sleep(lone_gap_s)
    finally:
        await nc.close()
    return elapsed, alone


def raw_round(
    url: str, server_pid: int, n: int, concurrency: int, payload: bytes, *, stored: bool = False, lone: int = 0, lone_gap_s: float = 0.0,
    relayed: bool = False, fast_ingest: bool = False, republish: bool = False, random_ids: bool = False,
    protocol_headers: bool = False, on_timed: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """A raw round; ``relayed``: the producer publishes to an ingress stream, a raw relay process
    republishes each request to the consumer's stream (the classifier's hop), and the consumer
    stores its replies (as the worker does): the raw twin of SDK → classifier → worker.
    ``fast_ingest``: the relay republishes each batch as a fast-ingest batch; ``republish``: the
    request stream republishes each request's headers, as jetbatch's models stream does;
    ``random_ids``: request ids as the SDK makes them (``raw_requests``); ``protocol_headers``
    (with ``stored``, ``republish`` and ``random_ids``: the raw twin): requests and replies with
    jetbatch's headers, each reply under the request's key (``raw_requests``, ``raw_replies``);
    ``on_timed``: called just before the timed requests start (``bench.server_profile`` starts its
    profile then)."""
    prefix = f"raw{uuid.uuid4().hex[:6]}"
    stored = stored or relayed or protocol_headers

    async def setup() -> None:
        nc = await nats.connect(url)
        await add_raw_streams(nc.jetstream(), prefix, stored=stored, relayed=relayed, fast_ingest=fast_ingest, republish=republish)
        await nc.close()

    asyncio.run(setup())
    commands = [["--raw-consumer", url, prefix, *(["--stored"] if stored else []), *(["--protocol-headers"] if protocol_headers else [])]]
    if relayed:
        commands.append(["--relay", url, prefix, *(["--fast"] if fast_ingest else [])])
    procs = [subprocess.Popen([sys.executable, "-m", "bench.deployed", *c], cwd=ROOT, stdout=subprocess.PIPE, text=True) for c in commands]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        msgs = consumer_msgs()
        before = (cpu_s(os.getpid()), sum(cpu_s(p.pid) for p in procs), cpu_s(server_pid))
        if on_timed is not None:
            on_timed()
        elapsed, alone = asyncio.run(
            _raw_producer(url, prefix, n, concurrency, payload, stored, lone, lone_gap_s, relayed, random_ids, protocol_headers)
        )
        after = (cpu_s(os.getpid()), sum(cpu_s(p.pid) for p in procs), cpu_s(server_pid))
        msgs_after = consumer_msgs()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    kind = "raw_relayed_fast" if fast_ingest else "raw_relayed" if relayed else "raw_republished" if republish else "raw_stored" if stored else "raw"
    if protocol_headers and republish and random_ids:
        kind = "raw_relayed_twin" if relayed else "raw_twin"
    elif random_ids:
        kind += "_random_ids"
    record = {**_record(kind, n, elapsed, before, after), **_msgs_per_request(msgs, msgs_after, n)}
    if alone:
        # The same path with no batch window: what a lone request's round trip costs the raw loop,
        # the floor under jetbatch's lone_p50_over_max_delay_ms.
        record["lone_p50_ms"] = statistics.median(alone) * 1000
    return record


def _config(directory: Path, prefix: str, classifier: bool, max_delay_s: float = MAX_DELAY_S) -> Path:
    text = (
        f'[nats]\nprefix = "{prefix}"\n[worker]\npoll_interval_ms = 250\n'
        f'[models.ident]\nhandler = "identity"\nmax_batch_size = 64\nmax_delay_s = {max_delay_s}\n'
    )
    if classifier:
        text += f'[classifier]\nrouter = "rules"\ndefault_model = "ident"\nmax_batch_size = 64\nmax_delay_s = {CLASSIFIER_MAX_DELAY_S}\n'
    path = directory / f"{prefix}.toml"
    path.write_text(text)
    return path


async def _worker_stats(nc: Any, prefix: str) -> dict[str, int]:
    """The worker's status counters (``jetbatch status``), summed over the workers under ``prefix``."""
    total: dict[str, int] = {}
    for report in await collect_status(nc, Subjects(prefix), wait_s=0.3):
        if report.role == "worker":
            for key, value in report.stats.items():
                total[key] = total.get(key, 0) + value
    return total


async def _sdk_producer(
    url: str, prefix: str, n: int, concurrency: int, payload: bytes, model: str | None, batch_sizes: list[int] | None = None,
    stats: dict[str, int] | None = None,
) -> float:
    """The timed requests; with ``batch_sizes``, each answer's batch size is appended to it (read
    from the answer's batch headers, which costs the producer a little CPU). ``stats``: filled
    with what the worker's counters moved by over the timed requests (two status requests,
    outside the timing)."""
    async with sdk.Client.connect(url, prefix=prefix) as client:
        await client.infer(payload, model=model, timeout=60)  # the model loaded before timing
        before = await _worker_stats(client.nats, prefix)
        if batch_sizes is None:
            elapsed = (await harness.gather(lambda: client.infer(payload, model=model, timeout=60), n, concurrency)).elapsed_s
        else:
            run = await harness.gather(lambda: client.infer_result(payload, model=model, timeout=60), n, concurrency)
            batch_sizes.extend(r.batch.batch_size for r in run.results)
            elapsed = run.elapsed_s
        if stats is not None:
            after = await _worker_stats(client.nats, prefix)
            stats.update({k: v - before.get(k, 0) for k, v in after.items()})
        return elapsed


async def _lone_requests(url: str, prefix: str, n: int, payload: bytes, model: str | None, gap_s: float = 0.0) -> list[tuple[float, float]]:
    """``n`` requests one at a time, each alone in its batch window (``gap_s`` apart: an idle
    host between them): each one's latency and its wait in the queue until its batch started,
    as the worker reports it (the batch window and what closing it took)."""
    out: list[tuple[float, float]] = []
    async with sdk.Client.connect(url, prefix=prefix) as client:
        for _ in range(n):
            started = time.perf_counter()
            result = await client.infer_result(payload, model=model, timeout=60)
            out.append((time.perf_counter() - started, result.batch.queue_wait_ms / 1000))
            if gap_s:
                await asyncio.sleep(gap_s)
    return out


def jetbatch_round(
    url: str, server_pid: int, n: int, concurrency: int, payload: bytes, *, classifier: bool, lone: int = 0, max_delay_s: float = MAX_DELAY_S,
    batch_sizes: bool = False, lone_gap_s: float = 0.0, on_timed: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """A jetbatch round (SDK -> worker, or through the classifier); ``on_timed`` as for :func:`raw_round`
    (called once the sidecars are ready, before the producer's warm-up request)."""
    prefix = f"dep{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp), prefix, classifier, max_delay_s)
        with harness.processes(config, url, classifier=classifier, store_dir=Path(tmp) / "store", http_port=-1) as dep:
            sidecars = [p.pid for name, p in sorted(dep.procs.items())]
            msgs = consumer_msgs()
            before = (cpu_s(os.getpid()), sum(cpu_s(p) for p in sidecars), cpu_s(server_pid))
            model = None if classifier else "ident"
            sizes: list[int] | None = [] if batch_sizes else None
            stats: dict[str, int] = {}
            if on_timed is not None:
                on_timed()
            elapsed = asyncio.run(_sdk_producer(url, prefix, n, concurrency, payload, model, sizes, stats))
            after = (cpu_s(os.getpid()), sum(cpu_s(p) for p in sidecars), cpu_s(server_pid))
            msgs_after = consumer_msgs()
            alone = asyncio.run(_lone_requests(url, prefix, lone, payload, model, lone_gap_s)) if lone else []
    record = {**_record("classified" if classifier else "jetbatch", n, elapsed, before, after), **_msgs_per_request(msgs, msgs_after, n)}
    if sizes:
        record["mean_batch"] = statistics.mean(sizes)
    batches = stats.get("batches", 0)
    if batches:
        # How the worker formed its batches: requests, fetches and decisions a batch, and the
        # arrival events it heard a request (what the events are for at this load).
        record["worker_per_batch"] = {
            "requests": stats.get("requests", 0) / batches, "fetches": stats.get("fetches", 0) / batches,
            "decisions": stats.get("decisions", 0) / batches,
            "pull_requests": stats.get("pull_requests", 0) / batches, "pull_ends": stats.get("pull_ends", 0) / batches,
        }  # fmt: skip
        record["worker_events_per_request"] = stats.get("arrival_delay_n", 0) / max(1, stats.get("requests", 0))
    if alone:
        # A lone request waits its whole batch window (max_delay); what it takes beyond is the path,
        # of which closing the window (its batch's start past max_delay) is one part.
        windows_s = max_delay_s + (CLASSIFIER_MAX_DELAY_S if classifier else 0.0)
        record["lone_p50_over_max_delay_ms"] = (statistics.median(t for t, _ in alone) - windows_s) * 1000
        record["lone_batch_start_over_max_delay_ms"] = (statistics.median(w for _, w in alone) - max_delay_s) * 1000
    return record


def _record(kind: str, n: int, elapsed: float, before: tuple[float, ...], after: tuple[float, ...]) -> dict[str, Any]:
    producer, consumer, server = (a - b for a, b in zip(after, before))
    # The producer's CPU includes its warm-up request and the set-up around the timed part: one
    # request in thousands.
    return {
        "kind": kind, "requests": n, "rate": n / elapsed,
        "producer_us": producer / n * 1e6, "consumer_us": consumer / n * 1e6, "server_us": server / n * 1e6,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--payload", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lone", type=int, default=20, help="requests sent one at a time after each jetbatch run (SDK -> worker, and through the classifier)")
    parser.add_argument("--lone-gap-s", type=float, default=0.0, help="pause between the lone requests (an idle host between them)")
    parser.add_argument("--max-delay-s", type=float, default=MAX_DELAY_S, help="the worker's batch window (max_delay_s)")
    parser.add_argument("--raw-stored", action="store_true", help="also the raw loop with its replies stored (PubAck before the ack)")
    parser.add_argument(
        "--raw-relayed", action="store_true",
        help="also the raw loop through a raw relay process (the classifier's hop), its replies stored: the raw twin of the classifier path",
    )  # fmt: skip
    parser.add_argument(
        "--relay-fast-ingest", action="store_true",
        help="also the raw relayed loop with each relayed batch published as a JetStream fast-ingest batch (nats-server 2.14+)",
    )  # fmt: skip
    parser.add_argument(
        "--raw-republished", action="store_true",
        help="also the stored raw loop with its request stream republishing each request's headers (jetbatch's arrival events; the server's part)",
    )  # fmt: skip
    parser.add_argument(
        "--raw-twin", action="store_true",
        help="also the stored raw loop doing the server work of jetbatch's protocol: random request ids, jetbatch's request and "
        "answer headers (each answer under the request's key), its request stream republishing each request's headers",
    )  # fmt: skip
    parser.add_argument(
        "--raw-relayed-twin", action="store_true",
        help="also the raw relayed loop with what --raw-twin adds (the server work of jetbatch's protocol): the twin of the classifier path",
    )  # fmt: skip
    parser.add_argument("--relay", nargs=2, metavar=("URL", "PREFIX"), help=argparse.SUPPRESS)
    parser.add_argument("--fast", action="store_true", help=argparse.SUPPRESS)  # the relay's
    parser.add_argument("--raw-consumer", nargs=2, metavar=("URL", "PREFIX"), help=argparse.SUPPRESS)
    parser.add_argument("--stored", action="store_true", help=argparse.SUPPRESS)  # the raw consumer's
    parser.add_argument("--protocol-headers", action="store_true", help=argparse.SUPPRESS)  # the raw consumer's
    parser.add_argument(
        "--batch-sizes", action="store_true", help="report each jetbatch round's mean batch size (read from every answer: a little more producer CPU)"
    )
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    if args.raw_consumer:
        asyncio.run(raw_consumer(*args.raw_consumer, stored=args.stored, protocol_headers=args.protocol_headers))
        return 0
    if args.relay:
        asyncio.run(relay(*args.relay, fast=args.fast))
        return 0
    payload = os.urandom(args.payload)
    rounds: list[dict[str, dict[str, Any]]] = []  # each round: its records by kind
    global _monitor_port
    _monitor_port = _free_port()
    with harness.server(extra_config=f"http: 127.0.0.1:{_monitor_port}") as server:
        for _ in range(args.rounds):
            lone = {"lone": args.lone, "lone_gap_s": args.lone_gap_s}
            by_kind = {"raw": raw_round(server.url, server.pid, args.requests, args.concurrency, payload, **lone)}
            if args.raw_stored:
                by_kind["raw_stored"] = raw_round(server.url, server.pid, args.requests, args.concurrency, payload, stored=True, **lone)
            if args.raw_twin:
                by_kind["raw_twin"] = raw_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, stored=True, republish=True, random_ids=True,
                    protocol_headers=True, **lone,
                )  # fmt: skip
            if args.raw_republished:
                by_kind["raw_republished"] = raw_round(server.url, server.pid, args.requests, args.concurrency, payload, stored=True, republish=True, **lone)
            if args.raw_relayed:
                by_kind["raw_relayed"] = raw_round(server.url, server.pid, args.requests, args.concurrency, payload, relayed=True, **lone)
            if args.raw_relayed_twin:
                by_kind["raw_relayed_twin"] = raw_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, relayed=True, republish=True, random_ids=True,
                    protocol_headers=True, **lone,
                )  # fmt: skip
            if args.raw_relayed and args.relay_fast_ingest:
                by_kind["raw_relayed_fast"] = raw_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, relayed=True, fast_ingest=True, **lone
                )  # fmt: skip
            for kind, classifier in (("jetbatch", False), ("classified", True)):
                by_kind[kind] = jetbatch_round(
                    server.url, server.pid, args.requests, args.concurrency, payload,
                    classifier=classifier, lone=args.lone, max_delay_s=args.max_delay_s, batch_sizes=args.batch_sizes,
                    lone_gap_s=args.lone_gap_s,
                )  # fmt: skip
            rounds.append(by_kind)

    kinds = list(rounds[0])
    summary = {
        kind: {
            key: statistics.median(r[kind][key] for r in rounds)
            for key in ("rate", "producer_us", "consumer_us", "server_us", "consumer_published", "consumer_received")
        }
        for kind in kinds
    }
    for kind in kinds:
        for key in ("lone_p50_ms", "lone_p50_over_max_delay_ms", "lone_batch_start_over_max_delay_ms"):
            lone = [r[kind][key] for r in rounds if key in r[kind]]
            if lone:
                summary[kind][key] = statistics.median(lone)
    per_round = []
    for r in rounds:
        ratios = {
            "jetbatch_over_raw": r["jetbatch"]["rate"] / r["raw"]["rate"],
            "classified_over_raw": r["classified"]["rate"] / r["raw"]["rate"],
            "worker_cpu_over_raw_consumer": r["jetbatch"]["consumer_us"] / r["raw"]["consumer_us"],
        }
        if "raw_stored" in r:
            ratios["raw_stored_over_raw"] = r["raw_stored"]["rate"] / r["raw"]["rate"]
            ratios["jetbatch_over_raw_stored"] = r["jetbatch"]["rate"] / r["raw_stored"]["rate"]
            ratios["worker_cpu_over_raw_stored_consumer"] = r["jetbatch"]["consumer_us"] / r["raw_stored"]["consumer_us"]
            if "lone_p50_ms" in r["raw_stored"] and "lone_p50_over_max_delay_ms" in r["jetbatch"]:
                # What jetbatch's lone request takes beyond its window and the raw stored round trip.
                ratios["lone_over_max_delay_and_raw_stored_ms"] = r["jetbatch"]["lone_p50_over_max_delay_ms"] - r["raw_stored"]["lone_p50_ms"]
        if "raw_twin" in r:
            # jetbatch against the least loop that asks nats-server for the same work (stored
            # answers, random ids, the protocol's headers, the arrival events' republish): what
            # is left is jetbatch's own code, the producer's and the worker's.
            ratios["raw_twin_over_raw"] = r["raw_twin"]["rate"] / r["raw"]["rate"]
            ratios["jetbatch_over_raw_twin"] = r["jetbatch"]["rate"] / r["raw_twin"]["rate"]
            ratios["worker_cpu_over_raw_twin_consumer"] = r["jetbatch"]["consumer_us"] / r["raw_twin"]["consumer_us"]
            ratios["producer_cpu_over_raw_twin_producer"] = r["jetbatch"]["producer_us"] / r["raw_twin"]["producer_us"]
            ratios["server_us_jetbatch_minus_raw_twin"] = r["jetbatch"]["server_us"] - r["raw_twin"]["server_us"]
        if "raw_republished" in r and "raw_stored" in r:
            # What the republish of each request's headers costs nats-server, a request.
            ratios["server_us_republished_minus_stored"] = r["raw_republished"]["server_us"] - r["raw_stored"]["server_us"]
        if "raw_relayed" in r:
            # The classifier path against its raw twin (two stored hops, replies stored), and the
            # twin against the one-hop raw loop: how much of the gap the raw parts already take.
            ratios["raw_relayed_over_raw"] = r["raw_relayed"]["rate"] / r["raw"]["rate"]
            ratios["classified_over_raw_relayed"] = r["classified"]["rate"] / r["raw_relayed"]["rate"]
            ratios["classified_cpu_over_raw_relayed"] = r["classified"]["consumer_us"] / r["raw_relayed"]["consumer_us"]
        if "raw_relayed_twin" in r:
            ratios["raw_relayed_twin_over_raw"] = r["raw_relayed_twin"]["rate"] / r["raw"]["rate"]
            ratios["classified_over_raw_relayed_twin"] = r["classified"]["rate"] / r["raw_relayed_twin"]["rate"]
            ratios["classified_cpu_over_raw_relayed_twin"] = r["classified"]["consumer_us"] / r["raw_relayed_twin"]["consumer_us"]
            ratios["server_us_classified_minus_raw_relayed_twin"] = r["classified"]["server_us"] - r["raw_relayed_twin"]["server_us"]
        if "raw_relayed_fast" in r:
            ratios["raw_relayed_fast_over_raw_relayed"] = r["raw_relayed_fast"]["rate"] / r["raw_relayed"]["rate"]
        per_round.append(ratios)
    harness.emit({"bench": "deployed", "requests": args.requests, "concurrency": args.concurrency, "payload": args.payload,
                  "median": summary, "ratios": per_round, "rounds": [rec for r in rounds for rec in r.values()]}, args.json)  # fmt: skip
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
