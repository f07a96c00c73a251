"""Counting every queue in one call: the models stream's stored count per subject
(``stream_info`` with a subjects filter: O(models with messages), not O(registered models)),
reconciled into the queue view (``QueueView.counted``), and the few heads nobody saw arrive read
by direct get. The I/O half of ``worker/queues.py``."""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

import msgspec

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import Priority, ProtocolError, Subjects, deadline_from_headers

from ..errors import TRANSPORT_ERRORS
from .queues import QueueView
from .slots import Slot
from .stream_facts import parse_stream_timestamp

__all__ = ["StreamCounts", "count_queues"]

log = logging.getLogger("jetbatch.worker")

Held = Mapping[str, int] | Callable[[], Mapping[str, int]]  # per model, or how to read it when needed


class _State(msgspec.Struct):
    last_seq: int | None = None
    subjects: dict[str, int] | None = None


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _StreamInfo(msgspec.Struct):
    """The fields of a stream-info answer a count reads; the configuration is skipped unparsed."""

    state: _State | None = None
    error: _ApiError | None = None


_decode_info = msgspec.json.Decoder(_StreamInfo)


class StreamCounts:
    """Stream-info requests for the stored counts alone. The answer carries the stream's whole
    configuration and, with a subjects filter, a count for each subject holding requests, which
    nats-py parsed into objects at each count, each line count and each look before a load (8% of
    a busy worker's samples, ``json.decoder.raw_decode``, when the models stream still listed
    each model). Here the bytes are read by msgspec, which skips what it is not asked for.
    Raises what ``js.stream_info`` raises: an API error as nats-py's
    exception for it (``failures.api_error``), a timeout, a closed connection."""

    def __init__(self, nc: Any, *, timeout_s: float = 5.0, api_prefix: str = "$JS.API") -> None:
        self._nc = nc
        self._timeout_s = timeout_s
        self._prefix = api_prefix

    async def stream_info(self, stream: str, subjects_filter: str | None = None) -> _StreamInfo:
        payload = json.dumps({"subjects_filter": subjects_filter}).encode() if subjects_filter else b""
        msg = await self._nc.request(f"{self._prefix}.STREAM.INFO.{stream}", payload, timeout=self._timeout_s)
        try:
            info = _decode_info.decode(msg.data)
        except msgspec.DecodeError as exc:
            raise failures.api_error(500, 0, f"unreadable stream info: {exc}") from None
        if info.error is not None:
            raise failures.api_error(info.error.code, info.error.err_code, info.error.description)
        return info


async def count_queues(
    view: QueueView, js: Any, subjects: Subjects, now: float, *, mine: Held, not_ours: Mapping[str, int], mine_bulk: Held = {},
    counts: Any = None,
) -> bool:
    """Reconcile every queue with one stream-info call (and read a few unknown heads); False
    when JetStream did not answer (the view is kept as it was). ``mine`` and ``mine_bulk``
    (what this worker holds unacked, per model) may be functions, read once the count is
    back: a batch acked while the count was on its way may be gone from it, and subtracted
    again it hid as many waiting requests until the next count. Read after, a batch fetched
    meanwhile is in both (stored until acked), and one acked meanwhile at worst over-counts
    (an empty fetch). ``counts``: where the stream info is asked (:class:`StreamCounts`; else ``js``)."""
    try:
        info = await (counts or js).stream_info(subjects.models_stream, subjects_filter=subjects.models_wildcard)
    except TRANSPORT_ERRORS as exc:
        log.debug("stream info for the backlog failed: %r", exc)
        return False
    mine = mine() if callable(mine) else mine
    mine_bulk = mine_bulk() if callable(mine_bulk) else mine_bulk
    last_seq = getattr(info.state, "last_seq", None)
    stored = getattr(info.state, "subjects", None) or {}
    reads = view.counted(
        stored, last_seq if isinstance(last_seq, int) else None, now, subjects=subjects, mine=mine, not_ours=not_ours, mine_bulk=mine_bulk,
    )  # fmt: skip
    for slot in reads:
        await _read_head(view, js, subjects, slot, now)
    return True


async def _read_head(view: QueueView, js: Any, subjects: Subjects, slot: Slot, now: float) -> None:
    """The first stored message of the model's subject: its enqueue time and deadline. It may
    be delivered already (in flight somewhere): an over-estimate of the age, on the safe side."""
    # The line with requests nobody saw arrive (the interactive one when both have some).
    priority = Priority.INTERACTIVE if slot.interactive > len(slot.known_times) else Priority.BATCH
    try:
        raw = await js.get_msg(subjects.models_stream, seq=1, subject=subjects.model(slot.name, priority), next=True)
    except TRANSPORT_ERRORS:
        view.set_unknown_head(slot, now, None)
        return
    headers = getattr(raw, "headers", None)
    try:
        deadline = deadline_from_headers(headers)
    except ProtocolError:
        deadline = None  # a malformed deadline: that request gets bad_request anyway
    ts = getattr(raw, "time", None)
    at = ts.timestamp() if hasattr(ts, "timestamp") else parse_stream_timestamp(str(ts) if ts is not None else None)
    view.set_unknown_head(slot, min(at, now) if at is not None else now, deadline)
