"""What the models stream and its consumers say, read with limits: stream timestamps and
sequences of arrival events (forgeable headers), a line's stored count, what a count of a
consumer missed, and why a fetch came back empty. Pure functions of what they are given."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Callable, Literal, Mapping, NamedTuple

from nats.aio.msg import Msg

from jetbatch.sdk.protocol import Headers, request_id_of

from .slots import ack_info

__all__ = [
    "CountedThrough", "EmptyFetch", "LineStored", "empty_fetch", "line_stored", "missed_by", "parse_stream_sequence", "parse_stream_timestamp", "request_key",
    "stored_after", "unheld",
]  # fmt: skip

_MAX_TIMESTAMP_CHARS = 40
_MAX_SEQUENCE_CHARS = 20  # a uint64
_KEY_TOKEN_RE = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
_MINUTES: dict[str, float | None] = {}
def request_key(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """(tenant, request id) of an arrival, when both headers are well formed (None otherwise:
    such a request cannot be cancelled while it waits, only when its batch forms)."""
    tenant = headers.get(Headers.TENANT)
    if tenant is not None and (not isinstance(tenant, str) or not _KEY_TOKEN_RE.match(tenant)):
        return None
    rid = request_id_of(headers.get(Headers.MSG_ID), tenant)
    if not isinstance(rid, str) or not _KEY_TOKEN_RE.match(rid):
        return None
    return (tenant or "", rid)


def parse_stream_timestamp(text: str | None) -> float | None:
    """Unix seconds of a JetStream RFC 3339 timestamp (``2026-12-04T16:07:39.458084362Z``), or
    None for anything else: the header is data a publisher could forge, so it is parsed with a
    length limit and never raises."""
    if not text or len(text) > _MAX_TIMESTAMP_CHARS or not text.endswith("Z"):
        return None
    base, _, frac = text[:-1].partition(".")
    if frac and not frac.isdigit():
        return None
    # Every arrival event carries one, and a minute's arrivals share the date, hour and minute:
    # those are read once a minute (a datetime for each event was a quarter of the feed's cost).
    if _strict_seconds(base):
        minute = _minute_at(base[:16])
        seconds = None if minute is None else minute + int(base[17:])
    else:
        seconds = _iso_seconds(base)
    if seconds is None:
        return None
    return seconds + (float(f"0.{frac}") if frac else 0.0)


def _strict_seconds(base: str) -> bool:
    """Whether ``base`` is exactly ``YYYY-MM-DDTHH:MM:SS`` in ASCII digits (seconds under 60):
    only then is its minute the same datetime alone as in full. A forged ``T00-00:01`` reads as
    an hour with a UTC offset (``fromisoformat``), and its "minute" as another time."""
    return (
        len(base) == 19 and base.isascii() and base[4] == base[7] == "-" and base[10] == "T" and base[13] == base[16] == ":"
        and (base[:4] + base[5:7] + base[8:10] + base[11:13] + base[14:16] + base[17:]).isdigit() and base[17:] < "60"
    )  # fmt: skip


def _iso_seconds(base: str) -> float | None:
    try:
        return datetime.fromisoformat(base).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def stored_after(known: Any, seq: int | None, *, ordered: bool = False) -> int:
    """How many of a line's newest known arrivals were stored after stream sequence ``seq``.
    The feed counts arrivals in the order the stream stored them, so the count stops at the
    first one not after ``seq``, or whose sequence is unknown. ``ordered``: every entry has a
    sequence, each larger than the one before (no forged event among them): then the first one
    after ``seq`` is found by bisection. Counting back one by one cost a fetch of a deep queue a
    pass over up to ``MAX_KNOWN_TIMES`` entries (6% of a saturated worker's samples)."""
    if seq is None or not known:
        return 0
    newest = known[-1][3]
    if newest is None or newest <= seq:
        return 0
    if ordered:
        lo, hi = 0, len(known) - 1  # known[hi] is after seq
        while lo < hi:
            mid = (lo + hi) // 2
            if known[mid][3] <= seq:
                lo = mid + 1
            else:
                hi = mid
        return len(known) - lo
    n = 0
    for entry in reversed(known):
        if entry[3] is None or entry[3] <= seq:
            break
        n += 1
    return n


def parse_stream_sequence(text: str | None) -> int | None:
    """A republished message's stream sequence (``Nats-Sequence``), None unless plain digits
    of a sane length: forgeable data, like every header of an arrival event."""
    if not text or len(text) > _MAX_SEQUENCE_CHARS or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def _minute_at(prefix: str) -> float | None:
    """Unix seconds of ``YYYY-MM-DDTHH:MM`` (UTC), None when it is no such time; the last few kept."""
    at = _MINUTES.get(prefix, -1.0)
    if at == -1.0:
        at = _iso_seconds(prefix + ":00")
        if len(_MINUTES) >= 4:  # forged ones must not grow it: only the current minute repeats
            _MINUTES.clear()
        _MINUTES[prefix] = at
    return at


EmptyFetch = Literal["fetch again", "in our puller", "delivered elsewhere", "unreachable"]
def empty_fetch(*, pending: int, ack_pending: int, missed_before: bool, in_our_puller: bool) -> EmptyFetch:
    """Why a fetch came back empty although the count said requests wait, from what the model's
    consumer says of itself. ``pending`` undelivered: the fetch was short, or a peer took only
    some; fetch again, once (``missed_before``: this is the second empty fetch in a row). In this
    worker's own puller (delivered after its fetch returned): the next fetch takes them.
    Delivered to someone and unacked, or undelivered yet not delivered to two fetches in a row
    (a consumer whose leader moved, a pull lost with a node): held back for a recheck
    (:meth:`QueueView.found_empty`). Neither undelivered nor unacked, yet still stored: left
    behind in the work queue, never to be delivered. Only that last one is held back for good,
    so it must never be concluded while the consumer still has something to deliver (it once
    was, on ack pending 0 alone: a model's 8 undelivered requests went unserved for a minute on a
    3-node cluster, its worker holding them back and its peers counting them served)."""
    if pending and not missed_before:
        return "fetch again"
    if in_our_puller:
        return "in our puller"
    if pending or ack_pending:
        return "delivered elsewhere"
    return "unreachable"


def unheld(stored: int, mine: int, advertised: int) -> int:
    """What the stream stores of a model beyond what this worker holds and what its peers'
    adverts say they hold: the requests a load could be for, or that a peer's take events may
    not hide. Arrival and take events play no part (anyone who may publish on their subjects
    can forge them); adverts lag a heartbeat, so this may over-count, never under-count."""
    return max(0, stored - mine - advertised)


class CountedThrough:
    """The stream sequence the counts so far cover: the last whole count's (replaced, never only
    raised: a stream made again starts its sequences over), and each line's own since (its count,
    or what its consumer said at a fetch). A request stored at or before it is in a count."""

    def __init__(self) -> None:
        self._whole = 0
        self._lines: dict[tuple[str, bool], int] = {}

    def whole(self, seq: int | None) -> None:
        if seq is not None:
            self._whole = seq
            self._lines.clear()

    def line(self, name: str, bulk: bool, seq: int | None) -> None:
        if seq is not None and seq > self._whole:
            self._lines[(name, bulk)] = max(seq, self._lines.get((name, bulk), 0))

    def covers(self, name: str, bulk: bool, seq: int | None) -> bool:
        """Whether the request stored at ``seq`` on that line is in a count taken since (its
        arrival event came late: counted again, it over-counted the line by one)."""
        return seq is not None and seq <= max(self._whole, self._lines.get((name, bulk), 0))


class LineStored(NamedTuple):
    """What the models stream stores on one line's subject, and its last sequence then."""

    messages: int
    last_seq: int | None


def line_stored(info: Any, subject: str) -> LineStored:
    """Read a stream info asked with ``subjects_filter=subject`` (a subject with nothing stored
    is absent from its answer)."""
    state = getattr(info, "state", None)
    subjects = getattr(state, "subjects", None) or {}
    n = subjects.get(subject, 0) if isinstance(subjects, dict) else 0
    last_seq = getattr(state, "last_seq", None)
    return LineStored(n if isinstance(n, int) and n > 0 else 0, last_seq if isinstance(last_seq, int) else None)


def missed_by(count: Any) -> tuple[Callable[[Msg], bool | None], Callable[[Msg], bool]]:
    """Which deliveries a count of a line's consumer (its ``ConsumerInfo``) did not count as
    undelivered, though they may reach this worker's puller only after its answer (the server
    sends deliveries and API answers from different places): first deliveries made when the
    count was taken (a stream sequence no later than the consumer's last delivered one: it
    delivers in stream order, so a later first delivery of such a sequence was on its way), and
    redeliveries (counted as unacked while they waited, whenever they come). A message whose ack
    subject is not JetStream's is no request, never counted. ``Puller.watch`` takes the two; the
    first says None at a later first delivery: the ones before it came first on the connection."""
    delivered = getattr(count.delivered, "stream_seq", None) or 0

    def before(msg: Msg) -> bool | None:
        info = ack_info(msg)
        if info is None or info.delivered > 1:
            return False
        return True if info.stream_seq <= delivered else None

    def again(msg: Msg) -> bool:
        info = ack_info(msg)
        return info is not None and info.delivered > 1

    return before, again
