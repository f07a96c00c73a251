"""The worker's I/O loop around the pure policy core.

Each turn it refreshes what it knows of the per-model queues (worker/backlog.py), asks the
scheduler for a decision (serve, load/evict, idle), and carries it out with its parts: batch
assembly (worker/batching.py), batch execution and the reply path (worker/execution.py,
replies.py), residency (worker/residency.py) and the cluster adverts (cluster.py).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import time
from typing import Any, Callable, TypeVar

import anyio
import anyio.abc
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetbatch.sdk.protocol import ErrorCode, SidecarReport, Subjects

from ..cluster import ClusterView
from ..config import Config, ConfigError
from ..handlers import HandlerError, create_handler, resolve_device
from ..policy import BatchCost, BatchWindow, Budget, CostEstimator, Idle, Load, SchedulerState, Serve, effective_backlog, make_policy
from ..replies import Answer, Replier, settle
from ..status import serve_status
from ..runtime import retry_startup
from ..streams import ensure_model_consumer, ensure_streams, model_consumer_name
from ..telemetry import WorkerTelemetry
from .backlog import refresh_backlog
from .batching import Batcher
from .execution import BatchRunner
from .parts import BatchReport, Slot
from .quarantine import Quarantine
from . import view
from .residency import Residency, default_host_budget_bytes

__all__ = ["Worker"]

log = logging.getLogger("jetbatch.worker")
T = TypeVar("T")


class Worker:
    """Serves the models of ``config`` from their JetStream queues on one device.

    Run it with ``await worker.run()`` inside an anyio/asyncio program; ``worker.stop()`` asks for
    a graceful stop (stop fetching, finish in-flight batches, nak what cannot finish, unload).
    ``reply_nc``: a connection with the reply identity (``nats.reply_identity``) for answers.
    """

    def __init__(
        self,
        config: Config,
        nc: NATS,
        *,
        on_batch: Callable[[BatchReport], None] | None = None,
        reply_nc: NATS | None = None,
    ) -> None:
        if not config.models:
            raise ConfigError("the worker config has no [models.<name>] section: nothing to serve")
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects: Subjects = config.subjects
        self.worker_id = config.worker.id or f"{socket.gethostname()}-{os.getpid()}"
        self.device = resolve_device(config.worker.device)
        try:
            self.policy = make_policy(config.worker.policy, **config.worker.policy_options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"worker.policy: {exc}") from None
        self.costs = CostEstimator()
        self.slots: dict[str, Slot] = {}
        for name, mcfg in config.models.items():
            handler = create_handler(name, mcfg)
            handler.target_device = self.device
            self.slots[name] = Slot(
                name=name,
                config=mcfg,
                handler=handler,
                window=BatchWindow(mcfg.max_batch_size, mcfg.max_delay_ms / 1000.0),
                limiter=anyio.CapacityLimiter(mcfg.max_concurrent_batches),
            )
            self.costs.seed(
                name,
                load_cost_s=mcfg.load_cost_s,
                batch_cost=BatchCost(mcfg.batch_cost_s, mcfg.item_cost_s),
                memory_bytes=mcfg.memory_bytes or 0,
            )
        self._check_models()
        self.budget = Budget(max_bytes=config.worker.memory_budget_bytes, max_models=config.worker.max_resident_models)
        self.stats = {"batches": 0, "requests": 0, "loads": 0, "evictions": 0}
        self.telemetry = WorkerTelemetry(self.worker_id, self.subjects.prefix)
        self.telemetry.register_gauges(self.report)
        self._stopping = anyio.Event()
        self._ready = anyio.Event()
        self._current: str | None = None
        self._last_refresh = -math.inf
        self._in_flight_msgs: dict[int, Msg] = {}
        self._device_lock = anyio.Lock()  # loads and batches never overlap on the device
        self.replier = Replier(nc, self.subjects, config.replies, reply_nc=reply_nc)
        self.quarantine = Quarantine(self.js, self.subjects, config.streams.max_deliver, replicas=config.streams.replicas)
        self.batcher = Batcher(self._stopping, poll_interval_s=config.worker.poll_interval_ms / 1000.0, on_trouble=self._note_trouble)
        self.runner = BatchRunner(
            worker_id=self.worker_id,
            replier=self.replier,
            quarantine=self.quarantine,
            telemetry=self.telemetry,
            costs=self.costs,
            policy=self.policy,
            reply_policy=config.reply_policy,
            max_deliver=config.streams.max_deliver,
            stats=self.stats,
            on_batch=on_batch,
        )
        host_budget = config.worker.host_memory_budget_bytes
        self.residency = Residency(
            slots=self.slots,
            device=self.device,
            costs=self.costs,
            policy=self.policy,
            telemetry=self.telemetry,
            device_lock=self._device_lock,
            host_budget_bytes=default_host_budget_bytes() if host_budget is None else host_budget,
            prefetch=config.worker.prefetch_weights,
            stats=self.stats,
            on_load_failed=self._fail_queue,
        )
        self.cluster: ClusterView | None = None
        if config.worker.coordinate:
            # Adverts time out within a heartbeat: a put stuck on a lost node must not silence this
            # worker for the client's default 5 s (peers would take it for dead).
            advert_js = nc.jetstream(timeout=max(0.5, config.worker.heartbeat_s))
            self.cluster = ClusterView(
                advert_js, self.subjects, self.worker_id,
                heartbeat_s=config.worker.heartbeat_s, replicas=config.streams.replicas,
                peer_timeout_s=config.worker.peer_timeout_s,
            )  # fmt: skip
        self._started_at = time.time()
        self._rng = random.Random()  # private: the global one belongs to the application

    def _note_trouble(self) -> None:
        if self.cluster is not None:
            self.cluster.note_trouble()

    def _check_models(self) -> None:
        """Report a model that cannot load (a missing file) now, in one line, not at its first request."""
        for slot in self.slots.values():
            try:
                slot.handler.check()
            except HandlerError as exc:
                slot.broken = str(exc)
                log.error("%s: its requests will get model_failed until it can load", slot.broken)

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> anyio.Event:
        """Set once streams and consumers exist and the worker is pulling."""
        return self._ready

    def stop(self) -> None:
        """Ask for a graceful stop; :meth:`run` returns once in-flight work is drained."""
        self._stopping.set()

    def problems(self) -> list[str]:
        """One line per model that cannot serve (readiness detail; /readyz)."""
        return [f"model {name}: {slot.broken}" for name, slot in self.slots.items() if slot.broken]

    async def _setup(self) -> Any:
        await ensure_streams(self.js, self.subjects, self.config.streams, self.slots, self.config.replies)
        for name, slot in self.slots.items():
            await ensure_model_consumer(self.js, self.subjects, self.config.streams, name)
            slot.psub = await self.js.pull_subscribe_bind(durable=model_consumer_name(name), stream=self.subjects.models_stream)
        await self.quarantine.start()
        if self.cluster is not None:
            await self.cluster.start()

    async def run(self) -> None:
        """Set up streams and consumers (retrying while the cluster is slow or electing), then
        serve until :meth:`stop` (or cancellation)."""
        await retry_startup(self._setup, timeout_s=self.config.worker.startup_timeout_s, what=f"worker {self.worker_id}")
        if self.cluster is not None:
            await self.cluster.advertise(self.report())
        status_sub = await serve_status(self.nc, self.subjects, self.report, self.config.reply_policy, out=self.replier.out)
        log.info("worker %s serving %s on %s", self.worker_id, ", ".join(self.slots), self.device)
        self._ready.set()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                if self.cluster is not None:
                    tg.start_soon(self._advertise_loop)
                    tg.start_soon(self.cluster.watch)
                try:
                    await self._serve_loop(tg)
                finally:
                    # Let in-flight batches finish within the drain bound, then stop the heartbeat.
                    with anyio.move_on_after(self.config.worker.drain_timeout_s) as scope:
                        scope.shield = True
                        while any(s.in_flight for s in self.slots.values()):
                            await anyio.sleep(0.01)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await status_sub.unsubscribe()
                except (nats.errors.Error, ValueError):
                    pass
                if self.cluster is not None:
                    await self.cluster.withdraw()
                    await self.cluster.stop()
                for msg in list(self._in_flight_msgs.values()):
                    await settle(msg, "nak")  # the next worker takes them
                self._in_flight_msgs.clear()
                await self.residency.unload_all()
                for slot in self.slots.values():
                    if slot.psub is not None:
                        try:
                            await slot.psub.unsubscribe()
                        except (nats.errors.Error, ValueError):
                            pass

    def report(self) -> SidecarReport:
        """What this worker reports: its status (the status subject, ``jetbatch status``) and its
        advert to its peers (the cluster bucket)."""
        return view.build_report(self)

    def _in_flight_by_model(self) -> dict[str, int]:
        return view.in_flight_by_model(self)

    def _effective_backlog(self, slot: Slot, served: dict[str, float] | None = None) -> int:
        return view.effective(self, slot, served)

    def _state(self) -> SchedulerState:
        return view.scheduler_state(self)

    # --- the loop --------------------------------------------------------------------------

    async def _serve_loop(self, tg: anyio.abc.TaskGroup) -> None:
        poll_s = self.config.worker.poll_interval_ms / 1000.0
        while not self._stopping.is_set():
            now = time.time()
            busy = any(s.backlog > 0 for s in self.slots.values())
            # Bounded polling: a few stream-info calls per second when idle, more while busy.
            if now - self._last_refresh >= (poll_s / 5 if busy else poll_s):
                self._last_refresh = now
                mine = self._in_flight_by_model()
                not_ours = self.cluster.not_ours(now) if self.cluster is not None else {}
                if not await refresh_backlog(self.js, self.subjects, self.slots.values(), now, mine=mine, not_ours=not_ours):
                    self._note_trouble()
            decision = self.policy.decide(self._state(), now)
            if isinstance(decision, Serve):
                slot = self.slots[decision.model]
                if not slot.resident:
                    log.warning("policy %s chose non-resident model %s; loading it", self.policy.name, slot.name)
                    await self._load(slot, (), reason="serve-non-resident")
                    continue
                self.residency.prefetch(tg, exclude=slot.name, backlog_of=self._effective_backlog)
                await self._serve(tg, slot, decision)
            elif isinstance(decision, Load):
                await self._load(self.slots[decision.model], decision.evict, reason=decision.reason)
            else:
                arrived = await self._idle(decision, poll_s)
                if arrived is not None:
                    slot, first = arrived
                    await self._serve(tg, slot, Serve(slot.name, slot.config.max_batch_size, "arrival"), first)

    async def _idle(self, decision: Idle, poll_s: float) -> tuple[Slot, list[Msg]] | None:
        """Wait for work, never longer than the poll interval. Long-polls the most recently used
        resident model's queue, so a request for it starts a batch at once; other models are seen
        at the next backlog refresh."""
        wait_s = max(0.0, min(decision.until - time.time(), poll_s))
        resident = [s for s in self.slots.values() if s.resident]
        with anyio.move_on_after(wait_s):
            if resident and wait_s > 0.002:
                slot = max(resident, key=lambda s: s.last_used_at or 0)
                msgs = await self.batcher.fetch(slot, 1, wait_s)
                if msgs:
                    return slot, msgs
            await self._stopping.wait()
        return None

    async def _serve(self, tg: anyio.abc.TaskGroup, slot: Slot, decision: Serve, first: list[Msg] | None = None) -> None:
        # Pipelining: gather the next batch while the previous one computes, but never hold more
        # than one gathered batch beyond the ones the model may run at once.
        while slot.in_flight > slot.config.max_concurrent_batches:
            await anyio.sleep(0.005)
        max_items = max(1, min(decision.max_items, slot.config.max_batch_size))
        if decision.before is not None and not first:
            msgs = await self.batcher.gather_before(slot, max_items, decision.before)
        else:
            msgs = await self.batcher.gather(slot, max_items, first)
        if not msgs:
            if slot.stranded and time.time() >= slot.hold_until:
                # Delivered to someone, unacked, not fetchable now: stop chasing them until all
                # are due for redelivery (one ack wait), and tell peers not to chase them either.
                slot.unfetchable = slot.stranded
                slot.hold_until = time.time() + self.config.streams.ack_wait_s
            slot.backlog = 0
            slot.oldest_enqueued_at = None
            return
        for m in msgs:
            self._in_flight_msgs[id(m)] = m
        slot.in_flight += 1
        loaded = slot.fresh_load
        slot.fresh_load = False
        self._current = slot.name
        tg.start_soon(self._run_batch, slot, msgs, loaded, decision.reason)

    async def _run_batch(self, slot: Slot, msgs: list[Msg], loaded: bool, reason: str) -> None:
        try:
            async with slot.limiter:
                async with self._device_lock:
                    await self.runner.run(slot, msgs, loaded, reason)
        except Exception:  # noqa: BLE001 - a bug in one batch must not end the sidecar
            log.exception("batch of %s failed; its requests are redelivered", slot.name)
            for m in msgs:
                await settle(m, "nak", delay_s=1.0)
        finally:
            for m in msgs:
                self._in_flight_msgs.pop(id(m), None)
            slot.in_flight -= 1

    # --- loads -----------------------------------------------------------------------------

    async def _claim_load(self, slot: Slot) -> bool:
        """Before paying a load, give peers that decided the same a moment to say so, and stand
        back if one of them now covers this model's backlog (workers must not all chase one queue)."""
        if self.cluster is None or not self.cluster.peers():
            return True
        await anyio.sleep(self._rng.uniform(0.0, min(0.1, self.config.worker.heartbeat_s / 4)))
        served = self.cluster.served_drain_rps().get(slot.name, 0.0)
        if effective_backlog(slot.backlog, served, self.residency.load_cost_s(slot), resident_here=False) == 0:
            return False
        if not await self.cluster.claim(slot.name):
            log.info("another worker is loading %s now: standing back", slot.name)
            return False
        self.residency.loading = slot.name
        await self.cluster.advertise(self.report())
        return True

    async def _load(self, slot: Slot, evict: Any, *, reason: str) -> None:
        if log.isEnabledFor(logging.INFO):
            peers = self.cluster.peers() if self.cluster is not None else {}
            log.info(
                "decided to load %s (%s): backlog %s; peers %s; view %s",
                slot.name, reason, {s.name: (s.backlog, self._effective_backlog(s)) for s in self.slots.values()},
                {p: (a.resident, a.loading) for p, a in peers.items()},
                "fresh" if self.cluster is None or self.cluster.view_fresh() else "stale (kept)",
            )  # fmt: skip
        if not await self._claim_load(slot):
            return
        share = self._effective_backlog(slot)  # what the peers would not drain: ours to serve
        try:
            if await self.residency.load(slot, evict, reason=reason, share=share):
                self._current = slot.name
        finally:
            if self.cluster is not None:
                await self.cluster.advertise(self.report())  # resident now: peers count our drain
                await self.cluster.release(slot.name)

    async def _fail_queue(self, slot: Slot, message: str) -> None:
        """A model that cannot load: answer one batch of its waiting requests with model_failed so
        callers learn it now, instead of waiting for their timeouts."""
        msgs = await self.batcher.fetch(slot, slot.config.max_batch_size, 0.05)
        if not msgs:
            return
        now = time.time()
        requests = [self.runner.parse(m, now) for m in msgs]
        for r in requests:
            r.answer = Answer.failure(r.meta, ErrorCode.MODEL_FAILED, message, model=slot.name)
        await self.runner._finish(slot, requests)
        slot.backlog = max(0, slot.backlog - len(msgs))

    # --- state -----------------------------------------------------------------------------

    async def _advertise_loop(self) -> None:
        assert self.cluster is not None
        while True:
            await anyio.sleep(self.config.worker.heartbeat_s)
            await self.cluster.advertise(self.report())

    async def _heartbeat_loop(self) -> None:
        """Tell JetStream that in-flight messages are still being worked on (long loads and long
        batches), so they are not redelivered to another worker meanwhile."""
        interval = max(self.config.streams.ack_wait_s / 3.0, 0.05)
        while True:
            await anyio.sleep(interval)
            for msg in list(self._in_flight_msgs.values()):
                try:
                    await msg.in_progress()
                except (nats.errors.Error, TimeoutError):
                    pass
