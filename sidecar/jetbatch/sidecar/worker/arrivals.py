"""The queues' event feed: each request the models stream stores is republished to its model's
arrival subject and counted here into its queue; workers announce what they take and settle so
their peers' counts follow at once. Hostile input never raises here (see :class:`ArrivalFeed`)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from nats.aio.msg import Msg

from jetbatch.sdk.protocol import Priority, ProtocolError, Subjects, deadline_from_headers

from ..config import NatsConfig
from ..errors import TRANSPORT_ERRORS, unsubscribe_all
from .control import ControlConnection
from .counters import Counters
from .late_arrivals import LateArrivals
from .queues import MAX_PEER_HELD, QueueView
from .slots import Slot, ack_info
from .stream_facts import parse_stream_sequence, parse_stream_timestamp, request_key

__all__ = ["EVENTS_READ_PER_S", "WORKER_HEADER", "ArrivalFeed"]

log = logging.getLogger("jetbatch.worker")

_MAX_TAKE_CHARS = 8
_MAX_PEER_ID_CHARS = 128
WORKER_HEADER = "Jetbatch-Worker"
# Events a second the worker reads (arrivals and takes together): ten times what a worker that
# serves a thousand requests a second hears. Beyond, they wait at the server, which cuts the
# events' connection alone; each cut costs a count (``on_lost``).
EVENTS_READ_PER_S = 20_000.0
# Events waiting for their callback; beyond, nats-py drops them (counted: ``events_dropped``).
_PENDING_EVENTS = 65_536
# How long a re-listened line waits for the server to confirm its subscription before the count.
_FLUSH_TIMEOUT_S = 1.0


class ArrivalFeed:
    """The event feed of the queues. ``<prefix>.arrived.>``: each republished request counts into
    its model's queue and wakes the worker. Each line of each served model has its own
    subscription (2000, for 1000 models, cost 33 ms to make and 9 MB), so that the worker can stop listening to a
    line it drains (:meth:`quiet`, :meth:`listen`; ``sidecar/policy/interest.py``), and hears
    nothing of models it does not serve. ``<prefix>.taken.>``: the workers' own events, ``+n`` when
    one fetched n requests of a model and ``-n`` when it settled them (:meth:`took`,
    :meth:`settled`), so its peers' counts follow at once. Hostile input never raises here: an
    unknown model, a malformed timestamp, deadline or count is ignored or read as "now" / "no
    deadline". Both kinds are hints, checked against the stream before they cost more than a
    look: a load is paid only for what the stream stores (``Lines.look``; a model found empty
    is doubted, its events not counted until a count shows it non-empty), and takes that bring
    a model's count to zero while the stream stores some of it are checked against its
    consumers (``Lines.check_takes``). ``audience`` says whether any peer hears the take events now: a
    worker that knows it is alone sends none (two messages a batch the raw loop does not send);
    one that starts beside it misses its takes until it has read the newcomer's advert
    (its first advert goes out after its start-up), an over-count its next count corrects, as for
    any lost event. The same rule holds for the events heard: a worker with no peer in view
    ignores every take event (``takes_unheard``), so a forged one cannot hide a lone worker's
    requests; with peers in view, the check of the consumers bounds what one hides.

    Both are read on a connection of their own (``worker/control.py``), never the one that carries
    the pulls and acks: on a server where anyone may publish them, a flood of forged events at
    full speed had nats-server cut the data connection as a slow consumer. The connection is
    read at most :data:`EVENTS_READ_PER_S` events a second; what a flood drops is corrected by
    the next count, asked at once after a cut (``on_lost``). An event may therefore land after a
    count that holds its request: one stored at a sequence a count since includes is not counted
    again (``stream_facts.CountedThrough``)."""

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
        nats: NatsConfig | None = None,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self._nc = nc  # where the take events are published, and where the events' connection goes
        # ``nc`` only tells where to connect: the events never share its connection.
        self._events = None if nc is None else ControlConnection(
            nc, nats or NatsConfig(), read_per_s=EVENTS_READ_PER_S, counters=counters if counters is not None else Counters(),
            what="events", name="jetbatch-worker-events", on_reconnected=on_lost,
        )  # fmt: skip
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
        # Refusals at arrival (late_arrivals.py); it screens a quiet interactive line itself.
        self.late = LateArrivals(
            nc, subjects, self._counters, lambda name: self._slots[name].config.max_batch_size, listen=lambda: self.connection,
        )  # fmt: skip

    @property
    def connection(self) -> Any:
        """The connection the events are read on (None before :meth:`start`, and without ``nc``)."""
        return None if self._events is None else self._events.nc

    async def start(self) -> None:
        """Connect and subscribe (once: a retried startup calls it again). The server has every
        subscription when this returns: a count asked next sees what the events miss."""
        if self._events is None:
            return
        await self._events.open()
        for name in self._slots:
            for bulk in (False, True):
                if (name, bulk) not in self._subs and (name, bulk) not in self._quiet:
                    self._subs[(name, bulk)] = await self._subscribe(name, bulk)
        await self.follow_takes()
        await self.late.start()
        assert self._events.nc is not None
        await self._events.nc.flush(timeout=_FLUSH_TIMEOUT_S)

    @property
    def listening_to_takes(self) -> bool:
        """Whether this worker subscribes to its peers' take events now (:meth:`follow_takes`)."""
        return self._taken_sub is not None

    async def follow_takes(self) -> None:
        """Subscribe to the take events while a peer is in view (``audience``), and only then:
        a worker alone ignores them (:meth:`note_taken`), and a flood of forged ones at full speed
        on an open server, read on the data connection, had nats-server cut it as a slow consumer.
        A peer's takes sent before this worker subscribed are missed, an over-count its next
        count corrects, as for any lost event."""
        events = self.connection
        if events is None:
            return
        wanted = self._audience()
        try:
            if wanted and self._taken_sub is None:
                self._taken_sub = await events.subscribe(self._subjects.taken_wildcard, cb=self._on_taken, pending_msgs_limit=_PENDING_EVENTS)
                await events.flush(timeout=_FLUSH_TIMEOUT_S)  # the peers' next takes are heard
            elif not wanted and self._taken_sub is not None:
                sub, self._taken_sub = self._taken_sub, None
                await sub.unsubscribe()
        except TRANSPORT_ERRORS + (ValueError,) as exc:
            log.debug("take events: (un)subscribe failed: %r", exc)

    async def _subscribe(self, name: str, bulk: bool) -> Any:
        subject = self._subjects.arrived(name, Priority.BATCH if bulk else Priority.INTERACTIVE)
        assert self._events is not None and self._events.nc is not None, "start() first"
        return await self._events.nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=_PENDING_EVENTS)

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
        if not bulk:
            await self.late.follow(name)  # before the unsubscribe: no arrival goes unscreened between
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
        refused: try again later). The server holds the subscription when this returns (a flush
        of the events' connection), so a fetch or count sent next on the data connection sees
        every arrival the events miss."""
        line = (name, bulk)
        if line not in self._quiet:
            return True
        events = self.connection
        if events is None:
            return False  # not started
        try:
            sub = await self._subscribe(name, bulk)
        except TRANSPORT_ERRORS + (ValueError,) as exc:
            log.debug("arrivals of %s: subscribe failed: %r", line, exc)
            return False
        try:
            await events.flush(timeout=_FLUSH_TIMEOUT_S)
        except TRANSPORT_ERRORS + (ValueError,) as exc:
            # Not confirmed in time (a flood ahead of the answer): quiet still, tried again later.
            log.debug("arrivals of %s: subscription not confirmed: %r", line, exc)
            await unsubscribe_all(sub)
            return False
        self._subs[line] = sub
        self._quiet.discard(line)
        if not bulk:
            await self.late.unfollow(name)  # after the subscribe: the screen skips what both heard
        return True

    async def stop(self) -> None:
        await unsubscribe_all(self._taken_sub, *self._subs.values())
        self._taken_sub = None
        await self.late.stop()
        self._subs.clear()
        self._quiet.clear()
        if self._events is not None:
            await self._events.close()

    async def _on_msg(self, msg: Msg) -> None:
        if not self._refused(msg.subject, msg.headers):
            self.note(msg.subject, msg.headers)

    def _refused(self, subject: str, headers: Mapping[str, str] | None) -> bool:
        """Whether an interactive arrival is refused at once because its model's workers cannot
        reach it before its deadline (worker/late_arrivals.py): answered and deleted from the
        stream, it is not counted (a failed delete leaves it to the next count)."""
        queue = self._subjects.queue_from_arrival(subject)
        slot = self._slots.get(queue[0]) if queue is not None else None
        if slot is None or queue is None or slot.doubted or queue[1] is Priority.BATCH:
            return False
        return self.late.screen(slot.name, headers)

    def note(self, subject: str, headers: Mapping[str, str] | None, now: float | None = None) -> None:
        """Count one republished arrival (the subscription's callback, callable from tests)."""
        queue = self._subjects.queue_from_arrival(subject)
        slot = self._slots.get(queue[0]) if queue is not None else None
        if slot is None or queue is None:
            return
        if slot.doubted:
            self._counters.add("arrivals_doubted")  # the stream's count will show a real one
            return
        now = time.time() if now is None else now
        headers = headers or {}
        bulk = queue[1] is Priority.BATCH
        seq = parse_stream_sequence(headers.get("Nats-Sequence"))
        if self._view.count_seqs.covers(slot.name, bulk, seq):
            self._counters.add("arrivals_counted_already")
            return
        at = parse_stream_timestamp(headers.get("Nats-Time-Stamp"))
        self._arrived(slot, at, headers, bulk, seq, now)
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
        key = request_key(headers)
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
        if not self._audience():
            # No peer in view (coordination on): no worker we know sent it, and a peer's takes
            # start once it has advertised (as ours do), so it is forged or early. Counted, it hid
            # a lone worker's requests until a check of its consumers, once per flood message.
            self._counters.add("takes_unheard")
            return
        now = time.time() if now is None else now
        if data[:1] == b"+":
            self._view.peer_took(slot, peer, n, now)
        else:
            self._view.peer_settled(slot.name, peer, n, now)
