"""Listening to and counting a worker's lines: which arrival events it listens to
(``policy/interest.py``), the bulk count of every queue and a line's count when it is listened
to again, what an empty fetch means, and requests handed back to the queue. The I/O behind the
facts a core's turn is told (``core/events.py: Turn``)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterable

from jetbatch.sdk.protocol import Priority, Subjects

from ..config import Config
from ..core import WorkerCore
from ..errors import TRANSPORT_ERRORS
from ..policy import listens
from ..streams import model_consumer_name
from .coordination import Coordinator
from .counting import StreamCounts, count_queues
from .counters import Counters
from .orphan_answers import OrphanAnswers
from .pullers import Pullers
from .arrivals import ArrivalFeed
from .queues import RECHECK_S, QueueView
from .stream_facts import empty_fetch, line_stored, missed_by, unheld
from .slots import Slot
from .state import LoopState

__all__ = ["Lines"]

log = logging.getLogger("jetbatch.worker")

# A count for requests given back with a delay is taken this long after they fall due (the server
# redelivers on its own timer): counted before, a fetch would miss them and hold the queue back
# for a recheck.
_DUE_MARGIN_S = 0.05
# Models whose take events are checked against their consumers per count (``Lines.check_takes``).
_MAX_TAKE_CHECKS = 16


class Lines:
    """What the worker knows of its queues, kept true by listening and counting."""

    def __init__(
        self, config: Config, js: Any, *, slots: dict[str, Slot], core: WorkerCore, queues: QueueView, arrivals: ArrivalFeed, pullers: Pullers,
        peers: Coordinator, state: LoopState, stats: Counters, orphans: OrphanAnswers, note_trouble: Callable[[], None],
        counts: StreamCounts | None = None,
    ) -> None:
        self.config = config
        self.js = js
        self.counts: Any = js if counts is None else counts  # stream infos for counts (counting.StreamCounts)
        self.subjects: Subjects = config.subjects
        self.slots = slots
        self.core = core
        self.queues = queues
        self.arrivals = arrivals
        self.pullers = pullers
        self.peers = peers
        self.state = state
        self.stats = stats
        self.orphans = orphans
        self._note_trouble = note_trouble
        self._takes_checked: dict[str, float] = {}  # model -> when its take events were last checked

    async def refresh(self, now: float) -> None:
        """Count every queue (one call), then schedule the next count: every poll interval while
        anything waits or runs, every ``idle_refresh_s`` otherwise (arrivals are events)."""
        not_ours = self.peers.not_ours(now)
        ok = await count_queues(
            self.queues, self.js, self.subjects, now, not_ours=not_ours,
            mine=lambda: self.state.in_flight.by_model(self.subjects.model_from_subject),
            mine_bulk=lambda: self.state.in_flight.by_model(self._bulk_model), counts=self.counts,
        )  # fmt: skip
        await self.hand_back_leftovers()
        if ok and self.queues.unregistered:
            # A model no worker ever registered is answered at once; not one a live peer is known
            # to register (a registry emptied by hand).
            self.orphans.check_registry((self.peers.registered_by_peers(now) if self.peers.knows_peers(now) else None) or set())
        if ok and (self.queues.unregistered or self.orphans.watched) and self.peers.knows_peers(now):
            # Only when something is stored for a model this worker does not register (rare):
            # the peers' model sets are not gathered on every count. And only with a fresh view
            # of the peers: without one (coordination off, the bucket silent) a live peer's
            # models would look unregistered; nor while a live peer's set is not known.
            peers = self.peers.registered_by_peers(now)
            if peers is not None:
                self.orphans.check(now, set(self.slots) | peers)
        busy = bool(self.queues.waiting) or bool(self.state.in_flight)
        poll_s = self.config.worker.poll_interval_ms / 1000.0
        self.state.next_refresh = time.time() + (poll_s if busy else max(poll_s, self.config.worker.idle_refresh_s))
        self.state.counted(now)
        if self.peers.held_back(now):
            # A peer's hold-back of unfetchable requests takes them out of this count until its
            # recheck (a second for a model on its device), and no event says when it ends:
            # with both holding back each other's view, a dead worker's requests waited for the
            # periodic count (a minute in the attack's config).
            self.state.count_at(now + RECHECK_S)
        if not ok:
            self._note_trouble()
            self.state.next_refresh = time.time() + poll_s
        elif self.queues.hidden_by_takes:
            await self.check_takes()  # last: the turn after this count reads its correction

    async def look(self, slot: Slot) -> bool:
        """Before a load is paid for ``slot``'s backlog: whether the stream stores requests of it
        beyond what this worker and its peers' adverts hold (a stream count of the interactive
        line, and of the batch line when that finds none). The backlog came from arrival events,
        which anyone who may publish on their subjects can forge: a load they alone ask for is
        not paid; the model's count is set to zero and its events doubted (``QueueView.refuted``)."""
        now = time.time()
        mine = self.state.in_flight.by_model(self.subjects.model_from_subject).get(slot.name, 0)
        advertised = self.peers.not_ours(now).get(slot.name, 0)
        stored = 0
        self.stats.add("load_looks")
        try:
            for priority in (Priority.INTERACTIVE, Priority.BATCH):
                subject = self.subjects.model(slot.name, priority)
                stored += line_stored(await self.counts.stream_info(self.subjects.models_stream, subjects_filter=subject), subject).messages
                if unheld(stored, mine, advertised):
                    return True
        except TRANSPORT_ERRORS as exc:
            log.debug("look at %s before its load failed: %r", slot.name, exc)
            self._note_trouble()  # no load on a count we do not have: the next turn decides again
            return False
        self.stats.add("loads_refuted")
        self.queues.refuted(slot)
        return False

    async def check_takes(self) -> None:
        """Take events brought these models' counts to zero although the stream stores requests of
        them beyond what this worker and its peers' adverts hold (``QueueView.hidden_by_takes``):
        a forged take looks like a real one its sender has not advertised yet. Each line's
        consumer says how many it delivered to nobody, which no take can hold. A model at most
        once a ``RECHECK_S`` and a few a count; the view is corrected once every answer is in."""
        now = time.time()
        due = [n for n in self.queues.hidden_by_takes if now - self._takes_checked.get(n, -math.inf) >= RECHECK_S][:_MAX_TAKE_CHECKS]
        found: list[tuple[Slot, int, bool]] = []
        for name in due:
            self._takes_checked[name] = now
            slot = self.slots[name]
            for priority in (Priority.INTERACTIVE, Priority.BATCH) if slot.lines.bulk_consumer_ready_at is not None else (Priority.INTERACTIVE,):
                try:
                    info = await self.js.consumer_info(self.subjects.models_stream, model_consumer_name(name, priority))
                except TRANSPORT_ERRORS as exc:
                    log.debug("check of the takes of %s failed: %r", name, exc)
                    continue
                found.append((slot, int(info.num_pending or 0), priority is Priority.BATCH))
        for slot, pending, bulk in found:
            if pending:
                self.stats.add("takes_refuted")
            self.queues.undelivered(slot, pending, bulk=bulk)

    async def follow_arrivals(self, *, leaving: bool = False) -> None:
        """Listen to the arrivals of a line of the model this worker drains only while it needs
        them (``policy/interest.py``): not the interactive line of the model whose batches it
        serves (they fill from held pulls), nor a deep line (each fetch counts it). ``leaving``:
        the worker is about to load, or to idle, and drains nothing meanwhile."""
        await self.arrivals.follow_takes()  # the peers' take events, while a peer is in view
        current = None if leaving else self.core.current
        serving = None if leaving else self.core.serving
        for name, bulk in self.arrivals.quiet_lines:
            slot = self.slots[name]
            draining = name == current and slot.resident
            waiting = slot.bulk if bulk else slot.interactive
            filled = not bulk and name == serving
            if listens(listening=False, draining=draining, waiting=waiting, max_batch_size=slot.config.max_batch_size, filled=filled):
                counted = slot.arrivals
                if await self.arrivals.listen(name, bulk=bulk):
                    self.queues.listened_again(slot)
                    await self._count_line(slot, bulk, counted)
        if current is not None and self.slots[current].resident:
            slot = self.slots[current]
            quiet = self.arrivals.quiet_lines
            for bulk, waiting in ((False, slot.interactive), (True, slot.bulk)):
                if (current, bulk) not in quiet and not listens(
                    listening=True, draining=True, waiting=waiting, max_batch_size=slot.config.max_batch_size,
                    filled=not bulk and current == serving,
                ):  # fmt: skip
                    await self.arrivals.quiet(current, bulk=bulk)

    async def _count_line(self, slot: Slot, bulk: bool, counted: int) -> None:
        """Count a line listened to again: requests stored since its last fetch are in no count
        yet (and peers' takes may have brought it down to zero meanwhile). Asked after the
        subscription went out (the same connection), so each arrival is evented or stored by
        then: the stream's count of the line's subject, then its consumer's (undelivered and
        unacked), read together by ``QueueView.line_counted``, with the arrivals counted since
        ``counted`` as a floor (one evented before the answer is read). The consumer's count
        alone lags the store (a request stored just before the subscription reached the server
        was in neither it nor an event), and the stream count alone would subtract what this
        worker holds (a batch acked but not yet settled here counted too few)."""
        priority = Priority.BATCH if bulk else Priority.INTERACTIVE
        name = model_consumer_name(slot.name, priority)
        subject = self.subjects.model(slot.name, priority)
        psub = slot.bulk_psub if bulk else slot.psub
        # What the count costs the loop (the simulator charges it: Control.count_line_s).
        started = time.perf_counter()
        try:
            # The stream first: acks between the two answers then over-count (an empty fetch),
            # never under-count.
            stored = line_stored(await self.counts.stream_info(self.subjects.models_stream, subjects_filter=subject), subject)
            info = await self.js.consumer_info(self.subjects.models_stream, name)
        except TRANSPORT_ERRORS as exc:
            log.debug("count of line %s failed: %r", name, exc)
            self.state.next_refresh = -math.inf  # the stream count, at once
            return
        self.stats.sample("count_line", time.perf_counter() - started)
        # A held pull can still be open at the server: a hold's, or a fill's until it filled or
        # up to ``max_delay`` and a millisecond past its window (``Puller.fill(open_s=)``). What
        # it delivered before the count was taken is not undelivered there, and may reach the
        # puller after the count's answer, with no event (found by an attack: a request waited
        # for the periodic count). Those in the puller now are added, and those still on their
        # way are counted as they land (``Puller.watch``; the count used to wait for every
        # such request to end, up to a hold and a window), as are redeliveries until those
        # requests end. What it delivers later for the first time was undelivered at the
        # count, and is in it.
        missed = psub.watch(*missed_by(info)) if psub is not None else 0
        self.queues.line_counted(
            slot, int(info.num_pending or 0), slot.arrivals - counted, bulk=bulk, stored=stored,
            unacked=int(info.num_ack_pending or 0), missed=missed,
        )  # fmt: skip

    @staticmethod
    def fetched_some(slot: Slot) -> None:
        """A fetch of ``slot`` brought requests (or a load made it new): an empty fetch after it is
        a first miss again, not a second in a row."""
        slot.fetches.missed = False

    async def found_nothing(self, slot: Slot) -> None:
        """A fetch came back empty although the count said requests wait. One consumer-info call
        per line tells why (``queues.empty_fetch``): still undelivered: count those and serve
        again; delivered to someone and unacked, or missed twice: stop chasing them until a
        recheck, and tell peers not to either (``QueueView.found_empty``); neither, yet still
        stored after a fresh count and a second miss on it: left behind in the work queue, never
        to be delivered."""
        if slot.backlog <= 0:
            return
        pending = ack_pending = 0
        lines = [Priority.INTERACTIVE] + ([Priority.BATCH] if slot.bulk_psub is not None else [])
        try:
            for line in lines:
                info = await self.js.consumer_info(self.subjects.models_stream, model_consumer_name(slot.name, line))
                if info.num_pending and not slot.fetches.missed:
                    self.queues.fetched(slot, 0, int(info.num_pending), bulk=line is Priority.BATCH)
                pending += int(info.num_pending or 0)
                ack_pending += int(info.num_ack_pending or 0)
        except TRANSPORT_ERRORS:
            self.held_back(slot)
            return
        # In our own puller: delivered after the fetch returned (its pull request ended late: a
        # busy host), so counted as unacked elsewhere. Held back as a peer's, they waited a whole
        # recheck (1.6 s in bench.overhead.in_process's classified runs).
        in_our_puller = any(p is not None and p.buffered for p in (slot.psub, slot.bulk_psub))
        why = empty_fetch(pending=pending, ack_pending=ack_pending, missed_before=slot.fetches.missed, in_our_puller=in_our_puller)
        now = time.time()
        if why == "fetch again":
            slot.fetches.missed = True
        elif why == "in our puller":
            return
        elif why == "unreachable" and now - slot.fetches.unreachable_seen_at > RECHECK_S:
            # Held back for good only if the stream still stores them and a fetch on that count
            # misses them again: the count itself may be what is wrong (arrival and take events
            # applied out of order after a paused process counted 60 requests that were never
            # there, and the hold was advertised to peers).
            slot.fetches.unreachable_seen_at = now
            await self.refresh(now)
        else:
            if why == "unreachable" and now - slot.fetches.unreachable_warned_at > 60.0:
                # Once a minute a model at most: forged arrival events can bring this on at will.
                slot.fetches.unreachable_warned_at = now
                log.warning("%s: %d requests stored that its consumer will never deliver: not counted until they are gone", slot.name, slot.backlog)
            self.held_back(slot, unreachable=why == "unreachable")

    def held_back(self, slot: Slot, *, unreachable: bool = False) -> None:
        """Hold back what a fetch could not get (``QueueView.found_empty``), and count again when
        the hold ends: a redelivery brings no arrival event, and the next count on the schedule
        may be a poll interval (or a minute) away."""
        self.queues.found_empty(slot, time.time(), self.config.streams.ack_wait_s, unreachable=unreachable)
        if math.isfinite(slot.hold_until) and slot.hold_until > time.time():
            self.state.count_at(slot.hold_until)

    def given_back(self, delay_s: float) -> None:
        """Requests were given back (nak) to be delivered again after ``delay_s``: no arrival event
        says so, and the next count on the schedule may be a poll interval (or a minute) away,
        so count just after they fall due."""
        self.stats.add("given_back")
        self.state.count_at(time.time() + delay_s + _DUE_MARGIN_S)

    async def hand_back_leftovers(self, leaving: Iterable[str] | None = None) -> None:
        """Requests delivered to a pull after its fetch returned wait in that model's puller for
        its next fetch, which a model no longer resident here may not get: they go back to the
        queue (nak) for whoever serves it now, not after their ack wait. ``leaving``: only these
        models', resident or not (a load's victims, before it starts: a held pull's last
        delivery can come a millisecond after its window closed, ``Puller.fill``)."""
        if leaving is None:
            # Only the slots whose pullers hold something (``Pullers.holding``): a walk over every
            # registered model at each count was a quarter of a 10 000-model worker's samples.
            await self.pullers.hand_back(slot for slot in self.pullers.holding() if not slot.resident)
        else:
            await self.pullers.hand_back(self.slots[n] for n in leaving)

    def _bulk_model(self, subject: str) -> str | None:
        """The model of a batch-line subject (None for an interactive one)."""
        queue = self.subjects.queue_from_subject(subject)
        return queue[0] if queue is not None and queue[1] is Priority.BATCH else None
