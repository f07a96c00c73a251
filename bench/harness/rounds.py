"""Rounds as deployed: producer, sidecars and nats-server each in its own process, each
process's CPU a request read from ``/proc`` and the consumer side's messages from nats-server's
``/connz``. :func:`raw_round` runs the raw loop (:mod:`bench.harness.raw`) so, :func:`jetbatch_round`
jetbatch (SDK -> worker, or through the classifier); ``bench.overhead.deployed`` and
``bench.overhead.server_profile`` compare them."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
from jetbatch import sdk

from .configs import fresh_prefix, write_config
from .load import gather
from .measure import cpu_s, worker_stats
from .raw import add_raw_streams, raw_processes, raw_requests
from .sidecars import processes

__all__ = ["CLASSIFIER_MAX_DELAY_S", "MAX_DELAY_S", "consumer_msgs", "free_port", "ident_config", "jetbatch_round", "msgs_per_request", "raw_round"]

MAX_DELAY_S = 0.002  # the worker's batch window unless --max-delay-s says otherwise
CLASSIFIER_MAX_DELAY_S = 0.002  # the classifier's


# --- the consumer side's messages ----------------------------------------------------------------

# Connections of the consumer side: the raw consumer's, and the sidecars' (``sidecar/cli``).
CONSUMER_NAMES = ("raw-consumer", "raw-relay", "jetbatch-worker", "jetbatch-worker-replies", "jetbatch-classifier", "jetbatch-classifier-replies")


def consumer_msgs(monitor_port: int | None) -> dict[int, tuple[str, int, int]]:
    """Messages each consumer-side connection published and was sent so far, with its name, by
    connection id, from the ``/connz`` of nats-server's monitoring port (none without one)."""
    if monitor_port is None:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?limit=4096", timeout=10) as r:
        conns = json.load(r).get("connections") or []
    return {c["cid"]: (c["name"], int(c["in_msgs"]), int(c["out_msgs"])) for c in conns if c.get("name") in CONSUMER_NAMES}


def msgs_per_request(before: dict[int, tuple[str, int, int]], after: dict[int, tuple[str, int, int]], n: int) -> dict[str, Any]:
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


# --- the rounds ------------------------------------------------------------------------------------


async def _raw_producer(
    url: str, prefix: str, n: int, concurrency: int, payload: bytes, stored: bool, lone: int = 0, lone_gap_s: float = 0.0,
    relayed: bool = False, random_ids: bool = False, protocol_headers: bool = False,
) -> tuple[float, list[float]]:
    """``bench.overhead.in_process``'s raw producer, one warm-up request before the timed ones; then
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
    protocol_headers: bool = False, on_timed: Callable[[], None] | None = None, monitor_port: int | None = None,
) -> dict[str, Any]:
    """A raw round (``monitor_port``: nats-server's, to count the consumer side's messages); ``relayed``: the producer publishes to an ingress stream, a raw relay process
    republishes each request to the consumer's stream (the classifier's hop), and the consumer
    stores its replies (as the worker does): the raw twin of SDK → classifier → worker.
    ``fast_ingest``: the relay republishes each batch as a fast-ingest batch; ``republish``: the
    request stream republishes each request's headers, as jetbatch's models stream does;
    ``random_ids``: request ids as the SDK makes them (``raw_requests``); ``protocol_headers``
    (with ``stored``, ``republish`` and ``random_ids``: the raw twin): requests and replies with
    jetbatch's headers, each reply under the request's key (``raw_requests``, ``raw_replies``);
    ``on_timed``: called just before the timed requests start (``bench.overhead.server_profile`` starts its
    profile then)."""
    prefix = fresh_prefix("raw")
    stored = stored or relayed or protocol_headers

    async def setup() -> None:
        nc = await nats.connect(url)
        await add_raw_streams(nc.jetstream(), prefix, stored=stored, relayed=relayed, fast_ingest=fast_ingest, republish=republish)
        await nc.close()

    asyncio.run(setup())
    with raw_processes(url, prefix, stored=stored, protocol_headers=protocol_headers, relayed=relayed, fast_ingest=fast_ingest) as by_name:
        procs = list(by_name.values())
        msgs = consumer_msgs(monitor_port)
        before = (cpu_s(os.getpid()), sum(cpu_s(p.pid) for p in procs), cpu_s(server_pid))
        if on_timed is not None:
            on_timed()
        elapsed, alone = asyncio.run(
            _raw_producer(url, prefix, n, concurrency, payload, stored, lone, lone_gap_s, relayed, random_ids, protocol_headers)
        )
        after = (cpu_s(os.getpid()), sum(cpu_s(p.pid) for p in procs), cpu_s(server_pid))
        msgs_after = consumer_msgs(monitor_port)
    kind = "raw_relayed_fast" if fast_ingest else "raw_relayed" if relayed else "raw_republished" if republish else "raw_stored" if stored else "raw"
    if protocol_headers and republish and random_ids:
        kind = "raw_relayed_twin" if relayed else "raw_twin"
    elif random_ids:
        kind += "_random_ids"
    record = {**_record(kind, n, elapsed, before, after), **msgs_per_request(msgs, msgs_after, n)}
    if alone:
        # The same path with no batch window: what a lone request's round trip costs the raw loop,
        # the floor under jetbatch's lone_p50_over_max_delay_ms.
        record["lone_p50_ms"] = statistics.median(alone) * 1000
    return record


def ident_config(directory: Path, prefix: str, classifier: bool, max_delay_s: float = MAX_DELAY_S) -> Path:
    """The config of the rounds as deployed: the identity model (batches of 64 in a ``max_delay_s``
    window) and, with ``classifier``, a rules classifier in front of it; written to ``directory``."""
    sections: dict[str, Any] = {
        "nats": {"prefix": prefix}, "worker": {"poll_interval_ms": 250},
        "models": {"ident": {"handler": "identity", "max_batch_size": 64, "max_delay_s": max_delay_s}},
    }  # fmt: skip
    if classifier:
        sections["classifier"] = {"router": "rules", "default_model": "ident", "max_batch_size": 64, "max_delay_s": CLASSIFIER_MAX_DELAY_S}
    return write_config(sections, directory, prefix)


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
        before = await worker_stats(client.nats, prefix, wait_s=0.3)
        if batch_sizes is None:
            elapsed = (await gather(lambda: client.infer(payload, model=model, timeout=60), n, concurrency)).elapsed_s
        else:
            run = await gather(lambda: client.infer_result(payload, model=model, timeout=60), n, concurrency)
            batch_sizes.extend(r.batch.batch_size for r in run.results)
            elapsed = run.elapsed_s
        if stats is not None:
            after = await worker_stats(client.nats, prefix, wait_s=0.3)
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
    batch_sizes: bool = False, lone_gap_s: float = 0.0, on_timed: Callable[[], None] | None = None, monitor_port: int | None = None,
) -> dict[str, Any]:
    """A jetbatch round (SDK -> worker, or through the classifier); ``on_timed`` as for :func:`raw_round`
    (called once the sidecars are ready, before the producer's warm-up request)."""
    prefix = fresh_prefix("dep")
    with tempfile.TemporaryDirectory() as tmp:
        config = ident_config(Path(tmp), prefix, classifier, max_delay_s)
        with processes(config, url, classifier=classifier, store_dir=Path(tmp) / "store", http_port=-1) as dep:
            sidecars = [p.pid for name, p in sorted(dep.procs.items())]
            msgs = consumer_msgs(monitor_port)
            before = (cpu_s(os.getpid()), sum(cpu_s(p) for p in sidecars), cpu_s(server_pid))
            model = None if classifier else "ident"
            sizes: list[int] | None = [] if batch_sizes else None
            stats: dict[str, int] = {}
            if on_timed is not None:
                on_timed()
            elapsed = asyncio.run(_sdk_producer(url, prefix, n, concurrency, payload, model, sizes, stats))
            after = (cpu_s(os.getpid()), sum(cpu_s(p) for p in sidecars), cpu_s(server_pid))
            msgs_after = consumer_msgs(monitor_port)
            alone = asyncio.run(_lone_requests(url, prefix, lone, payload, model, lone_gap_s)) if lone else []
    record = {**_record("classified" if classifier else "jetbatch", n, elapsed, before, after), **msgs_per_request(msgs, msgs_after, n)}
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


