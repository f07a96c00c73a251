"""What waits in each model's queue, learnt from events and checked in bulk.

A decision must not cost a round trip per registered model (at 200 models that made the live
worker 50x slower than its simulator, and idle it burned a third of a core polling). So:

- **Arrivals are events.** The models stream republishes the headers of every request it stored
  to ``<prefix>.arrived.<model>`` (no payload; ``sidecar/streams.py``). :class:`ArrivalFeed`
  counts each one into its model's queue with the stream's timestamp and the request's deadline,
  and wakes the loop.
- **Counts are reconciled in bulk.** One stream-info call with a subjects filter returns the
  stored count of every model that has messages (:meth:`QueueView.reconcile`): O(models with
  messages), not O(registered models). Stored = not yet delivered + delivered and unacked. What
  this worker holds and what live peers advertise as theirs is subtracted; what remains is the
  *backlog*: waiting requests and *stranded* ones (a dead worker's, due for redelivery within the
  ack wait). When a fetch finds the queue empty although the count says otherwise, the rest is
  unfetchable (delivered elsewhere): it is held back from the backlog for one ack wait, by which
  every one of them is due again, and shrinks as they are acked.
- **Two classes, two lines.** Interactive requests wait on ``<prefix>.model.<m>``, batch ones on
  ``<prefix>.model.<m>.batch``, each a FIFO line with its own consumer; a worker pulls the
  interactive line first, and so, the rules assume, do its peers. ``Slot.bulk`` counts the batch
  line within the backlog, from the same events and the same bulk count.
- **Ages come from the events.** Each queue keeps the stream timestamps of its newest waiting
  requests in order; the oldest of them is the queue's head. A head nobody saw arrive (requests
  stored before this worker started, or while it was disconnected) is read once with a direct
  get of the subject's first stored message, a few per reconcile.

All of it is bookkeeping on :class:`~sidecar.worker.slots.Slot` fields; the pure part (the
counting rules) is separate from the I/O (the subscription and the stream-info call), so the unit
tests drive the rules without a server.
"""

from __future__ import annotations

import logging
import math
import re
import time
from datetime import datetime, timezone
from typing import Any, Callable, Literal, Mapping, NamedTuple

from nats.aio.msg import Msg

from jetbatch.sdk.protocol import Headers, Priority, ProtocolError, Subjects, deadline_from_headers, request_id_of

from ..errors import TRANSPORT_ERRORS
from .counters import Counters
from .slots import Slot, ack_info

__all__ = [
    "RECHECK_S", "ArrivalFeed", "EmptyFetch", "LineStored", "QueueView", "empty_fetch", "line_stored", "missed_by", "parse_stream_timestamp",
]

log = logging.getLogger("jetbatch.worker")

# Enqueue times kept per queue: enough for the cluster share's "age of the part that is ours"
# (the newest k requests) at any realistic backlog; beyond, the oldest known time stands in.
MAX_KNOWN_TIMES = 4096
# Heads read by direct get per reconcile (after a start or a reconnect many can be unknown).
MAX_HEAD_READS = 16
# How soon a queue held back past its stranded requests' ack wait is tried again.
RECHECK_S = 1.0
# Limits on the take events (core messages any worker-permitted client can send: hostile input).
MAX_PEER_HELD = 100_000
MAX_PEERS_A_MODEL = 256  # peers whose unsettled takes of one model are kept
_MAX_TAKE_CHARS = 8
_MAX_PEER_ID_CHARS = 128
WORKER_HEADER = "Jetbatch-Worker"
_KEY_TOKEN_RE = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
_MAX_TIMESTAMP_CHARS = 40
_MAX_SEQUENCE_CHARS = 20  # a uint64


def _request_key(headers: Mapping[str, str]) -> tuple[str, str] | None:
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


_MINUTES: dict[str, float | None] = {}


def _stored_after(known: Any, seq: int | None, *, ordered: bool = False) -> int:
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


Held = Mapping[str, int] | Callable[[], Mapping[str, int]]  # per model, or how to read it when needed
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


class QueueView:
    """The backlog and head of every served model's queue (fields of each :class:`Slot`).

    ``peer_event_s``: how long a peer's take event counts its requests as the peer's (until it
    settles them, or its advert, sent every heartbeat, says what it holds)."""

    def __init__(self, slots: Mapping[str, Slot], *, peer_event_s: float = 2.0) -> None:
        self._slots = slots
        # Known waiting requests by (tenant, request id): where a cancel notice finds its queue.
        self._where: dict[tuple[str, str], str] = {}
        # Lines (model, bulk) whose known arrivals are not all in increasing sequence (a forged or
        # unsequenced event among them): how many were counted since the last out of order. Once
        # that one has left the line (taken, or beyond what is kept), the line is in order again.
        self._unordered: dict[tuple[str, bool], int] = {}
        self.waiting: set[str] = {name for name, s in slots.items() if s.backlog > 0}
        self.peer_event_s = peer_event_s
        # model -> peer -> (requests it took and has not settled, when last told)
        self._peer_held: dict[str, dict[str, tuple[int, float]]] = {}
        self._peers_pruned_at: dict[str, float] = {}  # model -> when peer_took last dropped old entries
        # Requests stored for models this worker does not register, per model, as of the last
        # count (worker/orphans.py: answered when no live worker registers them either).
        self.unregistered: dict[str, int] = {}
        self.unregistered_bulk: dict[str, int] = {}  # of those, in the batch line

    # --- the counting rules (pure: no I/O, time passed in) ------------------------------------

    def arrived(
        self, slot: Slot, enqueued_at: float, deadline: float | None, *, bulk: bool = False, key: tuple[str, str] | None = None,
        seq: int | None = None,
    ) -> None:
        """One request stored for ``slot``'s model (``bulk``: of the batch class; ``key``: its
        tenant and request id, for a later cancel; ``seq``: the stream sequence it was stored
        at, for :meth:`fetched`)."""
        slot.backlog += 1
        slot.arrivals += 1
        known = slot.known_bulk if bulk else slot.known_times
        if bulk:
            slot.bulk += 1
        line = (slot.name, bulk)
        if seq is None or (known and (known[-1][3] is None or known[-1][3] >= seq)):
            self._unordered[line] = 0
        elif line in self._unordered:
            self._unordered[line] += 1
        known.append((enqueued_at, deadline, key, seq))
        if key is not None:
            self._where[key] = slot.name
        if len(known) > MAX_KNOWN_TIMES:
            dropped = self._drop_oldest(slot, known)
            slot.unknown_head_at = dropped if slot.unknown_head_at is None else min(slot.unknown_head_at, dropped)
        if slot.backlog == 1 or slot.oldest_enqueued_at is None:
            self._set_head(slot)
        self.waiting.add(slot.name)

    def _stored_after(self, slot: Slot, bulk: bool, seq: int | None) -> int:
        known = slot.known_bulk if bulk else slot.known_times
        line = (slot.name, bulk)
        since = self._unordered.get(line)
        if since is not None and len(known) <= since:
            del self._unordered[line]  # what is left all came after the last one out of order
            since = None
        return _stored_after(known, seq, ordered=since is None)

    def cancel(self, key: tuple[str, str]) -> bool:
        """A caller cancelled the request ``key``: if it waits in a queue we know, it stops
        counting there (until it leaves the queue). False when it is not known to wait."""
        name = self._where.get(key)
        slot = self._slots.get(name) if name is not None else None
        if slot is None:
            return False
        slot.cancelled_keys.add(key)
        return True

    def _drop_oldest(self, slot: Slot, known: Any) -> float:
        """Forget the oldest entry of one line (fetched, or beyond what is tracked)."""
        at, _, key, _ = known.popleft()
        if key is not None:
            self._where.pop(key, None)
            slot.cancelled_keys.discard(key)
        return float(at)

    def fetched(
        self, slot: Slot, n: int, pending: int | None, *, bulk: bool = False, last_seq: int | None = None, redelivered: bool = False
    ) -> None:
        """This worker took ``n`` requests from the head of one line (``bulk``: the batch one);
        ``pending``: what its consumer said was still undelivered there when it delivered the
        last of them, stored at stream sequence ``last_seq`` (None: unknown). Stranded requests
        come back at the next reconcile.

        ``redelivered``: the last of them was a redelivery. The consumer counts requests due for
        redelivery as unacked, not undelivered, until it delivers them, so ``pending`` leaves
        out the rest of a dead peer's batch: the count the worker had, less what it took, is
        kept (taking ``pending`` alone served one batch of a stranded 8 and left the rest to the
        next count, a poll interval).

        A request stored after that delivery is not in ``pending``, yet its arrival event may
        have been counted before the fetch's answer was read (another subscription's callback):
        the known arrivals stored after ``last_seq`` stay counted. Taking ``pending`` alone
        erased them, and such a request waited for the next count of the queue, up to
        ``idle_refresh_s``, although it was stored while the batch window was open."""
        line = slot.bulk if bulk else slot.interactive
        if pending is None:
            left = max(0, line - n)
        else:
            left = max(pending, self._stored_after(slot, bulk, last_seq))
            if redelivered:
                left = max(left, line - n)
        self._count_line(slot, left, bulk=bulk)

    def peer_took(self, slot: Slot, peer: str, n: int, now: float) -> None:
        """A peer fetched ``n`` of the queue's requests (its take event): they leave this
        worker's backlog now, the oldest first (a consumer delivers in order), instead of at the
        next count; until the peer settles them they are the peer's, not stranded. Without it a
        peer's served requests stayed in the count for up to a poll interval, and a worker loaded
        a model for requests already answered (the 4-worker bench: more loads than batches)."""
        held = self._peer_held.setdefault(slot.name, {})
        if peer not in held and len(held) >= MAX_PEERS_A_MODEL:
            # Entries go when the model waits (peers_hold) or the peer leaves the view: events
            # under ever new ids (anyone who may publish take events) grew this for good. Old
            # ones are dropped at most once a second; a new peer past the limit is not counted
            # (an over-count, which the next count corrects).
            if now - self._peers_pruned_at.get(slot.name, -math.inf) > 1.0:
                self._peers_pruned_at[slot.name] = now
                self.peers_hold(slot.name, now)
                held = self._peer_held.setdefault(slot.name, {})
            if len(held) >= MAX_PEERS_A_MODEL:
                return
        count = held.get(peer, (0, now))[0]
        held[peer] = (min(count + n, MAX_PEER_HELD), now)
        # Peers pull the interactive line first, as we do.
        self._count(slot, slot.backlog - n, bulk=slot.bulk - max(0, n - slot.interactive))

    def peer_settled(self, name: str, peer: str, n: int, now: float) -> None:
        """A peer answered (or gave back) ``n`` requests it took."""
        held = self._peer_held.get(name)
        if not held or peer not in held:
            return
        left = held[peer][0] - n
        if left > 0:
            held[peer] = (left, now)
        else:
            del held[peer]
            if not held:
                del self._peer_held[name]

    def forget_peers(self, peers: list[str]) -> None:
        """Peers that left (or whose process was replaced under the same id): what their take
        events said they hold is theirs no more. A killed process never sends its settle event,
        and its successor's events would keep that hold alive under the same id (the successor's
        first takes may be forgotten with it: an over-count, which costs an empty fetch)."""
        for name in list(self._peer_held):
            held = self._peer_held[name]
            for peer in peers:
                held.pop(peer, None)
            if not held:
                del self._peer_held[name]

    def peers_hold(self, name: str, now: float) -> int:
        """What peers said they took from ``name``'s queue and have not settled (recent events)."""
        held = self._peer_held.get(name)
        if not held:
            return 0
        for peer in [p for p, (_, at) in held.items() if now - at > self.peer_event_s]:
            del held[peer]  # a lost settle event, or a peer gone: its advert or the ack wait tells
        if not held:
            del self._peer_held[name]
        return sum(c for c, _ in held.values())

    def found_empty(self, slot: Slot, now: float, ack_wait_s: float, *, unreachable: bool = False) -> None:
        """A fetch came back empty although the backlog said otherwise: the rest is delivered
        elsewhere (a dead worker's, a delivery lost with a node, or a peer's not advertised yet)
        and comes back when JetStream redelivers it, at a time nobody tells us. For a model on
        this device a look costs one fetch: look again every :data:`RECHECK_S`, so a redelivery is
        served within a second of being due (holding for a whole ack wait after each empty fetch
        answered a request lost with a node 47 s late). For a model elsewhere a look costs a load:
        hold it back until one ack wait after it was first seen stranded, when all of it is due.

        ``unreachable``: the consumer has nothing undelivered and nothing unacked, yet the stream
        still stores these: left behind in the work queue after a stream leader was lost (seen
        in the failover bench: acked, answered, never removed). Nobody will ever deliver them;
        they are held back until the count says they are gone."""
        if slot.backlog > 0 and unreachable:
            slot.unfetchable = slot.backlog
            slot.hold_until = math.inf
        elif slot.backlog > 0 and now >= slot.hold_until:
            slot.unfetchable = slot.backlog
            if slot.resident:
                slot.hold_until = now + RECHECK_S
            else:
                since = slot.stranded_since if slot.stranded_since is not None else now
                slot.hold_until = max(since + ack_wait_s, now + RECHECK_S)
        self._count(slot, 0)

    def listened_again(self, slot: Slot) -> None:
        """The worker listens to a line of ``slot`` again after a time it did not
        (``policy/interest.py``). Requests stored meanwhile were seen by no event, and a hold-back
        (:meth:`found_empty`) spares only the arrivals seen since it: it would mask them as
        delivered elsewhere until it ended and the next count came (a poll interval). The hold
        ends here; if what it held back is still delivered elsewhere, a fetch says so again."""
        slot.unfetchable = 0
        slot.hold_until = 0.0

    def line_counted(
        self, slot: Slot, pending: int, arrived_since: int, *, bulk: bool = False, stored: LineStored | None = None,
        unacked: int = 0, missed: int = 0,
    ) -> None:
        """One line's consumer says ``pending`` requests wait undelivered and ``unacked`` are
        delivered and not acked, ``missed`` of those in this worker's puller for its next fetch;
        ``arrived_since`` arrival events (of any line: an over-count costs a fetch) were counted
        while it was asked; ``stored``: the stream's count of the line, asked just before the
        consumer. The line waits at least the largest of three lower bounds:

        - ``pending + missed``: the consumer's own count. It lags the store: nats-server counts
          a stored message into its consumers' ``num_pending`` from another goroutine after
          storing and republishing it, so a request stored just before the worker subscribed
          again (its event gone to nobody) can be in neither (the worker waited for the next
          count, a poll interval: a CI run caught it).
        - ``stored - unacked + missed``, plus the known arrivals stored after the stream count:
          the store's count is taken when the message is stored. Acks between the two answers
          over-count (a fetch that comes back empty), never under-count.
        - ``arrived_since``."""
        waiting = max(pending + missed, arrived_since)
        if stored is not None:
            after = self._stored_after(slot, bulk, stored.last_seq)
            waiting = max(waiting, max(0, stored.messages - unacked) + missed + after)
        self._count_line(slot, waiting, bulk=bulk)

    def reconcile(
        self, slot: Slot, stored: int, now: float, *, mine: int, not_ours: int, stored_bulk: int = 0, mine_bulk: int = 0,
        last_seq: int | None = None,
    ) -> None:
        """The server's count of ``slot``'s stored messages (``stored_bulk`` of them on the batch
        line; ``mine_bulk`` of ours in flight from it), taken when the stream's last sequence was
        ``last_seq``: the truth the events are checked against. Arrivals counted while the count
        was on its way, stored after it, are not in it and stay counted (as in :meth:`fetched`)."""
        available = max(0, stored - mine - not_ours)
        slot.stranded = max(0, available - slot.known)  # an upper bound: arrivals not seen
        if slot.stranded == 0:
            slot.stranded_since = None
        elif slot.stranded_since is None:
            slot.stranded_since = now
        if now >= slot.hold_until:
            slot.unfetchable = 0
        # Held-back messages leave the count as they are acked or redelivered to someone; the
        # arrivals seen since the hold are never among them (found_empty forgot the older ones).
        slot.unfetchable = min(slot.unfetchable, max(0, available - slot.known))
        # Which line the peers' share comes from is not told: count it against the batch line
        # first, so interactive requests are never hidden behind batch ones a peer holds (at
        # worst interactive work is over-counted until the next count, and visited sooner).
        waiting = available - slot.unfetchable
        interactive = min(max(0, (stored - stored_bulk) - (mine - mine_bulk)), max(0, waiting))
        bulk = max(0, waiting - interactive)
        interactive = max(interactive, self._stored_after(slot, False, last_seq))
        bulk = max(bulk, self._stored_after(slot, True, last_seq))
        self._count(slot, interactive + bulk, bulk=bulk)

    def needs_head(self, slot: Slot) -> bool:
        """Whether the queue's head was never seen arriving (its age must be read once)."""
        return slot.backlog > slot.known and slot.unknown_head_at is None

    def set_unknown_head(self, slot: Slot, enqueued_at: float, deadline: float | None) -> None:
        slot.unknown_head_at = enqueued_at
        slot.unknown_head_deadline = deadline
        self._set_head(slot)

    def _count_line(self, slot: Slot, waiting: int, *, bulk: bool) -> None:
        """One line's count set to ``waiting``, the other line's kept."""
        if bulk:
            self._count(slot, slot.interactive + waiting, bulk=waiting)
        else:
            self._count(slot, waiting + slot.bulk)

    def _count(self, slot: Slot, backlog: int, *, bulk: int | None = None) -> None:
        slot.backlog = max(0, backlog)
        slot.bulk = min(slot.bulk if bulk is None else max(0, bulk), slot.backlog)
        # The known times describe each line's newest requests: drop the oldest beyond its count.
        while len(slot.known_times) > slot.interactive:
            self._drop_oldest(slot, slot.known_times)
        while len(slot.known_bulk) > slot.bulk:
            self._drop_oldest(slot, slot.known_bulk)
        if slot.backlog <= slot.known:
            slot.unknown_head_at = None
            slot.unknown_head_deadline = None
        if slot.backlog == 0:
            self.waiting.discard(slot.name)
        else:
            self.waiting.add(slot.name)
        self._set_head(slot)

    @staticmethod
    def _set_head(slot: Slot) -> None:
        if slot.backlog == 0:
            slot.oldest_enqueued_at = None
            slot.head_deadline = None
            return
        if slot.backlog > slot.known:
            # Older requests than any seen arriving: their head, once read; until then the
            # oldest time seen stands in (an under-estimate of the age that lasts one reconcile).
            if slot.unknown_head_at is not None:
                slot.oldest_enqueued_at = slot.unknown_head_at
                slot.head_deadline = slot.unknown_head_deadline
                return
        heads = [known[0] for known in (slot.known_times, slot.known_bulk) if known]
        if heads:
            slot.oldest_enqueued_at = min(at for at, _, _, _ in heads)
            deadlines = [d for _, d, _, _ in heads if d is not None]
            slot.head_deadline = min(deadlines) if deadlines else None
        # else: keep what was known (a count with no time yet: read at the next reconcile)

    # --- the I/O ------------------------------------------------------------------------------

    async def refresh(
        self, js: Any, subjects: Subjects, now: float, *, mine: Held, not_ours: Mapping[str, int], mine_bulk: Held = {}
    ) -> bool:
        """Reconcile every queue with one stream-info call (and read a few unknown heads); False
        when JetStream did not answer (the view is kept as it was). ``mine`` and ``mine_bulk``
        (what this worker holds unacked, per model) may be functions, read once the count is
        back: a batch acked while the count was on its way may be gone from it, and subtracted
        again it hid as many waiting requests until the next count. Read after, a batch fetched
        meanwhile is in both (stored until acked), and one acked meanwhile at worst over-counts
        (an empty fetch)."""
        try:
            info = await js.stream_info(subjects.models_stream, subjects_filter=subjects.models_wildcard)
        except TRANSPORT_ERRORS as exc:
            log.debug("stream info for the backlog failed: %r", exc)
            return False
        mine = mine() if callable(mine) else mine
        mine_bulk = mine_bulk() if callable(mine_bulk) else mine_bulk
        counts: dict[str, int] = {}
        bulk: dict[str, int] = {}
        last_seq = getattr(info.state, "last_seq", None)
        last_seq = last_seq if isinstance(last_seq, int) else None
        for subject, n in (getattr(info.state, "subjects", None) or {}).items():
            queue = subjects.queue_from_subject(subject)
            if queue is not None:
                counts[queue[0]] = counts.get(queue[0], 0) + int(n)
                if queue[1] is Priority.BATCH:
                    bulk[queue[0]] = int(n)
        self.unregistered = {name: n for name, n in counts.items() if name not in self._slots}
        self.unregistered_bulk = {name: n for name, n in bulk.items() if name not in self._slots}
        # A model with no messages is absent from the answer: only those we thought non-empty, or
        # that hold something back, need their count set to zero.
        for name in set(counts) | self.waiting | {n for n, s in self._slots.items() if s.unfetchable}:
            slot = self._slots.get(name)
            if slot is not None:
                peers = max(not_ours.get(name, 0), self.peers_hold(name, now))  # adverts lag: events are newer
                self.reconcile(
                    slot, counts.get(name, 0), now, mine=mine.get(name, 0), not_ours=peers, stored_bulk=bulk.get(name, 0),
                    mine_bulk=mine_bulk.get(name, 0), last_seq=last_seq,
                )  # fmt: skip
        reads = [s for s in (self._slots[n] for n in sorted(self.waiting)) if self.needs_head(s)][:MAX_HEAD_READS]
        for slot in reads:
            await self._read_head(js, subjects, slot, now)
        return True

    async def _read_head(self, js: Any, subjects: Subjects, slot: Slot, now: float) -> None:
        """The first stored message of the model's subject: its enqueue time and deadline. It may
        be delivered already (in flight somewhere): an over-estimate of the age, on the safe side."""
        # The line with requests nobody saw arrive (the interactive one when both have some).
        priority = Priority.INTERACTIVE if slot.interactive > len(slot.known_times) else Priority.BATCH
        try:
            raw = await js.get_msg(subjects.models_stream, seq=1, subject=subjects.model(slot.name, priority), next=True)
        except TRANSPORT_ERRORS:
            self.set_unknown_head(slot, now, None)
            return
        headers = getattr(raw, "headers", None)
        try:
            deadline = deadline_from_headers(headers)
        except ProtocolError:
            deadline = None  # a malformed deadline: that request gets bad_request anyway
        ts = getattr(raw, "time", None)
        at = ts.timestamp() if hasattr(ts, "timestamp") else parse_stream_timestamp(str(ts) if ts is not None else None)
        self.set_unknown_head(slot, min(at, now) if at is not None else now, deadline)


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


class ArrivalFeed:
    """The event feed of the queues. ``<prefix>.arrived.>``: each republished request counts into
    its model's queue and wakes the worker. Each line of each served model has its own
    subscription (2000, for 1000 models, cost 33 ms to make and 9 MB), so that the worker can stop listening to a
    line it drains (:meth:`quiet`, :meth:`listen`; ``sidecar/policy/interest.py``), and hears
    nothing of models it does not serve. ``<prefix>.taken.>``: the workers' own events, ``+n`` when
    one fetched n requests of a model and ``-n`` when it settled them (:meth:`took`,
    :meth:`settled`), so its peers' counts follow at once. Hostile input never raises here: an
    unknown model, a malformed timestamp, deadline or count is ignored or read as "now" / "no
    deadline"; a forged take can hide requests from the count until the next reconcile (a
    poll interval) at most. ``audience`` says whether any peer hears the take events now: a
    worker that knows it is alone sends none (two messages a batch the raw loop does not send);
    one that starts beside it misses its takes until it has read the newcomer's advert
    (its first advert goes out after its start-up), an over-count its next count corrects, as for
    any lost event."""

    def __init__(
        self,
        nc: Any,
        subjects: Subjects,
        slots: Mapping[str, Slot],
        view: QueueView,
        on_arrival: Callable[[], None],
        worker_id: str = "",
        counters: Counters | None = None,
        cancelled: Callable[[str | None, str], bool] = lambda tenant, request_id: False,
        audience: Callable[[], bool] = lambda: True,
    ) -> None:
        self._nc = nc
        self._audience = audience
        self._subjects = subjects
        self._slots = slots
        self._view = view
        self._on_arrival = on_arrival
        self._cancelled = cancelled  # whether a cancel notice for (tenant, request id) came already
        self._worker_id = worker_id
        self._subs: dict[tuple[str, bool], Any] = {}  # (model, batch line?) -> its arrivals' subscription
        self._quiet: set[tuple[str, bool]] = set()  # the lines whose arrivals we stopped listening to
        self._taken_sub: Any = None
        self.seen = 0
        self._counters = Counters() if counters is None else counters

    async def start(self) -> None:
        """Subscribe (once: a retried startup calls it again)."""
        for name in self._slots:
            for bulk in (False, True):
                if (name, bulk) not in self._subs and (name, bulk) not in self._quiet:
                    self._subs[(name, bulk)] = await self._subscribe(name, bulk)
        if self._taken_sub is None:
            self._taken_sub = await self._nc.subscribe(self._subjects.taken_wildcard, cb=self._on_taken, pending_msgs_limit=1_000_000)

    async def _subscribe(self, name: str, bulk: bool) -> Any:
        subject = self._subjects.arrived(name, Priority.BATCH if bulk else Priority.INTERACTIVE)
        return await self._nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=1_000_000)

    @property
    def quiet_lines(self) -> frozenset[tuple[str, bool]]:
        """The lines (model, whether the batch one) whose arrivals this worker does not listen to now."""
        return frozenset(self._quiet)

    def is_quiet(self, name: str, *, bulk: bool = False) -> bool:
        """Whether this worker does not listen to the arrivals of that line of ``name`` now."""
        return (name, bulk) in self._quiet

    async def quiet(self, name: str, *, bulk: bool = False) -> bool:
        """Stop listening to the arrivals of one of ``name``'s lines (False, still listening,
        when the connection refused)."""
        line = (name, bulk)
        sub = self._subs.get(line)
        if sub is None:
            return line in self._quiet
        try:
            await sub.unsubscribe()
        except TRANSPORT_ERRORS + (ValueError,) as exc:
            log.debug("arrivals of %s: unsubscribe failed: %r", line, exc)
            return False
        del self._subs[line]
        self._quiet.add(line)
        self._counters.add("arrivals_quiet")
        return True

    async def listen(self, name: str, *, bulk: bool = False) -> bool:
        """Listen to the arrivals of one of ``name``'s lines again (False when the connection
        refused: try again later). The subscription goes out before anything the caller sends
        next on the connection, so a fetch or count sent after this sees every arrival the
        events miss."""
        line = (name, bulk)
        if line not in self._quiet:
            return True
        try:
            self._subs[line] = await self._subscribe(name, bulk)
        except TRANSPORT_ERRORS + (ValueError,) as exc:
            log.debug("arrivals of %s: subscribe failed: %r", line, exc)
            return False
        self._quiet.discard(line)
        return True

    async def stop(self) -> None:
        for sub in (self._taken_sub, *self._subs.values()):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except TRANSPORT_ERRORS + (ValueError,):
                    pass
        self._taken_sub = None
        self._subs.clear()
        self._quiet.clear()

    async def _on_msg(self, msg: Msg) -> None:
        self.note(msg.subject, msg.headers)

    def note(self, subject: str, headers: Mapping[str, str] | None, now: float | None = None) -> None:
        """Count one republished arrival (the subscription's callback, callable from tests)."""
        queue = self._subjects.queue_from_arrival(subject)
        slot = self._slots.get(queue[0]) if queue is not None else None
        if slot is None or queue is None:
            return
        now = time.time() if now is None else now
        headers = headers or {}
        at = parse_stream_timestamp(headers.get("Nats-Time-Stamp"))
        self._arrived(slot, at, headers, queue[1] is Priority.BATCH, parse_stream_sequence(headers.get("Nats-Sequence")), now)
        self.seen += 1
        if at is not None and 0 <= now - at < 60:  # a forged or far-off timestamp measures nothing
            self._counters.sample("arrival_delay", now - at)
        self._on_arrival()

    def missed(self, slot: Slot, msg: Msg, *, bulk: bool, now: float | None = None) -> None:
        """Count a delivery to this worker's puller that a count of its line missed, as its
        arrival event would have been counted (``Puller.watch``: delivered before the count was
        taken, it reached the puller after the count's answer; stored while the worker did not
        listen, it had no event). Its ack subject says when it was stored, and where."""
        now = time.time() if now is None else now
        info = ack_info(msg)
        self._arrived(slot, None if info is None else info.stored_at_s, msg.headers or {}, bulk, None if info is None else info.stream_seq, now)
        self._counters.add("arrivals_missed_by_counts")
        self._on_arrival()

    def _arrived(self, slot: Slot, at: float | None, headers: Mapping[str, str], bulk: bool, seq: int | None, now: float) -> None:
        try:
            deadline = deadline_from_headers(headers)
        except ProtocolError:
            deadline = None
        key = _request_key(headers)
        self._view.arrived(slot, min(at, now) if at is not None else now, deadline, bulk=bulk, key=key, seq=seq)
        if key is not None and self._cancelled(key[0] or None, key[1]):
            # Its cancel came before this event (a tenant's request goes through the classifier,
            # the notice straight to the workers): counted as cancelled at once.
            self._view.cancel(key)


    async def took(self, name: str, n: int) -> None:
        """Tell the peers this worker fetched ``n`` requests of ``name`` (best effort: a lost
        event costs a peer one poll interval of a stale count, as before events)."""
        await self._announce(name, f"+{n}")

    async def settled(self, name: str, n: int) -> None:
        """Tell the peers this worker settled (acked, nak'd or termed) ``n`` requests it took."""
        await self._announce(name, f"-{n}")

    async def _announce(self, name: str, text: str) -> None:
        if self._nc is None or not self._worker_id or not self._audience():
            return
        try:
            await self._nc.publish(self._subjects.taken(name), text.encode(), headers={WORKER_HEADER: self._worker_id})
        except TRANSPORT_ERRORS + (ValueError,) as exc:
            log.debug("take event for %s not sent: %r", name, exc)

    async def _on_taken(self, msg: Msg) -> None:
        self.note_taken(msg.subject, msg.headers, msg.data)

    def note_taken(self, subject: str, headers: Mapping[str, str] | None, data: bytes, now: float | None = None) -> None:
        """Apply one peer's take or settle event (the subscription's callback, callable from tests)."""
        slot = self._slots.get(self._subjects.model_from_taken(subject) or "")
        peer = (headers or {}).get(WORKER_HEADER, "")
        if slot is None or not peer or len(peer) > _MAX_PEER_ID_CHARS or peer == self._worker_id:
            return  # ours (counted when fetched), or not a worker's
        if not 2 <= len(data) <= _MAX_TAKE_CHARS or data[:1] not in (b"+", b"-") or not data[1:].isdigit():
            return
        n = int(data[1:])
        if not 0 < n <= MAX_PEER_HELD:
            return
        now = time.time() if now is None else now
        if data[:1] == b"+":
            self._view.peer_took(slot, peer, n, now)
        else:
            self._view.peer_settled(slot.name, peer, n, now)
