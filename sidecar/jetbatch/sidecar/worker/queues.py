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

- **Events are hints.** Anyone who may publish on their subjects can forge them: a load is paid
  only for what the stream stores, and takes that hide all of a stored queue are checked against
  its consumers (``worker/lines.py``). The rules are Slot bookkeeping, apart from the I/O.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from jetbatch.sdk.protocol import Priority, Subjects

from .slots import Slot
from .stream_facts import CountedThrough, LineStored, stored_after, unheld
from .takes import MAX_PEER_HELD, MAX_PEERS_A_MODEL, PeerTakes

__all__ = ["MAX_PEERS_A_MODEL", "MAX_PEER_HELD", "RECHECK_S", "QueueView"]

log = logging.getLogger("jetbatch.worker")

# Enqueue times kept per queue: enough for the cluster share's "age of the part that is ours"
# (the newest k requests) at any realistic backlog; beyond, the oldest known time stands in.
MAX_KNOWN_TIMES = 4096
# Heads read by direct get per reconcile (after a start or a reconnect many can be unknown).
MAX_HEAD_READS = 16
# How soon a queue held back past its stranded requests' ack wait is tried again.
RECHECK_S = 1.0


class QueueView:
    """The backlog and head of every served model's queue (fields of each :class:`Slot`).

    ``peer_event_s``: how long a peer's take event counts its requests as the peer's (until it
    settles them, or its advert, sent every heartbeat, says what it holds)."""

    def __init__(self, slots: Mapping[str, Slot], *, peer_event_s: float = 2.0) -> None:
        self._slots = slots
        # Known waiting requests by (tenant, request id): where a cancel notice finds its queue.
        self._where: dict[tuple[str, str], str] = {}
        # Of those, how many each tenant has waiting ("" for none): what the advert tells the
        # classifier's tenant quotas (tenancy.py).
        self.tenant_waiting: dict[str, int] = {}
        # Lines (model, bulk) whose known arrivals are not all in increasing sequence (a forged or
        # unsequenced event among them): how many were counted since the last out of order (once
        # that one has left the line, taken or beyond what is kept, it is in order again).
        self._unordered: dict[tuple[str, bool], int] = {}
        self.waiting: set[str] = {name for name, s in slots.items() if s.backlog > 0}
        # Models holding requests back as unfetchable (``Slot.unfetchable``, set only here): what a
        # count and the report walk besides the waiting ones, not every registered model.
        self.holding_back: set[str] = {name for name, s in slots.items() if s.unfetchable}
        self.takes = PeerTakes(peer_event_s)
        self.hidden_by_takes: list[str] = []  # models the last count found stored, at zero by take events alone
        # Requests stored for models no worker here registers, per model, at the last count (orphans.py).
        self.unregistered: dict[str, int] = {}
        self.unregistered_bulk: dict[str, int] = {}  # of those, in the batch line
        # Arrival events are read on a connection of their own (worker/arrivals.py): one may land
        # after a count that already holds its request.
        self.count_seqs = CountedThrough()

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
            self.tenant_waiting[key[0]] = self.tenant_waiting.get(key[0], 0) + 1
        if len(known) > MAX_KNOWN_TIMES:
            dropped = self._drop_oldest(slot, known)
            slot.unknown_head_at = dropped if slot.unknown_head_at is None else min(slot.unknown_head_at, dropped)
        if slot.backlog == 1 or slot.oldest_enqueued_at is None:
            self._set_head(slot)
        self.waiting.add(slot.name)

    def stored_after(self, slot: Slot, bulk: bool, seq: int | None) -> int:
        known = slot.known_bulk if bulk else slot.known_times
        line = (slot.name, bulk)
        since = self._unordered.get(line)
        if since is not None and len(known) <= since:
            del self._unordered[line]  # what is left all came after the last one out of order
            since = None
        return stored_after(known, seq, ordered=since is None)

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
            left = self.tenant_waiting.get(key[0], 0) - 1
            if left > 0:
                self.tenant_waiting[key[0]] = left
            else:
                self.tenant_waiting.pop(key[0], None)
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
            left = max(pending, self.stored_after(slot, bulk, last_seq))
            if redelivered:
                left = max(left, line - n)
            else:
                self.count_seqs.line(slot.name, bulk, last_seq)
        self._count_line(slot, left, bulk=bulk)

    def peer_took(self, slot: Slot, peer: str, n: int, now: float) -> None:
        """A peer fetched ``n`` of the queue's requests (its take event, ``PeerTakes.took``):
        they leave this worker's backlog now, the oldest first (a consumer delivers in order)."""
        if self.takes.took(slot.name, peer, n, now):
            # Peers pull the interactive line first, as we do.
            self._count(slot, slot.backlog - n, bulk=slot.bulk - max(0, n - slot.interactive))

    def peer_settled(self, name: str, peer: str, n: int, now: float) -> None:
        """A peer answered (or gave back) ``n`` requests it took."""
        self.takes.settled(name, peer, n, now)

    def forget_peers(self, peers: list[str]) -> None:
        """Peers that left, or whose process was replaced (``PeerTakes.forget``)."""
        self.takes.forget(peers)

    def peers_hold(self, name: str, now: float) -> int:
        """What peers said they took from ``name``'s queue and have not settled (recent events)."""
        return self.takes.hold(name, now)

    @property
    def peer_event_s(self) -> float:
        return self.takes.peer_event_s

    def refuted(self, slot: Slot) -> None:
        """A look at the stream found nothing of ``slot``'s queue a load could be for
        (``Lines.look``): its count is zero, and its arrival events are not counted until a count
        shows the stream storing some of it (:meth:`reconcile`, :meth:`undelivered`)."""
        self._count(slot, 0, bulk=0)
        slot.doubted = True

    def undelivered(self, slot: Slot, pending: int, *, bulk: bool) -> None:
        """A line's consumer has ``pending`` requests it delivered to nobody: no peer's take
        holds them, so the line waits at least that many (``Lines.check_takes``)."""
        if pending > (slot.bulk if bulk else slot.interactive):
            self._count_line(slot, pending, bulk=bulk)
        slot.doubted = slot.doubted and pending == 0

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
            self._hold_back(slot, slot.backlog)
            slot.hold_until = math.inf
        elif slot.backlog > 0 and now >= slot.hold_until:
            self._hold_back(slot, slot.backlog)
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
        self._hold_back(slot, 0)
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
            after = self.stored_after(slot, bulk, stored.last_seq)
            waiting = max(waiting, max(0, stored.messages - unacked) + missed + after)
            self.count_seqs.line(slot.name, bulk, stored.last_seq)
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
        slot.doubted = slot.doubted and stored <= mine  # the stream stores some: its arrival events count again
        slot.stranded = max(0, available - slot.known)  # an upper bound: arrivals not seen
        if slot.stranded == 0:
            slot.stranded_since = None
        elif slot.stranded_since is None:
            slot.stranded_since = now
        if now >= slot.hold_until:
            self._hold_back(slot, 0)
        # Held-back messages leave the count as they are acked or redelivered to someone; the
        # arrivals seen since the hold are never among them (found_empty forgot the older ones).
        self._hold_back(slot, min(slot.unfetchable, max(0, available - slot.known)))
        # Which line the peers' share comes from is not told: count it against the batch line
        # first, so interactive requests are never hidden behind batch ones a peer holds (at
        # worst interactive work is over-counted until the next count, and visited sooner).
        waiting = available - slot.unfetchable
        interactive = min(max(0, (stored - stored_bulk) - (mine - mine_bulk)), max(0, waiting))
        bulk = max(0, waiting - interactive)
        interactive = max(interactive, self.stored_after(slot, False, last_seq))
        bulk = max(bulk, self.stored_after(slot, True, last_seq))
        self._count(slot, interactive + bulk, bulk=bulk)

    def _hold_back(self, slot: Slot, n: int) -> None:
        """``n`` of ``slot``'s requests are held back as unfetchable (0: none)."""
        slot.unfetchable = n
        if n:
            self.holding_back.add(slot.name)
        else:
            self.holding_back.discard(slot.name)

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

    def counted(
        self, stored: Mapping[str, int], last_seq: int | None, now: float, *, subjects: Subjects, mine: Mapping[str, int], not_ours: Mapping[str, int],
        mine_bulk: Mapping[str, int],
    ) -> list[Slot]:
        """Reconcile every queue with the models stream's count per subject (``stored``, one
        stream-info answer: ``worker/counting.py``); the waiting queues whose head nobody saw
        arrive, a few, to be read by direct get (:meth:`set_unknown_head`)."""
        counts: dict[str, int] = {}
        bulk: dict[str, int] = {}
        for subject, n in stored.items():
            queue = subjects.queue_from_subject(subject)
            if queue is not None:
                counts[queue[0]] = counts.get(queue[0], 0) + int(n)
                if queue[1] is Priority.BATCH:
                    bulk[queue[0]] = int(n)
        self.count_seqs.whole(last_seq)
        self.unregistered = {name: n for name, n in counts.items() if name not in self._slots}
        self.unregistered_bulk = {name: n for name, n in bulk.items() if name not in self._slots}
        # A model with no messages is absent from the answer: only those thought non-empty, or holding some back, are set to zero.
        self.hidden_by_takes = []
        for name in set(counts) | self.waiting | self.holding_back:
            slot = self._slots.get(name)
            if slot is not None:
                peers = max(not_ours.get(name, 0), self.peers_hold(name, now))  # adverts lag: events are newer
                self.reconcile(
                    slot, counts.get(name, 0), now, mine=mine.get(name, 0), not_ours=peers, stored_bulk=bulk.get(name, 0),
                    mine_bulk=mine_bulk.get(name, 0), last_seq=last_seq,
                )  # fmt: skip
                if slot.backlog == 0 and unheld(counts.get(name, 0), mine.get(name, 0), not_ours.get(name, 0)):
                    self.hidden_by_takes.append(name)  # a peer's take may be forged: its consumers tell (Lines.check_takes)
        return [s for s in (self._slots[n] for n in sorted(self.waiting)) if self.needs_head(s)][:MAX_HEAD_READS]
