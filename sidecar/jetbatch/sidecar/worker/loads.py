"""Loads: a model made resident for the core's ``LoadModel`` (or a pin or preload at start),
under the peers' load claims; a queue nobody waits for answered without its load (the core's
``Reap``); a model that cannot load has its waiting requests answered ``model_failed``."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Coroutine

import anyio

from jetbatch.sdk.protocol import ErrorCode

from ..config import Config
from ..core import LoadDue, Reap, WorkerCore
from ..policy import cannot_finish
from ..replies import Answer, settle
from .batching import Batcher
from .cancellations import Cancellations
from .coordination import Coordinator
from .counters import Counters
from .execution import BatchRunner
from .lines import Lines
from .arrivals import ArrivalFeed
from .queues import QueueView
from .residency import Residency
from .slots import Slot
from .state import LoopState

__all__ = ["Loads"]

log = logging.getLogger("jetbatch.worker")

# How long a load cut short (the worker stopping) still tries to advertise and give its claim back.
_SETTLE_ON_FAILURE_S = 2.0


class Loads:
    """Carries out loads and what stands in for them."""

    def __init__(
        self, config: Config, *, worker_id: str, slots: dict[str, Slot], core: WorkerCore, queues: QueueView, peers: Coordinator, residency: Residency,
        batcher: Batcher, arrivals: ArrivalFeed, runner: BatchRunner, cancellations: Cancellations, state: LoopState, stats: Counters, lines: Lines,
        consumer: Callable[[Slot], Coroutine[Any, Any, bool]],
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self.slots = slots
        self.core = core
        self.queues = queues
        self.peers = peers
        self.residency = residency
        self.batcher = batcher
        self.arrivals = arrivals
        self.runner = runner
        self.cancellations = cancellations
        self.state = state
        self.stats = stats
        self.lines = lines
        self._consumer = consumer

    async def preload(self) -> None:
        """Load the pinned models, then the ``preload`` ones, in config order, before ready (the
        preloads only while the device's model slots last; pins are known to fit)."""
        slots = self.config.worker.max_resident_models
        wanted = [s for s in self.slots.values() if s.config.pin] + [s for s in self.slots.values() if s.config.preload and not s.config.pin]
        for slot in wanted:
            if slots is not None and len(self.residency.resident_names()) >= slots:
                log.warning("not preloading %s: the device's %d model slots are taken", slot.name, slots)
                continue
            # A peer loading the same model at the same moment holds its claim for that load: this
            # load waits for it, instead of leaving a pin unhonoured until a backlog asks for it
            # (two workers pinning one model and started together saw exactly that).
            deadline = time.monotonic() + self.config.worker.startup_timeout_s
            while slot.broken is None and not slot.resident:
                await self.load(slot, (), reason="preload", for_backlog=False)
                if slot.resident or slot.broken is not None or time.monotonic() >= deadline:
                    break
                self.stats.add("preload_waits")
                await anyio.sleep(self.config.worker.heartbeat_s / 4)
            if not slot.resident and slot.broken is None:
                log.warning("not preloading %s: peers held its claim for %.0f s", slot.name, self.config.worker.startup_timeout_s)

    async def load(
        self, slot: Slot, evict: tuple[str, ...], *, reason: str, for_backlog: bool = True, tg: anyio.abc.TaskGroup | None = None
    ) -> None:
        """Load ``slot`` evicting ``evict`` under the peers' claims. ``tg``: where the advert and
        the claim's release after the load run, beside the model's first batch (without it,
        before this returns)."""
        if for_backlog and not slot.resident and not await self.lines.look(slot):
            return  # what the events said waits, the stream does not store
        if for_backlog and not slot.resident:
            # Asked just before paying: once the models to evict are free (their last batch may
            # run for a while), is anyone still waiting? If every caller of this queue has given
            # up (its deadline, the SDK's timeout, passed), answer them without the load (the
            # simulator applies the same rule).
            for name in evict:
                await self.slots[name].wait_model_free(self.core)
            due = LoadDue(slot.name, slot.tier, time.time(), _known_waiting(slot), peer_serves=self.peers.served().get(slot.name, 0.0) > 0)
            verdict = self.core.handle(due)
            if isinstance(verdict, Reap):
                await self.reap(slot, verdict.horizon_s)
                return
        if log.isEnabledFor(logging.INFO):
            peers, view_state = self.peers.describe()
            log.info(
                "%s decided to load %s (%s), evicting %s: backlog %s; peers %s; view %s",
                self.worker_id, slot.name, reason, list(evict) or "none",
                {n: (self.slots[n].backlog, self.peers.share(self.slots[n])) for n in sorted(self.queues.waiting)[:20]},
                peers, view_state,
            )  # fmt: skip
        claimed = await self.peers.claim_load(slot, tuple(evict), for_backlog=for_backlog)
        if claimed is None:
            return
        try:
            async with anyio.create_task_group() as loading:
                # The model's consumer is made while the model loads: on a replicated stream it is
                # a Raft group, tens of milliseconds that need not add to the load.
                loading.start_soon(self._consumer, slot)
                loaded = await self.residency.load(slot, evict, reason=reason)
            if loaded:
                # An empty fetch from before this load says nothing of the queue now: the first
                # one after it is fetched again, not held back as a second in a row.
                self.lines.fetched_some(slot)
        except BaseException:
            self.residency.announce_loading(None)
            with anyio.move_on_after(_SETTLE_ON_FAILURE_S, shield=True):
                await self.peers.loaded(claimed)
            raise
        self.residency.announce_loading(None)
        # Resident now: peers count our drain at once, before the claim is given back.
        if tg is None:
            await self.peers.loaded(claimed)
        else:
            self.peers.loaded_soon(tg, claimed)

    async def reap(self, slot: Slot, horizon_s: float = 0.0) -> None:
        """One batch of an abandoned queue answered and acked, with no load and no compute:
        ``cancelled`` for a caller that cancelled, ``deadline_exceeded`` for one whose deadline
        passes within ``horizon_s`` (the load and a batch); a request that turns out to be still
        wanted goes back to the queue."""

        def answer(r: Any, now: float) -> Answer | None:
            if self.cancellations.cancelled(r.meta.tenant, r.meta.request_id):
                return Answer.failure(r.meta, ErrorCode.CANCELLED, "cancelled by its caller before its model was loaded", model=slot.name)
            if not cannot_finish(r.meta.deadline, now, horizon_s):
                return None
            why = "deadline passed while the model was not loaded" if r.meta.deadline <= now else f"deadline within the model's load ({horizon_s:.3f}s)"
            return Answer.failure(r.meta, ErrorCode.DEADLINE_EXCEEDED, why, model=slot.name)

        # A second at most: a consumer made just now may take a moment to deliver what is stored.
        reaped = await self._answer_unloaded(slot, answer, fetch_s=1.0)
        if reaped:
            self.stats.add("reaped", reaped)
        # The acks reach the stream in a moment; a count taken at once would still see the reaped
        # requests stored, unknown to the events, and make the model look wanted: count a poll
        # interval later.
        self.state.next_refresh = max(self.state.next_refresh, time.time() + self.config.worker.poll_interval_ms / 1000.0)

    async def fail_queue(self, slot: Slot, message: str) -> None:
        """A model that cannot load: answer one batch of its waiting requests with model_failed so
        callers learn it now, instead of waiting for their timeouts."""
        await self._answer_unloaded(slot, lambda r, now: Answer.failure(r.meta, ErrorCode.MODEL_FAILED, message, model=slot.name), fetch_s=0.05)

    async def _answer_unloaded(self, slot: Slot, answer: Callable[[Any, float], Answer | None], *, fetch_s: float) -> int:
        """Fetch one batch of ``slot``'s queue and answer it without the model: each request gets
        ``answer(request, now)`` (stored, sent, acked), or goes back to the queue when that is
        None. Returns how many were answered."""
        if not await self._consumer(slot):
            return 0
        msgs = await self.batcher.fetch(slot, slot.config.max_batch_size, fetch_s)
        if not msgs:
            self.lines.held_back(slot)
            return 0
        await self.arrivals.took(slot.name, len(msgs))
        now = time.time()
        answered: list[Any] = []
        back: list[Any] = []
        for r in (self.runner.parse(m, now) for m in msgs):
            r.answer = answer(r, now)
            (answered if r.answer is not None else back).append(r)
        try:
            if answered:
                await self.runner.finish(slot, answered)
            for r in back:
                await settle(r.msg, "nak")
        finally:
            with anyio.CancelScope(shield=True):
                await self.arrivals.settled(slot.name, len(msgs))
        return len(answered)



def _known_waiting(slot: Slot) -> list[tuple[float | None, bool]] | None:
    """Each waiting request's deadline and whether its caller cancelled it; None unless every
    waiting request is known (one never seen arriving may be wanted)."""
    if slot.backlog > slot.known or slot.unknown_head_at is not None:
        return None
    return [(d, key in slot.cancelled_keys) for _, d, key, _ in (*slot.known_times, *slot.known_bulk)]
