"""The raw JetStream loop every overhead benchmark measures jetbatch against: the least a
JetStream request/reply needs (publish, fetch, reply, ack), no scheduling, no handler thread, no
batch window; with its variants (replies stored, a relay in front as the classifier's hop,
fast-ingest batches, jetbatch's headers and random ids: the "raw twin").

In this process (:func:`raw_round`, :func:`raw_lone_round_trip_ms`) or with its consumer and relay
each in a process of its own (:func:`raw_processes`, which runs this module:
``python -m bench.harness.raw consumer URL PREFIX [--stored] [--protocol-headers]`` or
``... relay URL PREFIX [--fast]``, each printing ``ready`` and serving until killed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
from jetbatch.sdk.protocol import (
    ContentType,
    Headers,
    Status,
    batch_header,
    deadline_header,
)

__all__ = [
    "add_raw_streams", "raw_consumer", "raw_lone_round_trip_ms", "raw_processes", "raw_relay", "raw_relay_fast",
    "raw_replies", "raw_requests", "raw_round", "relay",
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]


async def _batches(psub: Any, stop: asyncio.Event | None) -> AsyncIterator[list[Any]]:
    """Each batch of up to 64 a raw loop fetches (nats-py's fetch, 0.2 s at most), until ``stop``
    is set (or forever)."""
    while stop is None or not stop.is_set():
        try:
            yield await psub.fetch(64, timeout=0.2)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either
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
    ``bench.overhead.deployed --raw-twin`` does across processes: random request ids, the SDK's request
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


async def raw_consumer(url: str, prefix: str, stored: bool, protocol_headers: bool = False) -> None:
    """The raw consumer in a process of its own, until killed."""
    nc = await nats.connect(url, name="raw-consumer")
    psub = await nc.jetstream().pull_subscribe(f"{prefix}.q", durable="c", stream=prefix.upper())
    print("ready", flush=True)
    await raw_replies(nc, psub, stored=stored, protocol_headers=protocol_headers, prefix=prefix)


async def relay(url: str, prefix: str, fast: bool = False) -> None:
    """The raw relay (the classifier's hop) in a process of its own, until killed;
    ``fast``: its republishes as fast-ingest batches."""
    nc = await nats.connect(url, name="raw-relay")
    psub = await nc.jetstream().pull_subscribe(f"{prefix}.in", durable="relay", stream=f"{prefix.upper()}_IN")
    print("ready", flush=True)
    await (raw_relay_fast if fast else raw_relay)(nc, psub, prefix)


@contextlib.contextmanager
def raw_processes(
    url: str, prefix: str, *, stored: bool = False, protocol_headers: bool = False, relayed: bool = False, fast_ingest: bool = False
) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The raw consumer (and with ``relayed`` the raw relay, ``fast_ingest``: its fast-ingest
    variant) each in a process of its own on the streams of ``prefix`` (:func:`add_raw_streams`
    made them), ready on entry, killed on exit; yields them by name (``raw_consumer``,
    ``raw_relay``)."""
    commands = {"raw_consumer": ["consumer", url, prefix, *(["--stored"] if stored else []), *(["--protocol-headers"] if protocol_headers else [])]}
    if relayed:
        commands["raw_relay"] = ["relay", url, prefix, *(["--fast"] if fast_ingest else [])]
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, args in commands.items():
            procs[name] = subprocess.Popen([sys.executable, "-m", "bench.harness.raw", *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for name, proc in procs.items():
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {name} process exited before it was ready (exit code {proc.wait()})")
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the raw consumer or relay in a process of its own, until killed")
    parser.add_argument("role", choices=("consumer", "relay"))
    parser.add_argument("url")
    parser.add_argument("prefix")
    parser.add_argument("--stored", action="store_true", help="the consumer's replies stored in the results stream")
    parser.add_argument("--protocol-headers", action="store_true", help="the consumer answers under jetbatch's headers")
    parser.add_argument("--fast", action="store_true", help="the relay's republishes as fast-ingest batches")
    args = parser.parse_args(argv)
    if args.role == "consumer":
        asyncio.run(raw_consumer(args.url, args.prefix, stored=args.stored, protocol_headers=args.protocol_headers))
    else:
        asyncio.run(relay(args.url, args.prefix, fast=args.fast))
    return 0


if __name__ == "__main__":
    sys.exit(main())
