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

__all__ = ["StatusReport", "add_arguments", "collect_status", "run", "serve_status"]

VERSION = "0.1.0"


class StatusReport(msgspec.Struct, frozen=True, kw_only=True):
    role: str  # "worker" or "classifier"
    id: str
    version: str = VERSION
    models: list[str] = []
    resident: list[str] = []
    backlog: dict[str, int] = {}
    memory_bytes: int = 0
    memory_budget_bytes: int | None = None
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
    finally:
        await nc.close()
    if args.json:
        for r in reports:
            print(_encoder.encode(r).decode())
        return 0
    if not reports:
        print("no jetbatch sidecar answered")
        return 1
    print(f"{'role':<11}{'id':<28}{'resident':<22}{'backlog':<30}{'batches':>8}")
    for r in reports:
        backlog = ", ".join(f"{k}={v}" for k, v in sorted(r.backlog.items()) if v) or "-"
        print(f"{r.role:<11}{r.id[:27]:<28}{(', '.join(r.resident) or '-')[:21]:<22}{backlog[:29]:<30}{r.stats.get('batches', 0):>8}")
    return 0
