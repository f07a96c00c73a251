"""Health and readiness: every sidecar answers on ``<prefix>.status``; ``jetbatch status`` asks.

A request to ``<prefix>.status`` (any body) is answered by every running sidecar with one JSON
:class:`StatusReport`, so one scatter-gather request lists the whole bus. The same subject is the
``status`` endpoint of each sidecar's NATS micro service (``nats micro ls/info/stats``, see
discovery.py), whose STATS carry the same report.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import ProtocolError, ReplyPolicy, SidecarReport, Subjects

from .errors import TRANSPORT_ERRORS
from .cluster import CLAIM_PREFIX

__all__ = ["StatusReport", "StatusService", "allowed_reply", "cluster_view", "collect_status", "serve_status"]



StatusReport = SidecarReport  # the status answer is the sidecar's report


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StatusReport)


class StatusService:
    """The status endpoint and the NATS micro-services face of one sidecar (see discovery.py)."""

    def __init__(self, sub: Any, micro: Any) -> None:
        self._sub = sub
        self.micro = micro

    async def unsubscribe(self) -> None:
        await self.micro.stop()
        await self._sub.unsubscribe()


async def serve_status(
    nc: NATS, subjects: Subjects, report: Callable[[], StatusReport], policy: ReplyPolicy, *, out: NATS | None = None
) -> StatusService:
    """Answer status requests with ``report()`` and register with the NATS micro-services
    protocol (``nats micro ls``); returns a handle (``await handle.unsubscribe()`` to stop).

    Answers go only where ``policy`` allows (inboxes), as for requests: a status request whose
    reply subject names ``$JS.API...`` must not make the sidecar call the JetStream API. ``out``:
    the connection answers are published on (the reply identity's, when the deployment has one:
    only it may publish to inboxes under the least-privilege configuration)."""
    from jetbatch.sdk import __version__

    from .discovery import MicroService

    first = report()
    out = out or nc
    micro = MicroService(nc, subjects, first.role, report, policy, first.version or __version__, out=out)

    async def on_request(msg: Msg) -> None:
        if allowed_reply(msg, policy) is None:
            return
        started = time.perf_counter()
        await out.publish(msg.reply, _encoder.encode(report()))
        micro.note_status_request(time.perf_counter() - started)

    sub = await nc.subscribe(subjects.status_subject, cb=on_request)
    await micro.start()
    return StatusService(sub, micro)


def allowed_reply(msg: Msg, policy: ReplyPolicy) -> str | None:
    """Where a request to a sidecar's own subject (status, ring) may be answered: its reply
    subject when the reply policy allows it (an inbox), else None: nobody legitimate waits there,
    and the request gets no answer."""
    if not msg.reply:
        return None
    try:
        policy.check(msg.reply)
    except ProtocolError:
        return None
    return msg.reply


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


async def cluster_view(
    nc: NATS, subjects: Subjects, *, advert_ttl_s: float = 30.0
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Which worker holds which model (from the workers' key-value adverts) and the backlog per
    model (one stream-info call)."""

    js = nc.jetstream(timeout=2)
    holders: dict[str, list[str]] = {}
    try:
        kv = await js.key_value(subjects.kv_bucket)
        now = time.time()
        for key in await kv.keys():
            if key.startswith(CLAIM_PREFIX):
                continue
            entry = await kv.get(key)
            if not entry.value:
                continue
            advert = msgspec.json.decode(entry.value, type=SidecarReport)
            if now - advert.updated_at > (advert.valid_s or advert_ttl_s):
                continue
            for model in advert.resident:
                holders.setdefault(model, []).append(advert.id)
    except failures.TRANSPORT_ERRORS + (msgspec.DecodeError,):
        pass
    backlog: dict[str, int] = {}
    try:
        info = await js.stream_info(subjects.models_stream, subjects_filter=subjects.models_wildcard)
        for subject, count in (info.state.subjects or {}).items():
            model = subjects.model_from_subject(subject)
            if model:
                backlog[model] = backlog.get(model, 0) + count  # both classes' lines
    except TRANSPORT_ERRORS:
        pass
    return holders, backlog
