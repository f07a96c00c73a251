"""Dead letters: requests that cannot be served, kept with their reason for `jetbatch dlq`."""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from sdk.protocol import Headers, Subjects

__all__ = ["dead_letter"]

log = logging.getLogger("jetbatch.deadletter")


async def dead_letter(js: JetStreamContext, subjects: Subjects, stage: str, msg: Msg, reason: str) -> bool:
    """Copy ``msg`` (payload and headers) to ``<prefix>.dlq.<stage>`` with its reason, original
    subject and delivery count. Returns False if JetStream did not take it (logged)."""
    original = dict(msg.headers or {})
    headers = dict(original)
    headers.pop(Headers.MSG_ID, None)  # the DLQ keeps every entry, even for a reused request id
    deliveries = 1
    try:
        deliveries = msg.metadata.num_delivered
    except Exception:  # noqa: BLE001 - not a JetStream message
        pass
    headers.update(
        {
            Headers.DLQ_REASON: reason[:1000],
            Headers.DLQ_STAGE: stage,
            Headers.DLQ_SUBJECT: msg.subject,
            Headers.DLQ_DELIVERIES: str(deliveries),
            Headers.REQUEST_ID: original.get(Headers.MSG_ID, ""),
        }
    )
    try:
        await js.publish(subjects.dead_letter(stage), msg.data, headers=headers, timeout=5)
        return True
    except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
        log.warning("dead-lettering %s failed: %r", original.get(Headers.MSG_ID), exc)
        return False
