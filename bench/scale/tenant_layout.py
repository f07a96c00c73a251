"""Which JetStream layout gives tenants fair turns within one model: what each option costs the
server and a batch's fill, for one model M and ``--tenants`` T tenants (docs/scaleout.md, "Tenants").

- **per-tenant** (a): subjects ``<p>.model.M.t.<tenant>``, one durable pull consumer per tenant
  (made lazily, as a worker would on a tenant's first request). Measures the time to create T of
  them 16 at a time (as ``consumers = "eager"`` does) and the server's resident memory they add;
  then a fair fill of one batch of ``--batch`` requests spread over the T tenants: one count of
  the tenants with work (``STREAM.INFO`` with a subjects filter), then a fetch from each consumer
  it takes from, round-robin from a cursor that moves on each batch. Timed with the fetches
  sequential and concurrent; the round trips a batch are counted.
- **multi-filter** (b): one consumer whose ``filter_subjects`` lists the T tenant subjects
  (nats-server 2.10+): its create time, and the order it delivers in: after a flood of
  ``--flood`` requests from tenant A and then one from tenant B, a fetch of a batch holds A's only.
- **two lines** (c, today): one consumer for the model's line, every tenant's requests on one
  subject (the tenant in a header). The fetch latency of a batch; and how deep a fill that
  reorders what it fetched could look: a fetch of ``--batch`` and one of ``max_ack_pending``
  (what a consumer delivers at most before acks) after the same flood, and where B's request is.

One nats-server with default settings; each option on its own work-queue stream (a work-queue
stream refuses two consumers whose filters overlap). Medians over ``--repeats`` fills.

    python -m bench.scale.tenant_layout --tenants 10 100 500
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.client import JetStreamContext

from bench import harness
from bench.harness import rss_kib

MAX_ACK_PENDING = 1024  # the sidecar's default (streams.max_ack_pending)
MAX_CONSUMERS = 100_000  # as the models stream declares: left unlimited the server takes 1 000


def _tenant(i: int) -> str:
    return f"t{i:04d}"


def _consumer(durable: str, subjects: list[str]) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=MAX_ACK_PENDING, max_waiting=512,
        filter_subject=subjects[0] if len(subjects) == 1 else None, filter_subjects=subjects if len(subjects) > 1 else None,
    )  # fmt: skip


async def _stream(js: JetStreamContext, prefix: str, subjects: list[str]) -> str:
    name = f"{prefix.upper()}_MODELS"
    await js.add_stream(StreamConfig(name=name, subjects=subjects, retention=RetentionPolicy.WORK_QUEUE, max_consumers=MAX_CONSUMERS))
    return name


async def _publish(js: JetStreamContext, items: list[tuple[str, str]]) -> None:
    """Store ``(subject, tenant)`` requests, 64 in flight at a time (within a group the order
    is the client's sending order, not promised)."""
    for start in range(0, len(items), 64):
        await asyncio.gather(*(js.publish(s, b"x" * 64, headers={"Jetbatch-Tenant": t}) for s, t in items[start : start + 64]))


async def _settle(msgs: list[Any]) -> None:
    await asyncio.gather(*(m.ack_sync() for m in msgs))


async def per_tenant(js: JetStreamContext, pid: int, tenants: int, args: argparse.Namespace) -> dict[str, Any]:
    """(a): T consumers made 16 at a time, then fair fills over the tenants with work."""
    prefix = harness.fresh_prefix("tl")
    subject = f"{prefix}.model.M.t"
    stream = await _stream(js, prefix, [f"{prefix}.model.M", f"{prefix}.model.M.batch", f"{subject}.*"])
    gate, create_s = asyncio.Semaphore(16), []

    async def make(i: int) -> None:
        async with gate:
            t0 = time.monotonic()
            await js.add_consumer(stream, _consumer(f"M-t-{_tenant(i)}", [f"{subject}.{_tenant(i)}"]))
            create_s.append(time.monotonic() - t0)

    rss_before = rss_kib(pid)
    started = time.monotonic()
    await asyncio.gather(*(make(i) for i in range(tenants)))
    created_s = time.monotonic() - started
    rss_added_kib = rss_kib(pid) - rss_before
    subs = [await js.pull_subscribe_bind(durable=f"M-t-{_tenant(i)}", stream=stream) for i in range(tenants)]
    # Enough waiting that every fill finds its tenants with work: one each round-robin.
    each = -(-args.batch * 2 * args.repeats // tenants) + 1
    await _publish(js, [(f"{subject}.{_tenant(i)}", _tenant(i)) for _ in range(each) for i in range(tenants)])

    async def fill(cursor: int, concurrent: bool) -> tuple[float, int, list[Any]]:
        t0 = time.monotonic()
        info = await js.stream_info(stream, subjects_filter=f"{subject}.*")
        waiting = {s.rsplit(".", 1)[1]: n for s, n in (info.state.subjects or {}).items()}
        take: dict[int, int] = {}
        i, wanted = cursor, min(args.batch, sum(waiting.values()))
        while sum(take.values()) < wanted:  # round-robin over the tenants with work, from the cursor
            t = i % tenants
            if take.get(t, 0) < waiting.get(_tenant(t), 0):
                take[t] = take.get(t, 0) + 1
            i += 1
        if concurrent:
            got = await asyncio.gather(*(subs[t].fetch(n, timeout=5) for t, n in take.items()))
        else:
            got = [await subs[t].fetch(n, timeout=5) for t, n in take.items()]
        msgs = [m for batch in got for m in batch]
        return time.monotonic() - t0, 1 + len(take), msgs

    out: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    trips: list[int] = []
    for r in range(args.repeats):
        for mode in ("sequential", "concurrent"):
            took, n_trips, msgs = await fill(len(trips) * args.batch, mode == "concurrent")
            assert len(msgs) == args.batch, (len(msgs), args.batch)
            out[mode].append(took)
            trips.append(n_trips)
            await _settle(msgs)
    await js.delete_stream(stream)
    return {
        "create_all_s": created_s, "create_one_p50_ms": 1e3 * statistics.median(create_s),
        "rss_added_mib": rss_added_kib / 1024, "rss_per_consumer_kib": rss_added_kib / tenants,
        "fill_sequential_p50_ms": 1e3 * statistics.median(out["sequential"]),
        "fill_concurrent_p50_ms": 1e3 * statistics.median(out["concurrent"]),
        "round_trips_per_batch": statistics.median(trips),
    }  # fmt: skip


async def _flood(js: JetStreamContext, subject_of: Any, flood: int) -> None:
    """``flood`` requests of tenant A, then (once they are stored) one of tenant B."""
    a, b = _tenant(0), _tenant(1)
    await _publish(js, [(subject_of(a), a)] * flood)
    await _publish(js, [(subject_of(b), b)])


def _position_of_b(msgs: list[Any]) -> int | None:
    """Where B's request is in what a fetch returned (1-based), None when it is not there."""
    tenants = [m.headers.get("Jetbatch-Tenant") for m in msgs]
    return tenants.index(_tenant(1)) + 1 if _tenant(1) in tenants else None


async def multi_filter(js: JetStreamContext, pid: int, tenants: int, args: argparse.Namespace) -> dict[str, Any]:
    """(b): one consumer filtering on the T tenant subjects; its create time, and its order."""
    prefix = harness.fresh_prefix("tl")
    subject = f"{prefix}.model.M.t"
    stream = await _stream(js, prefix, [f"{subject}.*"])
    filters = [f"{subject}.{_tenant(i)}" for i in range(tenants)]
    create_s = []
    for r in range(args.repeats):
        t0 = time.monotonic()
        await js.add_consumer(stream, _consumer("M-all", filters))
        create_s.append(time.monotonic() - t0)
        if r < args.repeats - 1:
            await js.delete_consumer(stream, "M-all")
    sub = await js.pull_subscribe_bind(durable="M-all", stream=stream)
    await _flood(js, lambda t: f"{subject}.{t}", args.flood)
    t0 = time.monotonic()
    msgs = await sub.fetch(args.batch, timeout=5)
    fetch_s = time.monotonic() - t0
    from_a = sum(m.headers.get("Jetbatch-Tenant") == _tenant(0) for m in msgs)
    await js.delete_stream(stream)
    return {
        "create_p50_ms": 1e3 * statistics.median(create_s), "fetch_ms": 1e3 * fetch_s,
        "flood_first_fetch_from_a": from_a, "b_in_first_fetch": _position_of_b(msgs) is not None,
    }  # fmt: skip


async def two_lines(js: JetStreamContext, pid: int, tenants: int, args: argparse.Namespace) -> dict[str, Any]:
    """(c): today's layout, one consumer a line; a batch's fetch, and how far back B can sit."""
    prefix = harness.fresh_prefix("tl")
    line = f"{prefix}.model.M"
    stream = await _stream(js, prefix, [line, f"{line}.batch"])
    await js.add_consumer(stream, _consumer("model-M", [line]))
    sub = await js.pull_subscribe_bind(durable="model-M", stream=stream)
    await _publish(js, [(line, _tenant(i % tenants)) for i in range(args.batch * args.repeats)])
    took = []
    for _ in range(args.repeats):
        t0 = time.monotonic()
        msgs = await sub.fetch(args.batch, timeout=5)
        took.append(time.monotonic() - t0)
        await _settle(msgs)
    await _flood(js, lambda t: line, args.flood)
    first = await sub.fetch(args.batch, timeout=5)
    # All max_ack_pending lets it hold besides the first (the fetch then waits out its timeout:
    # the consumer delivers nothing more until acks, so its time says nothing).
    deep = await sub.fetch(MAX_ACK_PENDING, timeout=1)
    reach = len(first) + len(deep)
    await js.delete_stream(stream)
    return {
        "fetch_p50_ms": 1e3 * statistics.median(took), "b_behind": args.flood,
        "b_in_first_fetch": _position_of_b(first) is not None, "b_within_max_ack_pending": _position_of_b(first + deep) is not None,
        "deepest_reach": reach,
    }  # fmt: skip


async def measure(url: str, pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    nc = await nats.connect(url)
    records = []
    try:
        js = nc.jetstream(timeout=30)
        for tenants in args.tenants:
            record: dict[str, Any] = {"bench": "tenant_layout", "tenants": tenants, "batch": args.batch, "repeats": args.repeats, "flood": args.flood}
            for name, option in (("per_tenant", per_tenant), ("multi_filter", multi_filter), ("two_lines", two_lines)):
                record[name] = await option(js, pid, tenants, args)
            records.append(record)
    finally:
        await nc.close()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--batch", type=int, default=16, help="a batch's size (max_batch_size)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--flood", type=int, default=2000, help="tenant A's requests waiting ahead of B's one")
    parser.add_argument("--json", default=None, help="append each T's record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, harness.server(store_dir=Path(tmp) / "store") as server:
        assert server.pid is not None
        records = asyncio.run(measure(server.url, server.pid, args))
    for record in records:
        harness.emit(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
