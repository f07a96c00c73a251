"""Health and readiness: every sidecar answers on ``<prefix>.status``; ``jetbatch status`` asks.

A request to ``<prefix>.status`` (any body) is answered by every running sidecar with one JSON
:class:`StatusReport`, so one scatter-gather request lists the whole bus. This is the documented
equivalent of the NATS micro-services ``$SRV.PING``/``INFO``/``STATS`` endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from sdk.protocol import DEFAULT_PREFIX, Subjects

__all__ = ["StatusReport", "add_arguments", "cluster_view", "collect_status", "run", "serve_status"]

VERSION = "0.1.0"


class StatusReport(msgspec.Struct, frozen=True, kw_only=True):
    role: str  # "worker" or "classifier"
    id: str
    version: str = VERSION
    models: list[str] = []
    resident: list[str] = []
    warm: list[str] = []  # evicted but kept in host memory: a cheap reload
    loading: str | None = None
    broken: dict[str, str] = {}  # models that cannot load, and why (a missing file)
    backlog: dict[str, int] = {}
    memory_bytes: int = 0
    memory_budget_bytes: int | None = None
    host_memory_bytes: int = 0
    host_memory_budget_bytes: int | None = None
    stats: dict[str, int] = {}
    started_at: float = 0.0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StatusReport)


async def serve_status(nc: NATS, subjects: Subjects, report: Callable[[], StatusReport]) -> Any:
    """Answer status requests with ``report()``; returns the subscription (unsubscribe to stop)."""

    async def on_request(msg: Msg) -> None:
        if msg.reply:
            await nc.publish(msg.reply, _encoder.encode(report()))

    return await nc.subscribe(subjects.status_subject, cb=on_request)


async def collect_status(nc: NATS, subjects: Subjects, *, wait_s: float = 0.5) -> list[StatusReport]:
    """Scatter a status request and gather every answer that arrives within ``wait_s``."""
    inbox = nc.new_inbox()
    reports: list[StatusReport] = []

    async def on_reply(msg: Msg) -> None:
        try:
            reports.append(_decoder.decode(msg.data))
        except msgspec.DecodeError:
            pass

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subjects.status_subject, b"", reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait_s)  # scatter-gather: every sidecar that answers within the window
    finally:
        await sub.unsubscribe()
    return sorted(reports, key=lambda r: (r.role, r.id))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="NATS server URL (default: $NATS_URL)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--wait", type=float, default=0.5, help="seconds to collect answers")
    parser.add_argument("--json", action="store_true", help="print JSON lines")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from sdk.connection import connect_nats

    nc = await connect_nats(args.nats_url)
    try:
        reports = await collect_status(nc, Subjects(args.prefix), wait_s=args.wait)
        cluster = None if args.json else await cluster_view(nc, Subjects(args.prefix))
    finally:
        await nc.close()
    if args.json:
        for r in reports:
            print(_encoder.encode(r).decode())
        return 0
    if not reports:
        print("no jetbatch sidecar answered")
        return 1
    print(f"{'role':<11}{'id':<28}{'resident':<22}{'loads':>6}{'batches':>9}{'requests':>10}")
    for r in reports:
        print(
            f"{r.role:<11}{r.id[:27]:<28}{(', '.join(r.resident) or '-')[:21]:<22}"
            f"{r.stats.get('loads', 0):>6}{r.stats.get('batches', 0):>9}{r.stats.get('requests', 0):>10}"
        )
    if cluster is not None:
        holders, backlog = cluster
        print(f"\n{'model':<24}{'backlog':>8}  held by")
        for model in sorted(set(holders) | set(backlog)):
            print(f"{model:<24}{backlog.get(model, 0):>8}  {', '.join(sorted(holders.get(model, []))) or '-'}")
    return 0


async def cluster_view(nc: NATS, subjects: Subjects) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Which worker holds which model (from the workers' key-value adverts) and the backlog per
    model (one stream-info call)."""
    import nats.errors
    import nats.js.errors

    from .cluster import WorkerAdvert

    js = nc.jetstream(timeout=2)
    holders: dict[str, list[str]] = {}
    try:
        kv = await js.key_value(subjects.kv_bucket)
        now = time.time()
        for key in await kv.keys():
            entry = await kv.get(key)
            if not entry.value:
                continue
            advert = msgspec.json.decode(entry.value, type=WorkerAdvert)
            if now - advert.updated_at > 30:
                continue
            for model in advert.resident:
                holders.setdefault(model, []).append(advert.id)
    except (nats.errors.Error, nats.js.errors.Error, msgspec.DecodeError, asyncio.TimeoutError):
        pass
    backlog: dict[str, int] = {}
    try:
        info = await js.stream_info(subjects.models_stream, subjects_filter=subjects.models_wildcard)
        for subject, count in (info.state.subjects or {}).items():
            model = subjects.model_from_subject(subject)
            if model:
                backlog[model] = count
    except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
        pass
    return holders, backlog
