"""The worker sidecar: its parts wired together, its lifecycle, and what it reports.

Each turn the executor (``worker/executor.py``) hands the worker core (``core.WorkerCore``) what
the worker knows of its queues and device, and carries out the action the core answers with the
parts below: listening and counting (``worker/lines.py``, ``worker/queues.py``), batch assembly
(``worker/batching.py``), batch execution and the reply path (``worker/execution.py``,
``replies.py``), loads (``worker/loads.py``, ``worker/residency.py``), the cluster adverts and
load claims (``worker/coordination.py``, ``cluster.py``), orphaned queues
(``worker/orphan_answers.py``). This module makes them and runs them: set-up, preloads, the
heartbeat that keeps in-flight messages alive, the drain and the stop.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any, Callable

import anyio
import anyio.abc
from nats.aio.client import Client as NATS

from jetbatch.sdk.connection import unreadable_messages
from jetbatch.sdk.protocol import Priority, SidecarReport, Subjects

from ..cluster import ClusterView
from ..config import Config, ConfigError
from ..core import ModelRules, Started, WorkerCore
from ..errors import TRANSPORT_ERRORS
from ..handlers import Handler, create_handler, resolve_device, uses_torch
from ..policy import BatchWindow, make_policy
from ..recording import FlightRecorder
from ..replies import Replier, settle
from ..runtime import retry_startup
from ..status import serve_status
from ..streams import ensure_model_consumers, ensure_streams, progress_interval_s
from ..telemetry import WorkerTelemetry
from . import view
from .batching import Batcher
from .cancellations import Cancellations
from .coordination import Coordinator
from .counters import Counters
from .execution import BatchRunner
from .executor import Executor
from .counting import StreamCounts
from .lines import Lines
from .loads import Loads
from .orphan_answers import OrphanAnswers
from .pullers import Pullers
from .quarantine import Quarantine
from .arrivals import ArrivalFeed
from .queues import QueueView
from .residency import Residency, default_host_budget_bytes
from .slots import BatchReport, Slot
from .state import LoopState

__all__ = ["Worker"]

log = logging.getLogger("jetbatch.worker")


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
        record: FlightRecorder | None = None,
    ) -> None:
        if not config.models:
            raise ConfigError("the worker config has no [models.<name>] section: nothing to serve")
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects: Subjects = config.subjects
        self.worker_id = config.worker.id or f"{socket.gethostname()}-{os.getpid()}"
        handlers = {name: create_handler(name, mcfg) for name, mcfg in config.models.items()}
        # A worker whose handlers need no torch (sleeps, identities) never imports it.
        self.device: Any = resolve_device(config.worker.device) if uses_torch(handlers.values(), config.worker.device) else "cpu"
        try:
            self.policy = make_policy(config.worker.policy, **config.worker.policy_options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"worker.policy: {exc}") from None
        # The core holds every rule the worker decides by and the state they read (core/turns.py);
        # this loop turns NATS and torch into its events and carries out its actions, as the
        # simulator does with its clock. ``record``: the flight recorder (``--record``).
        self.core = WorkerCore(_started(config, self.worker_id), policy=self.policy, recorder=record)
        self.recorder = record
        if record is not None and hasattr(record, "attach"):
            record.attach(self.core)  # a ring snapshots the core's state as it goes
        self.driver = self.core.driver  # read: estimates, demand, the cluster share
        self.costs = self.core.costs
        self.budget = self.core.budget
        self.slots = _make_slots(config, handlers, self.device)
        # Counters; what the control plane's steps cost here is added by worker/counters.py (the
        # scale bench tells the simulator this deployment's costs from them: Control.measured).
        self.stats = Counters("batches", "requests", "loads", "loads_cold", "loads_warm", "load_us", "evictions", "decisions", "decision_us", "models_shown")
        self.telemetry = WorkerTelemetry(self.worker_id, self.subjects.prefix, metric_tenants=config.tenants.metric_tenants)
        self._stopping = anyio.Event()
        self._ready = anyio.Event()
        self.state = LoopState(started_at=time.time())
        self.http_address = ""  # where its endpoints listen (set by runtime.serve_sidecar), for the report
        # Loads and batches never overlap on the device; a free lock is taken without yielding.
        self._device_lock = anyio.Lock(fast_acquire=True)
        self.replier = Replier(nc, self.subjects, config.replies, reply_nc=reply_nc)
        self.quarantine = Quarantine(self.js, self.subjects, config.streams.max_deliver, replicas=config.streams.replicas)
        # A peer's take event counts until it settles, or for two heartbeats (its advert tells then).
        self.queues = QueueView(self.slots, peer_event_s=2 * config.worker.heartbeat_s)
        # Callers that gave up early (their tasks cancelled): no load is paid for them. Their notices
        # are read on a connection of its own (worker/control.py).
        self.cancellations = Cancellations(nc, self.subjects, on_cancel=self._on_cancel, counters=self.stats, nats=config.nats)
        self.arrivals = ArrivalFeed(
            nc, self.subjects, self.slots, self.queues, on_arrival=lambda: self.executor.wake_up(), worker_id=self.worker_id, counters=self.stats,
            cancelled=self.cancellations.cancelled, audience=lambda: self.peers.heard(), nats=config.nats, on_lost=self._note_trouble,
        )  # fmt: skip

        self.pullers = Pullers(
            nc, self.subjects, config.streams, on_late=lambda slot: self.batcher.late(slot), counters=self.stats,
            on_uncounted=lambda slot, bulk, msg: self.arrivals.missed(slot, msg, bulk=bulk),
        )  # fmt: skip
        self.batcher = Batcher(
            self._stopping,
            counters=self.stats,
            poll_interval_s=config.worker.poll_interval_ms / 1000.0,
            on_trouble=self._note_trouble,
            on_fetched=lambda slot, n, pending, bulk, seq, again: self.queues.fetched(slot, n, pending, bulk=bulk, last_seq=seq, redelivered=again),
            filled=lambda slot: slot.name == self.core.serving and self.arrivals.is_quiet(slot.name),
            computing=self.core.computing,
        )
        self.runner = BatchRunner(
            worker_id=self.worker_id,
            replier=self.replier,
            quarantine=self.quarantine,
            telemetry=self.telemetry,
            core=self.core,
            reply_policy=config.reply_policy,
            max_deliver=config.streams.max_deliver,
            counters=self.stats,
            device_lock=self._device_lock,
            on_batch=on_batch,
            cancelled=self.cancellations.cancelled,
            on_settled=lambda slot, msgs, back_in_s=None: self.executor.settled(slot, msgs, back_in_s),
        )
        host_budget = config.worker.host_memory_budget_bytes
        self.residency = Residency(
            slots=self.slots,
            device=self.device,
            core=self.core,
            telemetry=self.telemetry,
            device_lock=self._device_lock,
            host_budget_bytes=default_host_budget_bytes() if host_budget is None else host_budget,
            prefetch=config.worker.prefetch_weights,
            counters=self.stats,
            on_load_failed=lambda slot, message: self.loads.fail_queue(slot, message),
        )
        self.residency.check_models()
        cluster: ClusterView | None = None
        if config.worker.coordinate:
            # Adverts time out within a heartbeat: a put stuck on a lost node must not silence this
            # worker for the client's default 5 s (peers would take it for dead).
            advert_js = nc.jetstream(timeout=max(0.5, config.worker.heartbeat_s))
            cluster = ClusterView(
                advert_js, self.subjects, self.worker_id,
                heartbeat_s=config.worker.heartbeat_s, replicas=config.streams.replicas,
                peer_timeout_s=config.worker.peer_timeout_s, max_payload=lambda: nc.max_payload,
            )  # fmt: skip
        self.peers = Coordinator(
            cluster, worker_id=self.worker_id, slots=self.slots, queues=self.queues, residency=self.residency,
            core=self.core, budget=self.budget, counters=self.stats, heartbeat_s=config.worker.heartbeat_s, report=self.report,
        )  # fmt: skip
        self.telemetry.register_gauges(self.report, self.peers.reports_queues, self.queues)
        self.orphans = OrphanAnswers(self.js, self.subjects, config.streams, queues=self.queues, runner=self.runner, grace_s=config.worker.orphan_grace_s)
        parts = dict(slots=self.slots, core=self.core, queues=self.queues, peers=self.peers, state=self.state, stats=self.stats)
        self.lines = Lines(
            config, self.js, arrivals=self.arrivals, pullers=self.pullers, orphans=self.orphans, note_trouble=self._note_trouble, counts=StreamCounts(nc), **parts,  # type: ignore[arg-type]
        )  # fmt: skip
        self.loads = Loads(
            config, worker_id=self.worker_id, residency=self.residency, batcher=self.batcher, arrivals=self.arrivals, runner=self.runner,
            cancellations=self.cancellations, lines=self.lines, consumer=self._consumer, **parts,  # type: ignore[arg-type]
        )  # fmt: skip
        self.executor = Executor(
            config, residency=self.residency, batcher=self.batcher, arrivals=self.arrivals, runner=self.runner, lines=self.lines,
            loads=self.loads, stopping=self._stopping, consumer=self._consumer, **parts,  # type: ignore[arg-type]
        )  # fmt: skip

    def _note_trouble(self) -> None:
        self.peers.note_trouble()
        self.state.next_refresh = -math.inf  # count again at once: events may have been lost

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> anyio.Event:
        """Set once streams and consumers exist and the worker is pulling."""
        return self._ready

    def stop(self) -> None:
        """Ask for a graceful stop; :meth:`run` returns once in-flight work is drained."""
        self._stopping.set()
        self.executor.wake_up()

    def model_ready(self, model: str) -> tuple[int, str]:
        """Whether ``model`` can be served now (``/readyz?model=``, ``jetbatch probe --model``):
        200 when it is resident, or loadable on demand (the line says from which tier and about
        how long); 503 when it cannot load; 404 when this worker does not serve it."""
        slot = self.slots.get(model)
        if slot is None:
            return 404, f"model {model}: not served by this worker"
        if slot.broken:
            return 503, f"model {model}: {slot.broken}"
        pin = ", pinned" if slot.config.pin else ""
        if slot.resident:
            return 200, f"model {model}: resident{pin}"
        if self.residency.loading == model:
            return 200, f"model {model}: loading"
        measured = self.residency.measured_load_s(slot)
        if measured is None:  # the configured estimate is a guess: never shown as a time
            return 200, f"model {model}: {slot.tier}, loads on demand (load time not yet measured)"
        return 200, f"model {model}: {slot.tier}, loads on demand {_seconds(measured)}"

    def problems(self) -> list[str]:
        """One line per model that cannot serve (readiness detail; /readyz)."""
        return [f"model {name}: {why}" for name, why in self.residency.broken.items()]

    async def _setup(self) -> Any:
        await ensure_streams(self.js, self.subjects, self.config.streams, self.slots, self.config.replies)
        if self.config.streams.consumers == "eager":
            # Both lines: lag triggers (KEDA) need every consumer they name to exist.
            await ensure_model_consumers(self.js, self.subjects, self.config.streams, self.slots, priorities=tuple(Priority))
            self.pullers.made(self.slots.values(), time.time())
        # Listen before the first count, so no arrival falls between the two.
        await self.arrivals.start()
        await self.cancellations.start()
        await self.quarantine.start()
        if self.peers.cluster is not None:
            await self.peers.cluster.start()
        await self.lines.refresh(time.time())

    async def _warm_start(self) -> None:
        if not uses_torch((s.handler for s in self.slots.values()), self.config.worker.device):
            return  # nothing to set up: torch is not imported
        from ..handlers.modules import warm_start
        started = time.perf_counter()
        formats = {slot.config.handler for slot in self.slots.values()}
        try:
            warmed = await anyio.to_thread.run_sync(warm_start, formats)
        except Exception as exc:  # noqa: BLE001 - only an optimisation: the first load pays it instead
            log.warning("warm start failed (%s): the first load will pay torch's set-up", exc)
            return
        if warmed:
            self.stats.add("warm_start_us", int((time.perf_counter() - started) * 1e6))
            log.info("torch set up for %s in %.2f s", ", ".join(sorted(warmed)), time.perf_counter() - started)

    async def _consumer(self, slot: Slot) -> bool:
        """``slot``'s consumers and pullers ready for a fetch (worker/pullers.py); on trouble,
        count again soon and back off."""
        if await self.pullers.ready(slot):
            return True
        self._note_trouble()
        return False

    async def run(self) -> None:
        """Set up streams and consumers (retrying while the cluster is slow or electing), then
        serve until :meth:`stop` (or cancellation)."""
        try:
            await self._run()
        finally:
            # The events' and cancel notices' own connections are closed on every way out.
            with anyio.CancelScope(shield=True):
                await self.arrivals.stop()
                await self.cancellations.stop()

    async def _run(self) -> None:
        async with anyio.create_task_group() as starting:
            # torch's one-time set-up for the configured formats, beside the streams' set-up and
            # before ready: no model's first load pays it (nor teaches the estimator it).
            starting.start_soon(self._warm_start)
            await retry_startup(self._setup, timeout_s=self.config.worker.startup_timeout_s, what=f"worker {self.worker_id}")
        await self.peers.advertise()
        status_sub = await serve_status(self.nc, self.subjects, self.report, self.config.reply_policy, out=self.replier.out)
        await self.loads.preload()
        log.info("worker %s serving %s on %s", self.worker_id, ", ".join(self.slots), self.device)
        self._ready.set()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                tg.start_soon(self.arrivals.late.run)  # the refusals the arrival screen decides
                tg.start_soon(self.orphans.run)  # with no peers heard, for models no worker ever registered
                if self.peers.cluster is not None:
                    tg.start_soon(self.peers.advertise_forever)
                    tg.start_soon(self.peers.cluster.watch)
                try:
                    await self.executor.serve_loop(tg)
                finally:
                    # Let in-flight batches finish within the drain bound, then stop the heartbeat.
                    with anyio.move_on_after(self.config.worker.drain_timeout_s) as scope:
                        scope.shield = True
                        for slot in [s for s in self.slots.values() if self.core.in_flight(s.name)]:
                            await slot.wait_settled(self.core)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await status_sub.unsubscribe()
                except TRANSPORT_ERRORS + (ValueError,):
                    pass
                if self.peers.cluster is not None:
                    await self.peers.cluster.withdraw()
                    await self.peers.cluster.stop()
                for msg in self.state.in_flight.messages():
                    await settle(msg, "nak")  # the next worker takes them
                self.state.in_flight.clear()
                await self.residency.unload_all()
                await self.arrivals.stop()
                await self.pullers.close(self.slots.values())

    def report(self) -> SidecarReport:
        """What this worker reports: its status (the status subject, ``jetbatch status``) and its
        advert to its peers (the cluster bucket)."""
        return view.build_report(
            worker_id=self.worker_id, slots=self.slots, queues=self.queues, residency=self.residency,
            costs=self.costs, budget=self.budget, in_flight=self.state.in_flight.by_model(self.subjects.model_from_subject),
            stats={
                **self.stats.snapshot(), **self.pullers.counts(),
                "unreadable_messages": unreadable_messages(self.nc, self.replier.reply_nc, self.cancellations.connection, self.arrivals.connection),
                # Adverts under this worker's id that it did not put: another live worker shares it.
                "duplicate_id_adverts": self.peers.cluster.duplicate_adverts if self.peers.cluster is not None else 0,
            },
            started_at=self.state.started_at, valid_s=self.config.worker.peer_timeout_s, http=self.http_address,
        )  # fmt: skip

    def _on_cancel(self, key: tuple[str, str]) -> None:
        if self.queues.cancel(key):
            self.executor.wake_up()  # a queue may now be abandoned, or worth less

    async def _heartbeat_loop(self) -> None:
        """Tell JetStream that in-flight messages and those in open batch windows are still being
        worked on (long loads and long batches), so they are not redelivered to another worker
        meanwhile, while a killed worker's are due one short ack wait after its last heartbeat."""
        interval = progress_interval_s(self.config.streams.ack_wait_s)
        while True:
            await anyio.sleep(interval)
            for msg in [*self.state.in_flight.messages(), *self.batcher.holding()]:
                try:
                    await msg.in_progress()
                except TRANSPORT_ERRORS:
                    pass


def _seconds(value: float) -> str:
    """A load time for a person: two significant digits (a 3 ms load is not "0.00 s")."""
    if value < 0.001:
        return "in under 1 ms"
    return f"in about {value:.2g} s" if value < 10 else f"in about {value:.0f} s"


def _make_slots(config: Config, handlers: dict[str, Handler], device: Any) -> dict[str, Slot]:
    """One slot per configured model: its handler (aimed at ``device``), batch window and limit
    of concurrent batches."""
    slots: dict[str, Slot] = {}
    for name, mcfg in config.models.items():
        handler = handlers[name]
        handler.target_device = device
        slots[name] = Slot(
            name=name,
            config=mcfg,
            handler=handler,
            window=BatchWindow(mcfg.max_batch_size, mcfg.max_delay_s),
            limiter=anyio.CapacityLimiter(mcfg.max_concurrent_batches),
        )
    return slots


def _started(config: Config, worker_id: str) -> Started:
    """What the worker's core is made from: the policy, each model's rules and seeded costs (the
    worker's idle-unload limit where the model has none), the device budget."""
    models = {
        name: ModelRules(
            max_batch_size=m.max_batch_size, load_cost_s=m.load_cost_s, batch_cost_s=m.batch_cost_s, item_cost_s=m.item_cost_s,
            memory_bytes=m.memory_bytes or 0, idle_unload_s=m.idle_unload_s or config.worker.idle_unload_s, pin=m.pin,
            max_concurrent_batches=m.max_concurrent_batches,
        )  # fmt: skip
        for name, m in config.models.items()
    }
    return Started(
        policy=config.worker.policy, options=dict(config.worker.policy_options), models=models,
        max_bytes=config.worker.memory_budget_bytes, max_models=config.worker.max_resident_models, worker=worker_id,
    )  # fmt: skip
