"""The worker's I/O loop around the pure policy core.

Each turn it hands the driver (``policy.Driver``) what it knows of the per-model queues
(worker/queues.py: arrival events, its peers' take events, and one bulk count every poll interval
while busy, every second while idle) and asks for a decision (serve, load/evict, idle), and
carries it out with its parts: batch assembly (worker/batching.py), batch execution and the reply
path (worker/execution.py, replies.py), residency (worker/residency.py) and the cluster adverts
and load claims (cluster.py); their events go back to the driver. Idle, it sleeps until an
arrival event, a timer the policy asked for, a queue left to a peer's first take coming due, or
the next count.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any, Awaitable, Callable, Iterable, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetbatch.sdk import failures
from jetbatch.sdk.connection import unreadable_messages
from jetbatch.sdk.protocol import ErrorCode, Priority, SidecarReport, Subjects

from ..cluster import ClusterView
from ..config import Config, ConfigError
from ..handlers import create_handler, resolve_device
from ..handlers.modules import warm_start
from ..errors import TRANSPORT_ERRORS
from ..pulling import Puller
from ..recording import FlightRecorder
from ..core import (
    Fetch,
    Fetched,
    Hold,
    LoadDue,
    LoadModel,
    ModelRules,
    Reap,
    Recount,
    Sleep,
    Started,
    Turn,
    Unload,
    WaitFree,
    WorkerCore,
)
from ..policy import BatchWindow, cannot_finish, listens, make_policy, visible_models
from ..replies import Answer, Replier, settle
from ..status import serve_status
from ..runtime import retry_startup
from ..streams import StreamSetupError, ensure_model_consumer, ensure_model_consumers, ensure_streams, model_consumer_name, progress_interval_s
from ..telemetry import LoadRecord, WorkerTelemetry
from .batching import Batcher
from .pullers import Pullers
from .coordination import Coordinator
from .counters import Counters
from .cancellations import Cancellations
from .execution import GIVE_BACK_DELAY_S, BatchRunner
from .slots import BatchReport, ModelTurn, Slot
from .state import LoopState
from .orphans import Orphans
from .quarantine import Quarantine
from .queues import RECHECK_S, ArrivalFeed, QueueView, empty_fetch, line_stored, missed_by
from . import view
from .residency import Residency, default_host_budget_bytes

__all__ = ["Worker"]

log = logging.getLogger("jetbatch.worker")
T = TypeVar("T")

# A count for requests given back with a delay is taken this long after they fall due (the server
# redelivers on its own timer): counted before, a fetch would miss them and hold the queue back
# for a recheck.
_DUE_MARGIN_S = 0.05
# An orphaned queue (worker/orphans.py) is answered this many requests a line a count, each fetch
# waiting at most this long (what the count said is stored is there at once).
ORPHAN_BATCH = 64
ORPHAN_FETCH_S = 0.5
ORPHAN_WARN_EVERY_S = 60.0


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
        self.device = resolve_device(config.worker.device)
        try:
            self.policy = make_policy(config.worker.policy, **config.worker.policy_options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"worker.policy: {exc}") from None
        # The core holds every rule the worker decides by and the state they read (core/turns.py);
        # this loop turns NATS and torch into its events and carries out its actions, as the
        # simulator does with its clock. ``record``: the flight recorder (``--record``).
        self.core = WorkerCore(_started(config, self.worker_id), policy=self.policy, recorder=record)
        self.recorder = record
        self.driver = self.core.driver  # read: estimates, demand, the cluster share
        self.costs = self.core.costs
        self.budget = self.core.budget
        self.slots = _make_slots(config, self.device)
        # Counters; what the control plane's steps cost here is added by worker/counters.py (the
        # scale bench tells the simulator this deployment's costs from them: Control.measured).
        self.stats = Counters("batches", "requests", "loads", "loads_cold", "loads_warm", "load_us", "evictions", "decisions", "decision_us", "models_shown")
        self.telemetry = WorkerTelemetry(self.worker_id, self.subjects.prefix)
        self._stopping = anyio.Event()
        self._ready = anyio.Event()
        self._wake = anyio.Event()  # an arrival, or a stop: the idle loop looks again
        self._holding: Puller | None = None  # the puller of a hold under way (_wake_up ends it)
        self.state = LoopState(started_at=time.time())
        self.http_address = ""  # where its endpoints listen (set by runtime.serve_sidecar), for the report
        # Loads and batches never overlap on the device; a free lock is taken without yielding.
        self._device_lock = anyio.Lock(fast_acquire=True)
        self.replier = Replier(nc, self.subjects, config.replies, reply_nc=reply_nc)
        self.quarantine = Quarantine(self.js, self.subjects, config.streams.max_deliver, replicas=config.streams.replicas)
        # A peer's take event counts until it settles, or for two heartbeats (its advert tells then).
        self.queues = QueueView(self.slots, peer_event_s=2 * config.worker.heartbeat_s)
        self.orphans = Orphans(config.worker.orphan_grace_s)
        # Callers that gave up early (their tasks cancelled): no load is paid for them.
        self.cancellations = Cancellations(nc, self.subjects, on_cancel=self._on_cancel, counters=self.stats)
        self.arrivals = ArrivalFeed(
            nc, self.subjects, self.slots, self.queues, on_arrival=self._wake_up, worker_id=self.worker_id, counters=self.stats,
            cancelled=self.cancellations.cancelled, audience=lambda: self.peers.heard(),
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
            on_settled=self._settled,
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
            on_load_failed=self._fail_queue,
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
                peer_timeout_s=config.worker.peer_timeout_s,
            )  # fmt: skip
        self.peers = Coordinator(
            cluster, worker_id=self.worker_id, slots=self.slots, queues=self.queues, residency=self.residency,
            driver=self.driver, budget=self.budget, counters=self.stats, heartbeat_s=config.worker.heartbeat_s, report=self.report,
        )  # fmt: skip
        self.telemetry.register_gauges(self.report, self.peers.reports_queues)

    def _note_trouble(self) -> None:
        self.peers.note_trouble()
        self.state.next_refresh = -math.inf  # count again at once: events may have been lost

    def _wake_up(self) -> None:
        self._wake.set()
        self.batcher.arrived()  # an open batch window counts again too
        if self._holding is not None:
            # Something else waits (another line's arrival): a hold ends now, not at its end.
            self._holding.interrupt()

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> anyio.Event:
        """Set once streams and consumers exist and the worker is pulling."""
        return self._ready

    def stop(self) -> None:
        """Ask for a graceful stop; :meth:`run` returns once in-flight work is drained."""
        self._stopping.set()
        self._wake.set()
        if self._holding is not None:
            self._holding.interrupt()

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
        return [f"model {name}: {slot.broken}" for name, slot in self.slots.items() if slot.broken]

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
        await self._refresh(time.time())

    async def _preload(self) -> None:
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
                await self._load(slot, (), reason="preload", for_backlog=False)
                if slot.resident or slot.broken is not None or time.monotonic() >= deadline:
                    break
                self.stats.add("preload_waits")
                await anyio.sleep(self.config.worker.heartbeat_s / 4)
            if not slot.resident and slot.broken is None:
                log.warning("not preloading %s: peers held its claim for %.0f s", slot.name, self.config.worker.startup_timeout_s)

    async def _warm_start(self) -> None:
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
        async with anyio.create_task_group() as starting:
            # torch's one-time set-up for the configured formats, beside the streams' set-up and
            # before ready: no model's first load pays it (nor teaches the estimator it).
            starting.start_soon(self._warm_start)
            await retry_startup(self._setup, timeout_s=self.config.worker.startup_timeout_s, what=f"worker {self.worker_id}")
        await self.peers.advertise()
        status_sub = await serve_status(self.nc, self.subjects, self.report, self.config.reply_policy, out=self.replier.out)
        await self._preload()
        log.info("worker %s serving %s on %s", self.worker_id, ", ".join(self.slots), self.device)
        self._ready.set()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                if self.peers.cluster is not None:
                    tg.start_soon(self.peers.advertise_forever)
                    tg.start_soon(self.peers.cluster.watch)
                    tg.start_soon(self._orphans_loop)
                try:
                    await self._serve_loop(tg)
                finally:
                    # Let in-flight batches finish within the drain bound, then stop the heartbeat.
                    with anyio.move_on_after(self.config.worker.drain_timeout_s) as scope:
                        scope.shield = True
                        for slot in [s for s in self.slots.values() if s.in_flight]:
                            await slot.wait_in_flight_at_most(0)
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
                await self.cancellations.stop()
                await self.pullers.close(self.slots.values())

    def report(self) -> SidecarReport:
        """What this worker reports: its status (the status subject, ``jetbatch status``) and its
        advert to its peers (the cluster bucket)."""
        return view.build_report(
            worker_id=self.worker_id, slots=self.slots, queues=self.queues, residency=self.residency,
            costs=self.costs, budget=self.budget, in_flight=self.state.in_flight.by_model(self.subjects.model_from_subject),
            stats={
                **self.stats.snapshot(), **self.pullers.counts(self.slots.values()),
                "unreadable_messages": unreadable_messages(self.nc, self.replier.reply_nc),
                # Adverts under this worker's id that it did not put: another live worker shares it.
                "duplicate_id_adverts": self.peers.cluster.duplicate_adverts if self.peers.cluster is not None else 0,
            },
            started_at=self.state.started_at, valid_s=self.config.worker.peer_timeout_s, http=self.http_address,
        )  # fmt: skip

    def _turn(self, now: float) -> Turn:
        """What the core is told at a turn: the facts of the models a decision looks at
        (``policy.visible_models``), and which resident models are busy or computing."""
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
        on_device = [self.slots[n] for n in self.residency.resident_names()]
        return Turn(
            now=now, facts=facts,
            busy=[s.name for s in on_device if s.in_flight], computing=[s.name for s in on_device if s.computing],
            defer_until=defer_until if math.isfinite(defer_until) else None,
        )  # fmt: skip

    async def _refresh(self, now: float) -> None:
        """Count every queue (one call), then schedule the next count: every poll interval while
        anything waits or runs, every ``idle_refresh_s`` otherwise (arrivals are events)."""
        not_ours = self.peers.not_ours(now)
        ok = await self.queues.refresh(
            self.js, self.subjects, now, not_ours=not_ours,
            mine=lambda: self.state.in_flight.by_model(self.subjects.model_from_subject),
            mine_bulk=lambda: self.state.in_flight.by_model(self._bulk_model),
        )  # fmt: skip
        await self._hand_back_leftovers()
        if ok and (self.queues.unregistered or self.orphans.watched) and self.peers.knows_peers(now):
            # Only when something is stored for a model this worker does not register (rare):
            # the peers' model sets are not gathered on every count. And only with a fresh view
            # of the peers: without one (coordination off, the bucket silent) a live peer's
            # models would look unregistered.
            registered = set(self.slots) | self.peers.registered_by_peers(now)
            due = self.orphans.due(self.queues.unregistered, registered, now)
            self._warn_orphans(now)
            if due:
                # Answered by their own task: its fetches and stores must not hold the serve loop.
                self.state.orphans_due.update(due)
                self.state.orphans_wake.set()
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

    def _warn_orphans(self, now: float) -> None:
        """Say at once, and once a minute after, which models have requests stored that no live
        worker registers: they wait for one (or for ``worker.orphan_grace_s``)."""
        waiting = self.orphans.unregistered_since()
        if not waiting or now - self.state.orphans_warned_at < ORPHAN_WARN_EVERY_S:
            return
        self.state.orphans_warned_at = now
        grace = self.orphans.grace_s
        then = "never answered by a worker that does not register them" if grace is None else f"answered unknown_model after {grace:g} s"
        for model, since in sorted(waiting.items()):
            log.warning(
                "model %s: %d requests stored for %.0f s and no live worker registers it (%s)",
                model, self.queues.unregistered.get(model, 0), now - since, then,
            )  # fmt: skip

    async def _orphans_loop(self) -> None:
        """Answer the queues :class:`Orphans` found due, a model at a time, off the serve loop."""
        while True:
            await self.state.orphans_wake.wait()
            self.state.orphans_wake = anyio.Event()
            due, self.state.orphans_due = sorted(self.state.orphans_due), set()
            for model in due:
                try:
                    await self._answer_orphans(model)
                except Exception as exc:  # noqa: BLE001 - the next count tries again; serving goes on
                    log.warning("answering model %s's orphaned queue failed: %r", model, exc)

    async def _answer_orphans(self, model: str) -> None:
        """Answer ``unknown_model`` to a batch of each line of ``model``'s queue that holds
        requests, which no live worker registers (worker/orphans.py): through its shared consumer
        (made if it expired), so workers doing the same at once answer each request once. One
        batch a line a count: a deep queue drains over a few counts."""
        bulk = self.queues.unregistered_bulk.get(model, 0)
        lines = {Priority.INTERACTIVE: self.queues.unregistered.get(model, 0) - bulk, Priority.BATCH: bulk}
        for priority in [p for p, n in lines.items() if n > 0]:  # an empty line's fetch would wait its whole timeout
            consumer = model_consumer_name(model, priority)
            try:
                await ensure_model_consumer(self.js, self.subjects, self.config.streams, model, priority)
                psub = await self.js.pull_subscribe_bind(consumer, stream=self.subjects.models_stream)
            except TRANSPORT_ERRORS + (StreamSetupError,) as exc:
                log.debug("orphaned queue %s: no consumer: %r", consumer, exc)
                continue
            try:
                try:
                    msgs = await psub.fetch(ORPHAN_BATCH, timeout=ORPHAN_FETCH_S)
                except TRANSPORT_ERRORS + failures.TIMEOUTS:
                    continue
                now = time.time()
                requests = [self.runner.parse(m, now) for m in msgs]
                for r in requests:
                    r.action = "term"
                    r.answer = Answer.failure(
                        r.meta, ErrorCode.UNKNOWN_MODEL,
                        f"no worker serves model {model!r} (none has registered it for {self.orphans.grace_s or 0:g} s)", {},
                    )  # fmt: skip
                if requests:
                    log.warning("answered %d requests for model %s unknown_model: no live worker registers it", len(requests), model)
                    await self.runner.finish(model, requests)
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        await psub.unsubscribe()
                    except TRANSPORT_ERRORS + (ValueError,):
                        pass

    async def _hand_back_leftovers(self, leaving: Iterable[str] | None = None) -> None:
        """Requests delivered to a pull after its fetch returned wait in that model's puller for
        its next fetch, which a model no longer resident here may not get: they go back to the
        queue (nak) for whoever serves it now, not after their ack wait. ``leaving``: only these
        models', resident or not (a load's victims, before it starts: a held pull's last
        delivery can come a millisecond after its window closed, ``Puller.fill``)."""
        if leaving is None:
            await self.pullers.hand_back(slot for slot in self.slots.values() if not slot.resident)
        else:
            await self.pullers.hand_back(self.slots[n] for n in leaving)

    def _bulk_model(self, subject: str) -> str | None:
        """The model of a batch-line subject (None for an interactive one)."""
        queue = self.subjects.queue_from_subject(subject)
        return queue[0] if queue is not None and queue[1] is Priority.BATCH else None

    def _on_cancel(self, key: tuple[str, str]) -> None:
        if self.queues.cancel(key):
            self._wake_up()  # a queue may now be abandoned, or worth less

    # --- the loop --------------------------------------------------------------------------

    async def _serve_loop(self, tg: anyio.abc.TaskGroup) -> None:
        execute: dict[type, Callable[[anyio.abc.TaskGroup, Any], Awaitable[None]]] = {
            Unload: self._do_unload, Hold: self._do_hold, Recount: self._do_recount, WaitFree: self._do_wait_free,
            Fetch: self._do_fetch, LoadModel: self._do_load, Sleep: self._do_sleep,
        }  # fmt: skip
        while not self._stopping.is_set():
            await self._follow_arrivals()
            now = time.time()
            departed = self.peers.departed(now)
            if departed:
                # What the peer held comes back with no arrival event: at once if it stopped and
                # gave it back, when the ack wait ends if it was killed. A count finds it then,
                # whatever the poll interval (a minute's poll left a killed peer's requests that long).
                self.queues.forget_peers(departed)
                self.state.count_at(now, now + self.config.streams.ack_wait_s)
            if now >= self.state.next_count():
                await self._refresh(now)
                now = time.time()
            started = time.perf_counter()
            # An arrival counted from here on is in no state this turn sees: it wakes an idle,
            # and ends a hold (even one about to start).
            if self._wake.is_set():
                self._wake = anyio.Event()
            turn = self._turn(now)
            action = self.core.handle(turn)
            # What deciding costs (the simulator charges it too: Workload.control, bench/scale.py).
            self.stats.add("decisions")
            self.stats.add("decision_us", int((time.perf_counter() - started) * 1e6))
            self.stats.add("models_shown", len(turn.facts))
            await execute[type(action)](tg, action)

    # --- the core's actions, carried out ---------------------------------------------------------

    async def _do_unload(self, tg: anyio.abc.TaskGroup, action: Unload) -> None:
        for name in action.models:
            await self.residency.evict(self.slots[name], reason="idle")
        await self._hand_back_leftovers(action.models)

    async def _do_hold(self, tg: anyio.abc.TaskGroup, action: Hold) -> None:
        held = self.slots[action.model]
        if await self._consumer(held):
            await self._serve(tg, held, Fetch(held.name, action.max_items, "hold"), hold_s=action.hold_s)
        else:
            self.core.handle(Fetched(held.name, 0, held=True))

    async def _do_recount(self, tg: anyio.abc.TaskGroup, action: Recount) -> None:
        await self._follow_arrivals()  # the core stopped serving it: listened to and counted again

    async def _do_wait_free(self, tg: anyio.abc.TaskGroup, action: WaitFree) -> None:
        for name in action.models:
            await self.slots[name].wait_model_free()

    async def _do_fetch(self, tg: anyio.abc.TaskGroup, action: Fetch) -> None:
        slot = self.slots[action.model]
        if not await self._consumer(slot):
            await self._idle(time.time() + self.config.worker.poll_interval_ms / 1000.0)
            return
        self.residency.prefetch(tg, exclude=slot.name, backlog_of=self.peers.share, candidates=sorted(self.queues.waiting))
        await self._serve(tg, slot, action)

    async def _do_load(self, tg: anyio.abc.TaskGroup, action: LoadModel) -> None:
        await self._follow_arrivals(leaving=True)  # a load holds the worker for its whole time
        await self._hand_back_leftovers(action.evict)
        await self._load(self.slots[action.model], tuple(action.evict), reason=action.reason)
        # And what a victim's pull requests still open at the hand-back (a window's stays open
        # past its close) delivered during the load: back now, not at the next refresh's
        # hand-back of models not on the device.
        await self._hand_back_leftovers(action.evict)

    async def _do_sleep(self, tg: anyio.abc.TaskGroup, action: Sleep) -> None:
        await self._follow_arrivals(leaving=True)  # an idle worker wakes on arrival events
        await self._idle(math.inf if action.until is None else action.until)

    async def _follow_arrivals(self, *, leaving: bool = False) -> None:
        """Listen to the arrivals of a line of the model this worker drains only while it needs
        them (``policy/interest.py``): not the interactive line of the model whose batches it
        serves (they fill from held pulls), nor a deep line (each fetch counts it). ``leaving``:
        the worker is about to load, or to idle, and drains nothing meanwhile."""
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
            stored = line_stored(await self.js.stream_info(self.subjects.models_stream, subjects_filter=subject), subject)
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

    async def _idle(self, until: float) -> None:
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

    async def _serve(self, tg: anyio.abc.TaskGroup, slot: Slot, decision: Fetch, *, hold_s: float | None = None) -> None:
        # Pipelining: gather the next batch while the previous one computes, and compute while
        # earlier answers are stored (a bounded number: policy/window.py).
        await slot.wait_pipeline_room()
        max_items = decision.max_items  # within the model's max batch size (the core's rule)
        if decision.before is not None:
            msgs = await self.batcher.gather_before(slot, max_items, decision.before)
        elif hold_s is not None and slot.psub is not None:
            # Another line's arrival ends the hold at once (_wake_up), as one counted since the
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
            await self._found_nothing(slot)
            return
        slot.missed_fetch = False
        self.state.in_flight.add(msgs)
        slot.start_batch()
        loaded, load_record = self.residency.first_batch(slot)
        tg.start_soon(self._run_batch, slot, msgs, loaded, decision.reason, load_record)
        # Before the batch can settle (peers apply a take before its settle; the publish only
        # queues it for the socket).
        await self.arrivals.took(slot.name, len(msgs))
        # The batch starts (its checks and decoding, up to its forward pass) before this loop
        # decides again: deciding first held a lone request's batch back ~0.15 ms.
        await anyio.lowlevel.checkpoint()

    async def _found_nothing(self, slot: Slot) -> None:
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
                if info.num_pending and not slot.missed_fetch:
                    self.queues.fetched(slot, 0, int(info.num_pending), bulk=line is Priority.BATCH)
                pending += int(info.num_pending or 0)
                ack_pending += int(info.num_ack_pending or 0)
        except TRANSPORT_ERRORS:
            self._held_back(slot)
            return
        # In our own puller: delivered after the fetch returned (its pull request ended late: a
        # busy host), so counted as unacked elsewhere. Held back as a peer's, they waited a whole
        # recheck (1.6 s in bench.overhead's classified runs).
        in_our_puller = any(p is not None and p.buffered for p in (slot.psub, slot.bulk_psub))
        why = empty_fetch(pending=pending, ack_pending=ack_pending, missed_before=slot.missed_fetch, in_our_puller=in_our_puller)
        now = time.time()
        if why == "fetch again":
            slot.missed_fetch = True
        elif why == "in our puller":
            return
        elif why == "unreachable" and now - slot.unreachable_seen_at > RECHECK_S:
            # Held back for good only if the stream still stores them and a fetch on that count
            # misses them again: the count itself may be what is wrong (arrival and take events
            # applied out of order after a paused process counted 60 requests that were never
            # there, and the hold was advertised to peers).
            slot.unreachable_seen_at = now
            await self._refresh(now)
        else:
            if why == "unreachable" and now - slot.unreachable_warned_at > 60.0:
                # Once a minute a model at most: forged arrival events can bring this on at will.
                slot.unreachable_warned_at = now
                log.warning("%s: %d requests stored that its consumer will never deliver: not counted until they are gone", slot.name, slot.backlog)
            self._held_back(slot, unreachable=why == "unreachable")

    def _held_back(self, slot: Slot, *, unreachable: bool = False) -> None:
        """Hold back what a fetch could not get (``QueueView.found_empty``), and count again when
        the hold ends: a redelivery brings no arrival event, and the next count on the schedule
        may be a poll interval (or a minute) away."""
        self.queues.found_empty(slot, time.time(), self.config.streams.ack_wait_s, unreachable=unreachable)
        if math.isfinite(slot.hold_until) and slot.hold_until > time.time():
            self.state.count_at(slot.hold_until)

    async def _run_batch(self, slot: Slot, msgs: list[Msg], loaded: bool, reason: str, load_record: LoadRecord | None) -> None:
        # The model's share (``max_concurrent_batches``) is taken for the forward passes only:
        # the batch is checked and decoded while the one before still computes, and stores its
        # answers while the next one computes.
        # The batch starts here (its task runs before this loop's next gather): when its window
        # closed on its timer, how late after it teaches the lead of later windows.
        self.batcher.started()
        turn = ModelTurn(slot)
        try:
            await self.runner.run(slot, msgs, loaded, reason, turn, load_record)
        except Exception:  # noqa: BLE001 - a bug in one batch must not end the sidecar
            turn.release()
            log.exception("batch of %s failed; its requests are redelivered", slot.name)
            for m in msgs:
                await settle(m, "nak", delay_s=GIVE_BACK_DELAY_S)
            self._given_back(GIVE_BACK_DELAY_S)
        finally:
            turn.release()
            slot.end_batch()
            with anyio.CancelScope(shield=True):
                await self._settled(slot, msgs)

    async def _settled(self, slot: Slot, msgs: list[Msg], back_in_s: float | None = None) -> None:
        """Some of a batch's messages were settled (``BatchRunner.finish``), or the whole batch
        is done: no longer held here, and the peers are told (once per message). ``back_in_s``:
        some were given back, to be delivered again that much later."""
        if back_in_s is not None:
            self._given_back(back_in_s)
        n = self.state.in_flight.settled(msgs)
        if n:
            await self.arrivals.settled(slot.name, n)

    def _given_back(self, delay_s: float) -> None:
        """Requests were given back (nak) to be delivered again after ``delay_s``: no arrival event
        says so, and the next count on the schedule may be a poll interval (or a minute) away,
        so count just after they fall due."""
        self.stats.add("given_back")
        self.state.count_at(time.time() + delay_s + _DUE_MARGIN_S)

    # --- loads -----------------------------------------------------------------------------

    async def _load(self, slot: Slot, evict: tuple[str, ...], *, reason: str, for_backlog: bool = True) -> None:
        if for_backlog and not slot.resident:
            # Asked just before paying: once the models to evict are free (their last batch may
            # run for a while), is anyone still waiting? If every caller of this queue has given
            # up (its deadline, the SDK's timeout, passed), answer them without the load (the
            # simulator applies the same rule).
            for name in evict:
                await self.slots[name].wait_model_free()
            due = LoadDue(slot.name, slot.tier, time.time(), _known_waiting(slot), peer_serves=self.peers.served().get(slot.name, 0.0) > 0)
            verdict = self.core.handle(due)
            if isinstance(verdict, Reap):
                await self._reap(slot, verdict.horizon_s)
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
            async with anyio.create_task_group() as tg:
                # The model's consumer is made while the model loads: on a replicated stream it is
                # a Raft group, tens of milliseconds that need not add to the load.
                tg.start_soon(self._consumer, slot)
                loaded = await self.residency.load(slot, evict, reason=reason)
            if loaded:
                # An empty fetch from before this load says nothing of the queue now: the first
                # one after it is fetched again, not held back as a second in a row.
                slot.missed_fetch = False
        finally:
            self.residency.announce_loading(None)
            # Resident now: peers count our drain at once, before the claim is given back.
            await self.peers.loaded(claimed)

    async def _reap(self, slot: Slot, horizon_s: float = 0.0) -> None:
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

    async def _fail_queue(self, slot: Slot, message: str) -> None:
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
            self._held_back(slot)
            return 0
        await self.arrivals.took(slot.name, len(msgs))
        now = time.time()
        answered, back = [], []
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

    # --- state -----------------------------------------------------------------------------

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


def _make_slots(config: Config, device: Any) -> dict[str, Slot]:
    """One slot per configured model: its handler (aimed at ``device``), batch window and limit
    of concurrent batches."""
    slots: dict[str, Slot] = {}
    for name, mcfg in config.models.items():
        handler = create_handler(name, mcfg)
        handler.target_device = device
        slots[name] = Slot(
            name=name,
            config=mcfg,
            handler=handler,
            window=BatchWindow(mcfg.max_batch_size, mcfg.max_delay_s),
            limiter=anyio.CapacityLimiter(mcfg.max_concurrent_batches),
        )
    return slots


def _known_waiting(slot: Slot) -> list[tuple[float | None, bool]] | None:
    """Each waiting request's deadline and whether its caller cancelled it; None unless every
    waiting request is known (one never seen arriving may be wanted)."""
    if slot.backlog > slot.known or slot.unknown_head_at is not None:
        return None
    return [(d, key in slot.cancelled_keys) for _, d, key, _ in (*slot.known_times, *slot.known_bulk)]


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
