"""The worker's executor: each turn, the facts it knows handed to the core
(``core.WorkerCore``) and the action the core answers carried out with NATS and torch: a batch
fetched and run (its forward pass in a thread, its answers stored, then acked), a hold, a
recount, a load, an idle unload, a wait. It decides nothing about an action beyond executing
it; the simulator executes the same actions (``simulator/engine.py``)."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from typing import Any, Awaitable, Callable, Coroutine

import anyio
import anyio.abc
import anyio.lowlevel
from nats.aio.msg import Msg

from ..config import Config
from ..core import Fetch, Fetched, Hold, LoadModel, Recount, Settled, Sleep, Turn, Unload, WaitFree, WaitRoom, WorkerCore
from ..policy import visible_models
from ..pulling import Puller
from ..replies import settle
from ..telemetry import LoadRecord
from . import view
from .batching import Batcher
from .coordination import Coordinator
from .counters import Counters
from .execution import GIVE_BACK_DELAY_S, BatchRunner
from .lines import Lines
from .loads import Loads
from .arrivals import ArrivalFeed
from .queues import QueueView
from .residency import Residency
from .slots import ModelTurn, Slot
from .state import LoopState

__all__ = ["Executor"]

log = logging.getLogger("jetbatch.worker")

# The arrival order a turn tells a policy that reads it, at most this many requests long.
ARRIVAL_ORDER_MAX = 256


class Executor:
    """Runs the worker's turns until ``stopping`` is set (:meth:`serve_loop`)."""

    def __init__(
        self, config: Config, *, slots: dict[str, Slot], core: WorkerCore, queues: QueueView, residency: Residency, peers: Coordinator,
        batcher: Batcher, arrivals: ArrivalFeed, runner: BatchRunner, state: LoopState, stats: Counters, lines: Lines, loads: Loads,
        stopping: anyio.Event, consumer: Callable[[Slot], Coroutine[Any, Any, bool]],
    ) -> None:
        self.config = config
        self.slots = slots
        self.core = core
        self.driver = core.driver  # read: its demand, for which models a turn shows
        self.costs = core.costs  # read: the deadline estimates that close a window
        self.queues = queues
        self.residency = residency
        self.peers = peers
        self.batcher = batcher
        self.arrivals = arrivals
        self.runner = runner
        self.state = state
        self.stats = stats
        self.lines = lines
        self.loads = loads
        self._stopping = stopping
        self._consumer = consumer
        self._wake = anyio.Event()  # an arrival, or a stop: an idle turn looks again
        self._holding: Puller | None = None  # the puller of a hold under way (wake_up ends it)

    def wake_up(self) -> None:
        """Something happened that a turn should see: an arrival, a cancel notice, a stop."""
        self._wake.set()
        self.batcher.arrived()  # an open batch window counts again too
        if self._holding is not None:
            # Something else waits (another line's arrival): a hold ends now, not at its end.
            self._holding.interrupt()

    async def serve_loop(self, tg: anyio.abc.TaskGroup) -> None:
        execute: dict[type, Callable[[anyio.abc.TaskGroup, Any], Awaitable[None]]] = {
            Unload: self._do_unload, Hold: self._do_hold, Recount: self._do_recount, WaitFree: self._do_wait_free, WaitRoom: self._do_wait_room,
            Fetch: self._do_fetch, LoadModel: self._do_load, Sleep: self._do_sleep,
        }  # fmt: skip
        while not self._stopping.is_set():
            await self.lines.follow_arrivals()
            now = time.time()
            departed = self.peers.departed(now)
            if departed:
                # What the peer held comes back with no arrival event: at once if it stopped and
                # gave it back, when the ack wait ends if it was killed. A count finds it then,
                # whatever the poll interval (a minute's poll left a killed peer's requests that long).
                self.queues.forget_peers(departed)
                self.state.count_at(now, now + self.config.streams.ack_wait_s)
            if now >= self.state.next_count():
                await self.lines.refresh(now)
                now = time.time()
            started = time.perf_counter()
            # An arrival counted from here on is in no state this turn sees: it wakes an idle,
            # and ends a hold (even one about to start).
            if self._wake.is_set():
                self._wake = anyio.Event()
            turn = self.turn(now)
            action = self.core.handle(turn)
            # What deciding costs (the simulator charges it too: Workload.control, bench/scale/many_models.py).
            self.stats.add("decisions")
            self.stats.add("decision_us", int((time.perf_counter() - started) * 1e6))
            self.stats.add("models_shown", len(turn.facts))
            await execute[type(action)](tg, action)

    def turn(self, now: float) -> Turn:
        """What the core is told at a turn: the facts of the models a decision looks at
        (``policy.visible_models``)."""
        names = visible_models(
            self.slots, now,
            waiting=self.queues.waiting,
            on_device=self.residency.resident_names(),
            current=self.core.current,
            last_used=self.core.last_used,
            demand=self.driver.demand if self.driver.has_demand else None,
        )  # fmt: skip
        deferred = self.peers.deferred(now)
        defer_until = min(deferred.values(), default=math.inf)
        facts = view.queue_facts(names, slots=self.slots, residency=self.residency, served=self.peers.served(), deferred=deferred, last_used=self.core.last_used)
        return Turn(
            now=now, facts=facts,
            defer_until=defer_until if math.isfinite(defer_until) else None,
            arrival_order=self._arrival_order() if self.core.wants_arrival_order else None,
        )  # fmt: skip

    def _arrival_order(self) -> list[str]:
        """The waiting requests' models in the order the stream stored them (the first
        ``ARRIVAL_ORDER_MAX``), from the arrival events (``Slot.known_times``, ``known_bulk``), as
        the simulator gives its own arrival order. Requests nobody saw arrive are not in it."""
        entries: list[tuple[float, float, str]] = []
        for name in self.queues.waiting:
            slot = self.slots[name]
            for line in (slot.known_times, slot.known_bulk):
                entries.extend((seq if seq is not None else math.inf, at, name) for at, _, _, seq in itertools.islice(line, ARRIVAL_ORDER_MAX))
        return [name for _, _, name in heapq.nsmallest(ARRIVAL_ORDER_MAX, entries)]

    async def _do_unload(self, tg: anyio.abc.TaskGroup, action: Unload) -> None:
        for name in action.models:
            await self.residency.evict(self.slots[name], reason="idle")
        await self.lines.hand_back_leftovers(action.models)

    async def _do_hold(self, tg: anyio.abc.TaskGroup, action: Hold) -> None:
        held = self.slots[action.model]
        if await self._consumer(held):
            await self.serve(tg, held, Fetch(held.name, action.max_items, "hold"), hold_s=action.hold_s)
        else:
            self.core.handle(Fetched(held.name, 0, held=True))

    async def _do_recount(self, tg: anyio.abc.TaskGroup, action: Recount) -> None:
        await self.lines.follow_arrivals()  # the core stopped serving it: listened to and counted again

    async def _do_wait_free(self, tg: anyio.abc.TaskGroup, action: WaitFree) -> None:
        for name in action.models:
            await self.slots[name].wait_model_free(self.core)

    async def _do_wait_room(self, tg: anyio.abc.TaskGroup, action: WaitRoom) -> None:
        # Nothing yielded since the turn read the counts, so the next change is one it did not see.
        await self.slots[action.model].wait_batch_moves()

    async def _do_fetch(self, tg: anyio.abc.TaskGroup, action: Fetch) -> None:
        slot = self.slots[action.model]
        if not await self._consumer(slot):
            await self.idle(time.time() + self.config.worker.poll_interval_ms / 1000.0)
            return
        self.residency.prefetch(tg, exclude=slot.name, backlog_of=self.peers.share, candidates=sorted(self.queues.waiting))
        await self.serve(tg, slot, action)

    async def _do_load(self, tg: anyio.abc.TaskGroup, action: LoadModel) -> None:
        await self.lines.follow_arrivals(leaving=True)  # a load holds the worker for its whole time
        await self.lines.hand_back_leftovers(action.evict)
        await self.loads.load(self.slots[action.model], tuple(action.evict), reason=action.reason, tg=tg)
        # And what a victim's pull requests still open at the hand-back (a window's stays open
        # past its close) delivered during the load: back now, not at the next refresh's
        # hand-back of models not on the device.
        await self.lines.hand_back_leftovers(action.evict)

    async def _do_sleep(self, tg: anyio.abc.TaskGroup, action: Sleep) -> None:
        await self.lines.follow_arrivals(leaving=True)  # an idle worker wakes on arrival events
        await self.idle(math.inf if action.until is None else action.until)

    async def idle(self, until: float) -> None:
        """Sleep until an arrival event, ``until`` (the core's: the policy's timer, an idle unload
        or a deferred queue falling due), the next count, or a peer's leaving (what it held comes
        back with no event)."""
        now = time.time()
        wake_at = min(until, self.state.next_count(), self.peers.next_departure(now))
        wait_s = wake_at - now
        if wait_s > 0 and not self._wake.is_set() and not self._stopping.is_set():
            with anyio.move_on_after(wait_s):
                await self._wake.wait()
        self._wake = anyio.Event()

    async def serve(self, tg: anyio.abc.TaskGroup, slot: Slot, decision: Fetch, *, hold_s: float | None = None) -> None:
        # Pipelining: the next batch is gathered while the previous one computes, and computes
        # while earlier answers are stored; how many, the core's turn bounds (``WaitRoom``).
        max_items = decision.max_items  # within the model's max batch size (the core's rule)
        if decision.before is not None:
            msgs = await self.batcher.gather_before(slot, max_items, decision.before)
        elif hold_s is not None and slot.psub is not None:
            # Another line's arrival ends the hold at once (wake_up), as one counted since the
            # decision does: the worker then counts the served line and decides again, and the
            # request waits a count, not the hold (the simulator does the same).
            self.stats.add("holds")
            self._holding = slot.psub
            if self._wake.is_set():
                slot.psub.interrupt()
            try:
                msgs = await self.batcher.gather(slot, max_items, compute_s=self.costs.deadline_estimate_s(slot.name, max_items), hold_s=hold_s)
            finally:
                self._holding = None
                slot.psub.resume()
            if not msgs and self._wake.is_set():
                self.stats.add("holds_cut")
        else:
            # The window closes early enough for the earliest deadline gathered (window.py).
            msgs = await self.batcher.gather(slot, max_items, compute_s=self.costs.deadline_estimate_s(slot.name, max_items))
        # The core decides from the batch's size whether its model's next batches fill from held
        # pulls (policy/interest.py); a hold that came back empty ends that.
        self.core.handle(Fetched(slot.name, len(msgs), held=hold_s is not None))
        if not msgs:
            await self.lines.found_nothing(slot)
            return
        self.lines.fetched_some(slot)
        self.state.in_flight.add(msgs)
        loaded, load_record = self.residency.first_batch(slot)
        tg.start_soon(self.run_batch, slot, msgs, loaded, decision.reason, load_record)
        # Before the batch can settle (peers apply a take before its settle; the publish only
        # queues it for the socket).
        await self.arrivals.took(slot.name, len(msgs))
        # The batch starts (its checks and decoding, up to its forward pass) before this loop
        # decides again: deciding first held a lone request's batch back ~0.15 ms.
        await anyio.lowlevel.checkpoint()

    async def run_batch(self, slot: Slot, msgs: list[Msg], loaded: bool, reason: str, load_record: LoadRecord | None) -> None:
        # The model's share (``max_concurrent_batches``) is taken for the forward passes only:
        # the batch is checked and decoded while the one before still computes, and stores its
        # answers while the next one computes.
        # The batch starts here (its task runs before this loop's next gather): when its window
        # closed on its timer, how late after it teaches the lead of later windows.
        self.batcher.started()
        turn = ModelTurn(slot, self.core)
        try:
            await self.runner.run(slot, msgs, loaded, reason, turn, load_record)
        except Exception:  # noqa: BLE001 - a bug in one batch must not end the sidecar
            turn.release()
            log.exception("batch of %s failed; its requests are redelivered", slot.name)
            for m in msgs:
                await settle(m, "nak", delay_s=GIVE_BACK_DELAY_S)
            self.lines.given_back(GIVE_BACK_DELAY_S)
        finally:
            turn.release()
            self.core.handle(Settled(slot.name))
            slot.moved()
            with anyio.CancelScope(shield=True):
                await self.settled(slot, msgs)

    async def settled(self, slot: Slot, msgs: list[Msg], back_in_s: float | None = None) -> None:
        """Some of a batch's messages were settled (``BatchRunner.finish``), or the whole batch
        is done: no longer held here, and the peers are told (once per message). ``back_in_s``:
        some were given back, to be delivered again that much later."""
        if back_in_s is not None:
            self.lines.given_back(back_in_s)
        n = self.state.in_flight.settled(msgs)
        if n:
            await self.arrivals.settled(slot.name, n)
