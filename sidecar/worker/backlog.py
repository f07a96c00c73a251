"""What waits in each model's queue, as the model's shared consumer sees it.

Backlog = messages not yet delivered to any worker (``num_pending``) + *stranded* messages:
delivered but unacked, and neither in flight here nor accounted for by a peer's advert (a dead
worker's requests, due for redelivery within the ack wait, or messages whose ack was lost while a
leader was being elected). Stranded messages count until a fetch comes back empty; they are then
held back for one ack wait, by which every one of them is due for redelivery. Counting every
stored message instead would chase requests in flight at other workers: backlog nobody can fetch.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Iterable, Mapping

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from jetbatch.sdk.protocol import ProtocolError, Subjects, deadline_from_headers

from ..streams import model_consumer_name
from .parts import Slot

__all__ = ["refresh_backlog"]

log = logging.getLogger("jetbatch.worker")


async def refresh_backlog(
    js: JetStreamContext,
    subjects: Subjects,
    slots: Iterable[Slot],
    now: float,
    *,
    mine: Mapping[str, int],
    not_ours: Mapping[str, int],
) -> bool:
    """Update every slot's ``backlog`` and ``oldest_enqueued_at`` (one consumer-info call per
    model, one direct get per waiting model). ``mine``: messages in flight here per model;
    ``not_ours``: what peers account for. A failed call leaves that slot as it was; returns False
    if any call failed."""
    ok = True
    for slot in slots:
        try:
            info = await js.consumer_info(subjects.models_stream, model_consumer_name(slot.name))
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.debug("consumer info for %s failed: %r", slot.name, exc)
            ok = False
            continue
        pending = int(info.num_pending or 0)
        unacked = int(info.num_ack_pending or 0)
        slot.stranded = max(0, unacked - mine.get(slot.name, 0) - not_ours.get(slot.name, 0))
        held = now < slot.hold_until
        if not held:
            slot.unfetchable = 0
        slot.backlog = pending + (0 if held else slot.stranded)
        if slot.backlog == 0:
            slot.oldest_enqueued_at = None
            slot.head_deadline = None
        elif pending and held or not slot.stranded:
            delivered = info.delivered.stream_seq if info.delivered is not None else 0
            slot.oldest_enqueued_at = await _oldest(js, subjects, slot, (delivered or 0) + 1, now)
        else:
            ack_floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
            slot.oldest_enqueued_at = await _oldest(js, subjects, slot, (ack_floor or 0) + 1, now)
    return ok


async def _oldest(js: JetStreamContext, subjects: Subjects, slot: Slot, from_seq: int, now: float) -> float | None:
    """When the oldest waiting request was enqueued; also notes its deadline (``head_deadline``),
    which the scheduler weighs (the head's is the earliest when callers use one timeout)."""
    try:
        raw = await js.get_msg(subjects.models_stream, seq=from_seq, subject=subjects.model(slot.name), next=True)
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
        return slot.oldest_enqueued_at or now
    try:
        slot.head_deadline = deadline_from_headers(getattr(raw, "headers", None))
    except ProtocolError:
        slot.head_deadline = None  # a malformed deadline: that request gets bad_request anyway
    ts = _raw_timestamp(raw)
    return min(ts, now) if ts is not None else now


def _raw_timestamp(raw: Any) -> float | None:
    ts = getattr(raw, "time", None)
    if ts is None:
        return None
    if hasattr(ts, "timestamp"):
        return float(ts.timestamp())
    try:
        return datetime.fromisoformat(str(ts).replace("Z", "+00:00")[:26] + "+00:00").timestamp()
    except ValueError:
        return None
