"""A discrete-event simulator of workers serving shared model queues: the second executor of
the worker core (``core.WorkerCore``), beside the live worker.

Each simulated worker has its own core, seeded with the *configured* costs and fed the *true*
(optionally noisy) load and batch times it observes, as the live worker's is; its policy never
sees the true costs. At each turn the simulator builds the core's ``Turn`` from its queues
(``simulator/facts.py``: the same visibility, listening, share and first-taker rules as live) and
carries out the action the core answers (``simulator/execution.py`` for batches, loads and the
warm tier), at simulated times, on the workload's cost model. What it keeps of its own is what a
simulation must: the event heap and the clock, when a worker hears of an arrival
(``arrival_delay_s`` after the store), how long a hold waits, and what the control plane costs
(``Workload.control``: each decision's CPU time, per model shown; each load's overhead, claims
and adverts; each batch's fetch and answers), which a deployment's own workers measure
(``worker/counters.py``, ``Control.measured``). Where live and simulated differ on purpose is
listed in docs/architecture.md.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from typing import Any, Callable

from ..recording import FlightRecorder
from ..core import (
    Fetch,
    Fetched,
    Hold,
    LoadModel,
    ModelRules,
    Recount,
    Sleep,
    Started,
    Unload,
    WaitFree,
    WaitRoom,
    WorkerCore,
)
from ..policy import (
    BatchWindow,
    Policy,
    make_policy,
)
from ..tenancy import TenantShares
from .execution import SimExecution
from .facts import WorkerViews
from .queues import Queue, Request
from .workers import SimWorker
from .report import SimResult
from .workloads import Workload, WorkloadError

__all__ = ["simulate", "simulate_policies"]






class Simulation:
    def __init__(
        self, workload: Workload, make: Callable[[], Policy], max_events: int, recorder: FlightRecorder | None = None, options: dict[str, Any] | None = None
    ) -> None:
        self.w = workload
        self.options = dict(workload.policy_options) if options is None else options  # what the policy was built with
        self.recorder = recorder
        self.views = WorkerViews(self)  # what a worker knows at a turn
        self.execution = SimExecution(self)  # batches, loads and the warm tier, carried out
        # Each action of the core, carried out here (the same actions the live worker carries out).
        self._execute: dict[type, Callable[[SimWorker, Any, float], None]] = {
            Unload: self._unload, Hold: self._hold, Recount: self._recount, WaitFree: self._wait_free, WaitRoom: self._wait_room,
            Fetch: self._fetch, LoadModel: self._load, Sleep: self._sleep,
        }  # fmt: skip
        self.max_events = max_events
        self.rng = random.Random(workload.seed)
        # The control plane's spread draws from its own stream: the device noise stays as it was.
        self.control_rng = random.Random(workload.seed + 7919)
        self.queues: dict[str, Queue] = {name: Queue() for name in workload.models}
        # Classes are told apart only when the workload gives them, or tenants' shares may move a
        # request to the batch line (else all are interactive).
        self.classes = bool(workload.interactive) or workload.tenancy is not None
        # Admission between tenants, by the classifier's rule (tenancy.py); and the line each
        # arrival joined (its class, or the batch line it was moved to).
        self.shares = TenantShares(workload.tenancy) if workload.tenancy is not None else None
        self.urgent_of: list[bool | None] = []
        self.tenant_waiting: dict[str, int] = {}
        # Callers that cancel send a notice, which wakes the live worker as an arrival does.
        self.cancels = any(m.cancel_after_s is not None for m in workload.models.values())
        self.windows = {name: BatchWindow(m.max_batch_size, m.max_delay_s) for name, m in workload.models.items()}
        self.arrivals = list(workload.arrivals)
        self.next_arrival = 0
        self.arrival_log: deque[Request] = deque()
        self.workers = [self._worker(i, make()) for i in range(max(1, workload.workers))]
        self.by_id = {w.id: w for w in self.workers}
        self.result = SimResult(policy=self.workers[0].policy.name)
        self.events: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.t = 0.0
        self.served_ids: set[int] = set()
        self.nonempty: set[str] = set()  # models with requests queued
        self.consumers: dict[str, float] = {}  # model -> when its shared consumer was last used

    def _worker(self, index: int, policy: Policy) -> SimWorker:
        # Each worker's own models (Workload.shards: its config lists only those, as live).
        serves = dict.fromkeys(list(self.w.models)[index :: max(1, self.w.workers)]) if self.w.shards else None
        # Seeded with the *configured* costs; the true ones only reach it as measurements.
        models = {
            name: ModelRules(
                max_batch_size=m.max_batch_size,
                load_cost_s=m.configured_load_cost_s if m.configured_load_cost_s is not None else m.load_cost_s,
                batch_cost_s=m.configured_batch_cost_s if m.configured_batch_cost_s is not None else m.batch_cost_s,
                item_cost_s=m.configured_item_cost_s if m.configured_item_cost_s is not None else m.item_cost_s,
                memory_bytes=m.memory_bytes,
                idle_unload_s=m.idle_unload_s,
                pin=m.pin,
                max_concurrent_batches=m.max_concurrent_batches,
            )
            for name, m in self.w.models.items()
            if serves is None or name in serves
        }
        started = Started(
            policy=policy.name, options=self.options, models=models,
            max_bytes=self.w.budget.max_bytes, max_models=self.w.budget.max_models, worker=f"w{index}",
        )  # fmt: skip
        worker = SimWorker(index, WorkerCore(started, policy=policy, recorder=self.recorder if index == 0 else None), serves=serves)
        if index == 0:
            worker.resident = [name for name in self.w.resident_at_start if worker.registers(name)]
        return worker

    # --- the event loop -------------------------------------------------------------------------

    def wake(self, worker: SimWorker, at: float, kind: str = "decide") -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, worker.index, kind))

    def admit(self, upto: float) -> None:
        """Queue the arrivals a worker knows of by ``upto`` (stored ``arrival_delay_s`` earlier)."""
        upto -= self.w.control.arrival_delay_s
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival][0] <= upto + 1e-12:
            at, model = self.arrivals[self.next_arrival]
            deadline = self.w.models[model].deadline_s
            urgent = self.w.interactive[self.next_arrival] if self.w.interactive else True
            cancel = self.w.models[model].cancel_after_s
            tenant = self.w.tenants[self.next_arrival] if self.w.tenants else ""
            req = Request(self.next_arrival, model, at, at + deadline if deadline is not None else None, urgent, at + cancel if cancel is not None else math.inf, tenant)
            self.next_arrival += 1
            if not self._admitted(req):
                self.urgent_of.append(None)  # answered at admission: no line heard of it
                continue
            self.urgent_of.append(req.interactive)
            self.queues[model].append(req)
            self.nonempty.add(model)
            self.arrival_log.append(req)

    def _admitted(self, req: Request) -> bool:
        """The classifier's admission of a tenant's request (tenancy.py): refused by a quota
        (answered ``Overloaded``, never queued), or moved to the batch line beyond its fair share."""
        if req.tenant:
            self.result.offered_by_tenant[req.tenant] = self.result.offered_by_tenant.get(req.tenant, 0) + 1
        if self.shares is None:
            self.tenant_waiting[req.tenant] = self.tenant_waiting.get(req.tenant, 0) + 1
            return True
        verdict = self.shares.admit(req.tenant or None, req.arrival, interactive=req.interactive, waiting=self.tenant_waiting.get(req.tenant, 0))
        if verdict.refused is not None:
            self.result.refused_by_tenant[req.tenant] = self.result.refused_by_tenant.get(req.tenant, 0) + 1
            self.served_ids.add(req.id)
            self.result.served_ids.append(req.id)
            return False
        if verdict.demoted:
            req.interactive, req.excess = False, True
            self.result.demoted_by_tenant[req.tenant] = self.result.demoted_by_tenant.get(req.tenant, 0) + 1
        self.tenant_waiting[req.tenant] = self.tenant_waiting.get(req.tenant, 0) + 1
        return True

    def next_arrival_at(self) -> float:
        """When the next arrival becomes known to the workers."""
        if self.next_arrival >= len(self.arrivals):
            return math.inf
        return self.arrivals[self.next_arrival][0] + self.w.control.arrival_delay_s

    def run(self) -> SimResult:
        if self.arrivals:
            self.result.offered_s = max(self.w.window_s, 1e-9)
            half = self.result.offered_s / 2
            self.result.arrivals_second_half = sum(1 for at, _ in self.arrivals if half <= at < self.result.offered_s)
        for worker in self.workers:
            self.wake(worker, 0.0)
        events = 0
        while self.events:
            events += 1
            if events > self.max_events:
                raise RuntimeError(f"simulation of {self.result.policy} did not finish within {self.max_events} events")
            at, _, index, kind = heapq.heappop(self.events)
            self.t = max(self.t, at)
            self.admit(self.t)
            worker = self.workers[index]
            if kind.startswith("done:"):
                self.execution.finish(worker, kind)
                continue
            if self.t < worker.busy_until - 1e-12:
                continue  # a stale wake-up while busy
            if self.all_done():
                continue
            self.step(worker)
        self.result.makespan_s = self.t
        return self.result

    def all_done(self) -> bool:
        return self.next_arrival >= len(self.arrivals) and not any(self.queues.values())

    # --- one decision of one worker -------------------------------------------------------------

    def step(self, worker: SimWorker) -> None:
        core = worker.core
        if worker.gathering is not None:
            # A batch window under way: it goes on (to its close, or full) with no turn between.
            fetch, from_hold = worker.gathering
            worker.gathering = None
            self.execution.serve(worker, fetch, held=from_hold)
            return
        if worker.holding_until > -math.inf and core.serving is not None:
            # Carrying out a Hold: it ends with the served model's first interactive request,
            # whose batch it serves with no turn in between; with another line's first arrival
            # (an event the worker hears), or empty at its end.
            held = core.serving
            if self.queues[held].urgent and held in worker.resident:
                worker.holding_until = -math.inf
                self.execution.serve(worker, Fetch(held, self.w.models[held].max_batch_size, "hold"), held=True)
                return
            # A line it does not listen to sends no event: the held model's interactive one, and
            # any it drains deep (worker.quiet).
            interrupted = any(
                line != (held, False) and line not in worker.quiet
                for line in ((self.arrivals[i][1], self.classes and not self.urgent_of[i]) for i in range(worker.hold_seen, self.next_arrival) if self.urgent_of[i] is not None)
            ) or self.views.next_cancel(worker, worker.hold_checked) <= self.t + 1e-12  # fmt: skip
            worker.hold_seen = self.next_arrival
            worker.hold_checked = self.t
            if self.t < worker.holding_until - 1e-12 and not interrupted:
                self.wake(worker, min(self.next_arrival_at(), worker.holding_until, self.views.next_cancel(worker, self.t)))
                return
            # Empty (or cut short): the worker listens to the line again and counts it.
            worker.holding_until = -math.inf
            core.handle(Fetched(held, 0, held=True))
            worker.quiet.pop((held, False), None)
            self.wake(worker, self.t + self.control_s("count_line_s"))
            return
        self.execution.settle(worker)
        turn = self.views.turn(worker)
        action = core.handle(turn)
        # The decision's own CPU time delays what it starts, as it does live.
        cost_s = self.w.control.decision_cost_s(len(turn.facts))
        self._execute[type(action)](worker, action, cost_s)

    def _unload(self, worker: SimWorker, action: Unload, cost_s: float) -> None:
        for name in action.models:
            self.execution.evict(worker, name)
            self.result.idle_unloads += 1
        self.wake(worker, self.t)

    def _hold(self, worker: SimWorker, action: Hold, cost_s: float) -> None:
        worker.holding_until = self.t + cost_s + action.hold_s
        worker.hold_seen = self.next_arrival
        worker.hold_checked = self.t
        self.wake(worker, min(max(min(self.next_arrival_at(), self.views.next_cancel(worker, self.t)), self.t + cost_s), worker.holding_until))

    def _recount(self, worker: SimWorker, action: Recount, cost_s: float) -> None:
        # One count of the line (a consumer-info round trip) before the next turn.
        worker.quiet.pop((action.model, False), None)
        self.wake(worker, self.t + cost_s + self.control_s("count_line_s"))

    def _wait_free(self, worker: SimWorker, action: WaitFree, cost_s: float) -> None:
        self.wake(worker, max(self.t, worker.busy_until))  # nothing computes at a simulated turn

    def _wait_room(self, worker: SimWorker, action: WaitRoom, cost_s: float) -> None:
        # Only answers being stored fill a pipeline here: the first of them to be stored.
        self.wake(worker, max(self.t, min(worker.answering.get(action.model) or [self.t])))

    def _fetch(self, worker: SimWorker, action: Fetch, cost_s: float) -> None:
        self.execution.serve(worker, action, cost_s)

    def _load(self, worker: SimWorker, action: LoadModel, cost_s: float) -> None:
        worker.quiet.clear()  # a worker that loads listens to every arrival
        self.execution.load(worker, action, cost_s)

    def _sleep(self, worker: SimWorker, action: Sleep, cost_s: float) -> None:
        worker.quiet.clear()  # an idle worker wakes on every arrival
        self.idle(worker, action)

    def idle(self, worker: SimWorker, action: Sleep) -> None:
        nxt = self.next_arrival_at()
        if any(self.queues.values()):
            # An arrival, a cancel notice, or the core's own deadline wakes it.
            until = math.inf if action.until is None else action.until
            self.wake(worker, max(min(until, nxt, self.views.next_cancel(worker, self.t)), self.t + 1e-6))
        elif nxt < math.inf:
            self.wake(worker, max(min(nxt, worker.core.idle_wake), self.t))
        # else: nothing left to arrive and nothing queued: this worker is done (an idle unload
        # then would change nothing measured)

    def control_s(self, name: str) -> float:
        """One draw of the control-plane cost ``name``: its mean, spread by ``Control.cv``."""
        mean = float(getattr(self.w.control, name))
        cv = self.w.control.cv.get(name, 0.0)
        if cv <= 0 or mean <= 0:
            return mean
        sigma = math.sqrt(math.log(1 + cv * cv))
        return mean * self.control_rng.lognormvariate(-sigma * sigma / 2, sigma)

    # --- the warm tier --------------------------------------------------------------------------

    def noisy(self, seconds: float) -> float:
        cv = self.w.noise_cv
        if cv <= 0 or seconds <= 0:
            return seconds
        sigma = math.sqrt(math.log(1 + cv * cv))
        return seconds * self.rng.lognormvariate(-sigma * sigma / 2, sigma)  # mean preserved


def simulate(
    workload: Workload, policy: Policy | str, *, max_events: int = 5_000_000, record: FlightRecorder | None = None, **options: Any
) -> SimResult:
    """Run ``workload`` under ``policy`` (a name, built with the workload's ``[policy]`` options
    and ``options``; or one instance, for a single worker). ``record``: the first worker's core
    is recorded there (``core/recorder.py``)."""
    if isinstance(policy, str):
        name = policy
        merged = {**workload.policy_options, **options}
        try:
            make_policy(name, **merged)  # the workload's [policy] options, checked before the run
        except TypeError as exc:
            raise WorkloadError(f"policy: {exc}") from None

        def make() -> Policy:
            return make_policy(name, **merged)
    else:
        merged = {}
        if workload.workers > 1:
            raise ValueError("several workers need a policy name (each worker gets its own instance)")
        instance = policy

        def make() -> Policy:
            return instance

    return Simulation(workload, make, max_events, record, merged).run()


def simulate_policies(workload: Workload, names: list[str]) -> list[SimResult]:
    """Each policy on the same workload (the same arrivals and noise)."""
    return [simulate(workload, name) for name in names]
