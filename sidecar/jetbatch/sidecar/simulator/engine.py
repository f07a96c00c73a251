"""A discrete-event simulator of workers serving shared model queues, driving exactly the policy
core the live worker drives: each worker's ``policy.Driver`` (its policy and cost estimator, the
events that feed them, the state it decides on), the batch window and the cluster share and
first-taker rules (``sidecar/policy``).

Each simulated worker has its own policy instance and its own :class:`CostEstimator`, seeded with
the *configured* costs and fed the *true* (optionally noisy) load and batch times it observes, as
the live worker is; the policy never sees the true costs. Workers share the queues; a worker
counts as backlog only what its peers would not drain within its own load time (the same
``effective_backlog`` rule), and a load another worker is already doing is not repeated (the live
worker's load claim). Evicted models stay warm within the host budget; with prefetch, the next
model is read into the warm tier while the device computes. Requests past their deadline when
their batch starts, or that the estimated batch time would carry past it, are not computed
(``deadline_exceeded``), as in the live worker.

The control plane costs what it costs live (``Workload.control``): each decision holds the worker
for its CPU time (fixed, and per model the policy is shown: ``policy.visible_models``, the same
rule as live), an arrival is known only ``arrival_delay_s`` after it is stored (and, while the
worker drains that queue deep, at its next take: ``policy.listens``), a caller's cancel notice
wakes the worker (ending a hold) as an arrival does, each load pays a
fixed overhead (the consumer check; with peers, the claims, adverts and release), and each
batch its fetch before compute and the storing and sending of its answers after it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..recording import FlightRecorder
from ..core import (
    BatchChecked,
    BatchDone,
    Evicted,
    Fetch,
    Fetched,
    Hold,
    LoadDue,
    Loaded,
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
from ..policy import (
    CostEstimator,
    BatchWindow,
    Driver,
    Policy,
    QueueFacts,
    Tier,
    batch_line_first,
    cannot_finish,
    deferred_until,
    drain_rps,
    first_taker_rank,
    has_room,
    listens,
    make_policy,
    pipeline_has_room,
    visible_models,
    warm_copy_value,
)
from .report import SimResult
from .workloads import SimModel, Workload, WorkloadError

__all__ = ["simulate", "simulate_policies"]


@dataclass(eq=False)
class _Request:
    id: int
    model: str
    arrival: float
    deadline: float | None
    interactive: bool = True
    cancel_at: float = math.inf  # when its caller cancels (the SDK's cancel notice), if ever

    def gone(self, now: float) -> bool:
        return self.cancel_at <= now


class _Queue:
    """One model's queue: two FIFO lines, interactive and batch, as the live worker's two
    consumers per model (``<prefix>.model.<m>`` and ``<prefix>.model.<m>.batch``). A batch takes
    the interactive line first."""

    __slots__ = ("urgent", "bulk", "run")

    def __init__(self) -> None:
        self.urgent: deque[_Request] = deque()
        self.bulk: deque[_Request] = deque()
        self.run = 0  # batches in a row that took the interactive line first while both waited

    def __len__(self) -> int:
        return len(self.urgent) + len(self.bulk)

    def __bool__(self) -> bool:
        return bool(self.urgent) or bool(self.bulk)

    def append(self, r: _Request) -> None:
        (self.urgent if r.interactive else self.bulk).append(r)

    @property
    def head(self) -> _Request:
        """The oldest waiting request (deadlines are arrival + a per-model constant: also the
        earliest deadline)."""
        if self.urgent and self.bulk:
            return self.urgent[0] if self.urgent[0].arrival <= self.bulk[0].arrival else self.bulk[0]
        return self.urgent[0] if self.urgent else self.bulk[0]

    @property
    def next(self) -> _Request:
        return self.urgent[0] if self.urgent else self.bulk[0]

    def pop(self, bulk_first: bool = False) -> _Request:
        if bulk_first and self.bulk:
            return self.bulk.popleft()
        return self.urgent.popleft() if self.urgent else self.bulk.popleft()

    def first(self, bulk_first: bool) -> _Request:
        """The request a batch taking ``bulk_first`` (``policy.batch_line_first``) takes first."""
        return self.bulk[0] if bulk_first and self.bulk else self.next

    def count_batch(self, bulk_first: bool) -> None:
        """A batch formed while both lines waited went to one line first (the live rule's count)."""
        if self.urgent and self.bulk:
            self.run = 0 if bulk_first else self.run + 1

    def __iter__(self) -> Any:
        yield from self.urgent
        yield from self.bulk


@dataclass(eq=False)
class _Worker:
    """One simulated worker: its core (``core.WorkerCore``: every rule it decides by) and what the
    executor keeps to carry out the core's actions (the device, the warm tier, holds)."""

    index: int
    core: WorkerCore
    resident: list[str] = field(default_factory=list)  # in load order
    warm: dict[str, float] = field(default_factory=dict)  # model -> when it became warm
    busy_until: float = 0.0
    loading: str | None = None
    fresh: set[str] = field(default_factory=set)
    prefetching: tuple[str, float] | None = None  # (model, ready at)
    answering: dict[str, list[float]] = field(default_factory=dict)  # model -> when its batches' answers are stored
    # The lines (model, batch line?) of the drained model whose arrivals it does not listen to
    # (policy/interest.py), with each one's count as of its last take: what it sees, as live.
    quiet: dict[tuple[str, bool], int] = field(default_factory=dict)
    # A hold of the served model's next batch under way (until when; core.Hold).
    holding_until: float = -math.inf
    hold_seen: int = 0  # the arrivals known when the hold began, or last looked at: later ones may end it
    hold_checked: float = -math.inf  # when the hold last looked: cancel notices since may end it

    @property
    def id(self) -> str:
        return f"w{self.index}"

    @property
    def driver(self) -> Driver:
        return self.core.driver  # read: its demand and estimates, as the live worker reads them

    @property
    def policy(self) -> Policy:
        return self.core.driver.policy

    @property
    def costs(self) -> CostEstimator:
        return self.core.costs


class _Sim:
    def __init__(
        self, workload: Workload, make: Callable[[], Policy], max_events: int, recorder: FlightRecorder | None = None, options: dict[str, Any] | None = None
    ) -> None:
        self.w = workload
        self.options = dict(workload.policy_options) if options is None else options  # what the policy was built with
        self.recorder = recorder
        # Each action of the core, carried out here (the same actions the live worker carries out).
        self._execute: dict[type, Callable[[_Worker, Any, float], None]] = {
            Unload: self._unload, Hold: self._hold, Recount: self._recount, WaitFree: self._wait_free,
            Fetch: self._fetch, LoadModel: self._load, Sleep: self._sleep,
        }  # fmt: skip
        self.max_events = max_events
        self.rng = random.Random(workload.seed)
        # The control plane's spread draws from its own stream: the device noise stays as it was.
        self.control_rng = random.Random(workload.seed + 7919)
        self.queues: dict[str, _Queue] = {name: _Queue() for name in workload.models}
        # Classes are told apart only when the workload gives them (else all are interactive).
        self.classes = bool(workload.interactive)
        # Callers that cancel send a notice, which wakes the live worker as an arrival does.
        self.cancels = any(m.cancel_after_s is not None for m in workload.models.values())
        self.windows = {name: BatchWindow(m.max_batch_size, m.max_delay_s) for name, m in workload.models.items()}
        self.arrivals = list(workload.arrivals)
        self.next_arrival = 0
        self.arrival_log: deque[_Request] = deque()
        self.workers = [self._worker(i, make()) for i in range(max(1, workload.workers))]
        self.by_id = {w.id: w for w in self.workers}
        self.result = SimResult(policy=self.workers[0].policy.name)
        self.events: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.t = 0.0
        self.served_ids: set[int] = set()
        self.nonempty: set[str] = set()  # models with requests queued
        self.consumers: dict[str, float] = {}  # model -> when its shared consumer was last used

    def _worker(self, index: int, policy: Policy) -> _Worker:
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
            )
            for name, m in self.w.models.items()
        }
        started = Started(
            policy=policy.name, options=self.options, models=models,
            max_bytes=self.w.budget.max_bytes, max_models=self.w.budget.max_models, worker=f"w{index}",
        )  # fmt: skip
        worker = _Worker(index, WorkerCore(started, policy=policy, recorder=self.recorder if index == 0 else None))
        if index == 0:
            worker.resident = list(self.w.resident_at_start)
        return worker

    # --- the event loop -------------------------------------------------------------------------

    def wake(self, worker: _Worker, at: float, kind: str = "decide") -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, worker.index, kind))

    def admit(self, upto: float) -> None:
        """Queue the arrivals a worker knows of by ``upto`` (stored ``arrival_delay_s`` earlier)."""
        upto -= self.w.control.arrival_delay_s
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival][0] <= upto + 1e-12:
            at, model = self.arrivals[self.next_arrival]
            deadline = self.w.models[model].deadline_s
            urgent = self.w.interactive[self.next_arrival] if self.classes else True
            cancel = self.w.models[model].cancel_after_s
            req = _Request(self.next_arrival, model, at, at + deadline if deadline is not None else None, urgent, at + cancel if cancel is not None else math.inf)
            self.queues[model].append(req)
            self.nonempty.add(model)
            self.arrival_log.append(req)
            self.next_arrival += 1

    def next_cancel(self, worker: _Worker, after: float) -> float:
        """When, after ``after``, the first caller cancels a request ``worker`` knows to wait: the
        SDK's cancel notice wakes the live worker (``Worker._on_cancel``) when it names one it
        heard arrive, so not one on a line it does not listen to (``worker.quiet``, the served
        model's interactive line). Cancel times follow arrival order within a line (arrival +
        the model's ``cancel_after_s``)."""
        if not self.cancels:
            return math.inf
        first = math.inf
        for name in self.nonempty:
            q = self.queues[name]
            for bulk, line in ((False, q.urgent), (True, q.bulk)):
                if (name, bulk) in worker.quiet or (not bulk and name == worker.core.serving):
                    continue
                for r in line:
                    if r.cancel_at > after:
                        first = min(first, r.cancel_at)
                        break
        return first

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
                self.finish(worker, kind)
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

    def turn(self, worker: _Worker) -> Turn:
        """What ``worker`` knows now, as the core's :class:`Turn`."""
        # What the peers drain per model: a pass over their (few) resident models, not over all
        # models for each peer, so a decision stays cheap at 100 workers x 1000 models.
        served_by: dict[str, float] = {}
        for p in self.workers:
            if p is worker:
                continue
            for name in {*p.resident, *([p.loading] if p.loading else [])}:
                served_by[name] = served_by.get(name, 0.0) + _drain_rps(p, name, self.w.models[name])
        facts = []
        defer_until = math.inf
        core = worker.core
        for (name, bulk), seen in list(worker.quiet.items()):
            draining = name == core.current and name in worker.resident
            line = self.queues[name].bulk if bulk else self.queues[name].urgent
            filled = not bulk and name == core.serving
            if listens(listening=False, draining=draining, waiting=min(seen, len(line)), max_batch_size=self.w.models[name].max_batch_size, filled=filled):
                del worker.quiet[(name, bulk)]  # listening again: it sees the line's true count
        slots: dict[str, tuple[int, int]] | None = None  # made when a queue nobody holds needs it
        for name in self._visible(worker):
            m = self.w.models[name]
            q = self.queues[name]
            resident = name in worker.resident
            tier: Tier = "resident" if resident else ("warm" if name in worker.warm else "cold")
            deferred = False
            if q and not resident and name not in served_by and len(self.workers) > 1:
                # Nobody holds it: left to its first taker for a while (the live worker's rule).
                if slots is None:
                    slots = {
                        p.id: (len(p.resident) + (1 if p.loading else 0), sum(self.w.models[r].memory_bytes for r in p.resident))
                        for p in self.workers
                    }
                until = self._deferred_until(worker, name, q.head.arrival, worker.costs.load_cost_s(name, tier), slots)
                if until > self.t:
                    deferred = True
                    defer_until = min(defer_until, until)
            # A line it does not listen to: the count of the last take (less what peers took since).
            urgent, bulk = len(q.urgent), len(q.bulk)
            if worker.quiet:
                urgent = min(urgent, worker.quiet.get((name, False), urgent))
                bulk = min(bulk, worker.quiet.get((name, True), bulk))
            facts.append(QueueFacts(
                name=name,
                waiting=urgent + bulk,
                head_enqueued_at=q.head.arrival if q else None,
                # Deadlines are arrival + a per-model constant, so the queue's head has the earliest.
                head_deadline=q.head.deadline if q else None,
                tier=tier,
                reload_fits_host=resident and self._fits_host(name),  # keep_warm's rule
                max_batch_size=m.max_batch_size,
                max_wait_s=m.max_wait_s,
                last_used_at=core.last_used.get(name),
                served_rps=served_by.get(name, 0.0),
                deferred=deferred,
                pinned=m.pin,
                interactive=urgent if self.classes else None,
                interactive_enqueued_at=q.urgent[0].arrival if self.classes and q.urgent else None,
            ))  # fmt: skip
        order = None
        if worker.policy.name == "fifo":
            while self.arrival_log and self.arrival_log[0].id in self.served_ids:
                self.arrival_log.popleft()
            order = [r.model for r in list(self.arrival_log)[:256] if r.id not in self.served_ids]
        # The device is free at every turn here: nothing computes, nothing is held unacked.
        return Turn(
            now=self.t, facts=facts, defer_until=defer_until if math.isfinite(defer_until) else None, arrival_order=order,
        )  # fmt: skip

    def _fits_host(self, name: str) -> bool:
        """Whether the host tier would keep ``name`` evicted (``keep_warm`` drops others for it)."""
        return 0 < self.w.host_budget_bytes and self.w.models[name].memory_bytes <= self.w.host_budget_bytes

    def _deferred_until(self, worker: _Worker, name: str, head_at: float, load_cost_s: float, slots: dict[str, tuple[int, int]]) -> float:
        """``slots``: per worker id, its models on the device (loading counted) and their bytes,
        made once per decision."""
        size = self.w.models[name].memory_bytes
        by_id = self.by_id

        def room(w: str) -> bool:
            return has_room(self.w.budget, slots[w][0], slots[w][1], size)

        rank = first_taker_rank(name, worker.id, by_id, has_warm=lambda w: name in by_id[w].warm, has_room=room)
        return deferred_until(rank, head_at, load_cost_s) if rank else -math.inf

    def _visible(self, worker: _Worker) -> Any:
        """The models a decision looks at: the live worker's rule (``policy.visible_models``)."""
        return visible_models(
            self.w.models, self.t,
            waiting=self.nonempty, on_device=worker.resident,
            current=worker.core.current, last_used=worker.core.last_used, demand=worker.driver.demand if worker.driver.has_demand else None,
        )  # fmt: skip

    def step(self, worker: _Worker) -> None:
        core = worker.core
        if worker.holding_until > -math.inf and core.serving is not None:
            # Carrying out a Hold: it ends with the served model's first interactive request,
            # whose batch it serves with no turn in between; with another line's first arrival
            # (an event the worker hears), or empty at its end.
            held = core.serving
            if self.queues[held].urgent and held in worker.resident:
                worker.holding_until = -math.inf
                self.serve(worker, Fetch(held, self.w.models[held].max_batch_size, "hold"), held=True)
                return
            # A line it does not listen to sends no event: the held model's interactive one, and
            # any it drains deep (worker.quiet).
            interrupted = any(
                line != (held, False) and line not in worker.quiet
                for line in ((self.arrivals[i][1], self.classes and not self.w.interactive[i]) for i in range(worker.hold_seen, self.next_arrival))
            ) or self.next_cancel(worker, worker.hold_checked) <= self.t + 1e-12  # fmt: skip
            worker.hold_seen = self.next_arrival
            worker.hold_checked = self.t
            if self.t < worker.holding_until - 1e-12 and not interrupted:
                self.wake(worker, min(self.next_arrival_at(), worker.holding_until, self.next_cancel(worker, self.t)))
                return
            # Empty (or cut short): the worker listens to the line again and counts it.
            worker.holding_until = -math.inf
            core.handle(Fetched(held, 0, held=True))
            worker.quiet.pop((held, False), None)
            self.wake(worker, self.t + self.control_s("count_line_s"))
            return
        turn = self.turn(worker)
        action = core.handle(turn)
        # The decision's own CPU time delays what it starts, as it does live.
        cost_s = self.w.control.decision_cost_s(len(turn.facts))
        self._execute[type(action)](worker, action, cost_s)

    def _unload(self, worker: _Worker, action: Unload, cost_s: float) -> None:
        for name in action.models:
            self.evict(worker, name)
            self.result.idle_unloads += 1
        self.wake(worker, self.t)

    def _hold(self, worker: _Worker, action: Hold, cost_s: float) -> None:
        worker.holding_until = self.t + cost_s + action.hold_s
        worker.hold_seen = self.next_arrival
        worker.hold_checked = self.t
        self.wake(worker, min(max(min(self.next_arrival_at(), self.next_cancel(worker, self.t)), self.t + cost_s), worker.holding_until))

    def _recount(self, worker: _Worker, action: Recount, cost_s: float) -> None:
        # One count of the line (a consumer-info round trip) before the next turn.
        worker.quiet.pop((action.model, False), None)
        self.wake(worker, self.t + cost_s + self.control_s("count_line_s"))

    def _wait_free(self, worker: _Worker, action: WaitFree, cost_s: float) -> None:
        self.wake(worker, max(self.t, worker.busy_until))  # nothing computes at a simulated turn

    def _fetch(self, worker: _Worker, action: Fetch, cost_s: float) -> None:
        self.serve(worker, action, cost_s)

    def _load(self, worker: _Worker, action: LoadModel, cost_s: float) -> None:
        worker.quiet.clear()  # a worker that loads listens to every arrival
        self.load(worker, action, cost_s)

    def _sleep(self, worker: _Worker, action: Sleep, cost_s: float) -> None:
        worker.quiet.clear()  # an idle worker wakes on every arrival
        self.idle(worker, action)

    def evict(self, worker: _Worker, name: str) -> None:
        worker.resident.remove(name)
        worker.fresh.discard(name)
        self.keep_warm(worker, name)
        worker.core.handle(Evicted(name, self.t))

    def idle(self, worker: _Worker, action: Sleep) -> None:
        nxt = self.next_arrival_at()
        if any(self.queues.values()):
            # An arrival, a cancel notice, or the core's own deadline wakes it.
            until = math.inf if action.until is None else action.until
            self.wake(worker, max(min(until, nxt, self.next_cancel(worker, self.t)), self.t + 1e-6))
        elif nxt < math.inf:
            self.wake(worker, max(min(nxt, worker.core.idle_wake), self.t))
        # else: nothing left to arrive and nothing queued: this worker is done (an idle unload
        # then would change nothing measured)

    def serve(self, worker: _Worker, decision: Fetch, cost_s: float = 0.0, *, held: bool = False) -> None:
        m = self.w.models[decision.model]
        q = self.queues[decision.model]
        if not q:
            self.wake(worker, max(self.next_arrival_at(), self.t + 1e-6) if self.next_arrival_at() < math.inf else self.t + 1e-3)
            return
        # As live: a batch computes while earlier ones' answers are stored, a bounded number of
        # them (the device is free here, so none is computing).
        answering = worker.answering[decision.model] = [t for t in worker.answering.get(decision.model, ()) if t > self.t]
        if not pipeline_has_room(len(answering), 0, 1):
            self.wake(worker, min(answering))
            return
        window = self.windows[decision.model]
        limit = max(1, min(decision.max_items, m.max_batch_size))
        # As live: the window opens at the first request the batch takes (its line's head) and
        # closes early enough for its deadline (deadlines are arrival + a per-model constant),
        # given the batch's estimated time.
        bulk_first = batch_line_first(len(q.urgent), len(q.bulk), q.run)
        head = q.first(bulk_first)
        latest_start = head.deadline - worker.costs.deadline_estimate_s(decision.model, limit) if head.deadline is not None else None
        close_at = window.close_at(head.arrival, head.arrival, latest_start)
        if not window.should_close(min(len(q), limit), close_at, self.t) and len(q) < limit:
            self.wake(worker, max(min(close_at, self.next_arrival_at()), self.t + 1e-9))  # the window is open
            return
        batch: list[_Request] = []
        q.count_batch(bulk_first)
        while q and len(batch) < limit:
            if decision.before is not None and batch and q.next.arrival >= decision.before:
                break
            batch.append(q.pop(bulk_first))
        if not q:
            self.nonempty.discard(decision.model)
        worker.core.handle(Fetched(decision.model, len(batch), held=held))
        # As live: a fetch says what its line still holds; deep, the worker stops listening to
        # its arrivals (policy/interest.py) and sees that count until its next take.
        taken = {r.interactive for r in batch}
        for bulk, left in ((False, len(q.urgent)), (True, len(q.bulk))):
            line = (decision.model, bulk)
            if line in worker.quiet and (not bulk) not in taken:
                continue  # a quiet line this batch took nothing from: its count is still its last take's
            filled = not bulk and worker.core.serving == decision.model
            if listens(listening=line not in worker.quiet, draining=True, waiting=left, max_batch_size=m.max_batch_size, filled=filled):
                worker.quiet.pop(line, None)
            else:
                worker.quiet[line] = left
        start = self.t + cost_s + self.control_s("batch_overhead_s")
        predicted_s = worker.core.predicted_s(decision.model, len(batch))
        gone = [r for r in batch if r.gone(self.t)]
        live = [r for r in batch if not cannot_finish(r.deadline, start, predicted_s) and not r.gone(self.t)]
        worker.core.handle(BatchChecked(decision.model, refused_whole=not live and not gone and predicted_s > 0))
        for r in batch:
            if r not in live:
                if r.gone(self.t):
                    self.result.cancelled += 1
                else:
                    self.result.deadline_exceeded += 1
                self._served(r, None, None)
        if not live:
            # As live: a batch refused whole still counts as demand and as use of the model, and
            # stores its answers (the refusals) within the same pipeline bound.
            answering.append(start + self.control_s("answer_s"))
            worker.core.handle(BatchDone(decision.model, taken=len(batch), computed=0, seconds=0.0, now=self.t))
            self.wake(worker, self.t)
            return
        self.maybe_prefetch(worker, decision.model)
        duration = self.noisy(m.batch_s(len(live)))
        end = start + duration
        answered = end + self.control_s("answer_s")  # the caller has it once stored and sent
        answering.append(answered)
        self.consumers[m.name] = start
        for r in live:
            self._served(r, start, answered)
            if m.max_wait_s is not None and start - r.arrival > m.max_wait_s + m.load_cost_s + m.batch_s(m.max_batch_size) + 1e-9:
                self.result.late_beyond_bound += 1
        self.result.batches.append((start, end, m.name, len(live), m.name in worker.fresh))
        worker.fresh.discard(m.name)
        worker.busy_until = end
        self.wake(worker, end, f"done:batch:{m.name}:{len(live)}/{len(batch)}:{duration}")

    def _served(self, r: _Request, start: float | None, end: float | None) -> None:
        self.served_ids.add(r.id)
        self.result.served_ids.append(r.id)
        if start is None or end is None:
            return
        self.result.completed += 1
        self.result.waits_s.append(start - r.arrival)
        self.result.latencies_s.append(end - r.arrival)
        self.result.latency_by_model.setdefault(r.model, []).append(end - r.arrival)
        if self.classes:
            self.result.latency_by_class.setdefault("interactive" if r.interactive else "batch", []).append(end - r.arrival)
        self.result.completions.append((end, r.arrival))

    def load(self, worker: _Worker, decision: LoadModel, cost_s: float = 0.0) -> None:
        q = self.queues[decision.model]
        if q and decision.model not in worker.resident:
            # As live: a queue whose callers are all gone, or will be before the load and a batch
            # end (the estimates; only passed deadlines after PROBE_AFTER_REFUSALS such reaps in
            # a row), is answered without a load.
            tier = "warm" if decision.model in worker.warm else "cold"
            peer_serves = any(decision.model in p.resident or p.loading == decision.model for p in self.workers if p is not worker)
            waiting = [(r.deadline, r.gone(self.t)) for r in q]
            verdict = worker.core.handle(LoadDue(decision.model, tier, self.t, waiting, peer_serves=peer_serves))
            if isinstance(verdict, Reap):
                while q:
                    r = q.pop()
                    if r.gone(self.t):
                        self.result.cancelled += 1
                    else:
                        self.result.deadline_exceeded += 1
                    self._served(r, None, None)
                self.nonempty.discard(decision.model)
                self.result.reaped_queues += 1
                self.wake(worker, self.t + cost_s)
                return
        if any(p.loading == decision.model for p in self.workers if p is not worker):
            # Another worker holds the load claim: stand back until its load ends.
            self.wake(worker, max(p.busy_until for p in self.workers if p.loading == decision.model) + 1e-6)
            return
        for victim in decision.evict:
            if victim in worker.resident:
                self.evict(worker, victim)
        m = self.w.models[decision.model]
        if decision.model in worker.resident:
            self.wake(worker, self.t)
            return
        tier = "warm" if decision.model in worker.warm else "cold"
        worker.warm.pop(decision.model, None)
        duration = self.noisy(m.load_s(tier))
        start = self.t + cost_s + self._load_overhead_s()
        last = self.consumers.get(decision.model)
        # A model's consumer is made by its first load, while the model loads (as live), and
        # shared by every worker; the server removes it after consumer_idle_s unused.
        consumer_s = self.control_s("consumer_create_s") if last is None or self.t - last > self.w.control.consumer_idle_s else 0.0
        self.consumers[decision.model] = start
        self.result.load_log.append((start, start + duration, m.name))
        self.result.load_seconds += duration
        self.result.loads += 1
        worker.loading = decision.model
        ready = start + max(duration, consumer_s)
        worker.busy_until = ready
        self.wake(worker, ready, f"done:load:{decision.model}:{tier}:{duration}")

    def _load_overhead_s(self) -> float:
        """The control plane's part of a load: the consumer check, the claims and their release,
        and the advert after it (and before it, with peers): key-value round trips."""
        adverts = 2 if len(self.workers) > 1 else 1  # before the load only when peers listen
        return self.w.control.load_overhead_s + self.control_s("claim_s") + sum(self.control_s("advert_s") for _ in range(adverts))

    def control_s(self, name: str) -> float:
        """One draw of the control-plane cost ``name``: its mean, spread by ``Control.cv``."""
        mean = float(getattr(self.w.control, name))
        cv = self.w.control.cv.get(name, 0.0)
        if cv <= 0 or mean <= 0:
            return mean
        sigma = math.sqrt(math.log(1 + cv * cv))
        return mean * self.control_rng.lognormvariate(-sigma * sigma / 2, sigma)

    def finish(self, worker: _Worker, kind: str) -> None:
        _, what, model, arg, duration_text = kind.split(":", 4)
        duration = float(duration_text)
        if what == "batch":
            computed, _, size = arg.partition("/")
            worker.core.handle(BatchDone(model, taken=int(size), computed=int(computed), seconds=duration, now=self.t))
        else:
            worker.loading = None
            worker.resident.append(model)
            worker.fresh.add(model)
            self.result.max_resident_seen = max(self.result.max_resident_seen, len(worker.resident))
            self.result.max_bytes_seen = max(self.result.max_bytes_seen, sum(self.w.models[r].memory_bytes for r in worker.resident))
            worker.core.handle(Loaded(model, arg, duration, self.t, waiting=len(self.queues[model])))  # type: ignore[arg-type]
        if worker.prefetching and worker.prefetching[1] <= self.t:
            self.keep_warm(worker, worker.prefetching[0])
            worker.prefetching = None
        self.wake(worker, self.t)

    # --- the warm tier --------------------------------------------------------------------------

    def keep_warm(self, worker: _Worker, model: str) -> None:
        """Keep ``model`` in the host tier if it fits, dropping the warm copies worth least."""
        budget = self.w.host_budget_bytes
        size = self.w.models[model].memory_bytes
        if budget <= 0 or size > budget:
            return
        def value(name: str) -> float:
            recent = worker.driver.demand(name, self.t)
            # The estimate, as live (the simulated worker does not know the true cost).
            return warm_copy_value(worker.costs.load_cost_s(name, "cold"), len(self.queues[name]), recent)

        while sum(self.w.models[n].memory_bytes for n in worker.warm) + size > budget and worker.warm:
            del worker.warm[min(worker.warm, key=lambda n: (value(n), n))]
        worker.warm[model] = self.t

    def maybe_prefetch(self, worker: _Worker, serving: str) -> None:
        if not self.w.prefetch or self.w.host_budget_bytes <= 0 or worker.prefetching is not None:
            return
        waiting = [n for n, q in self.queues.items() if q and n != serving and n not in worker.resident and n not in worker.warm]
        if not waiting:
            return
        nxt = max(waiting, key=lambda n: (len(self.queues[n]), n))
        m = self.w.models[nxt]
        read_s = max(0.0, m.load_s("cold") - m.load_s("warm"))  # host time, beside the device
        worker.prefetching = (nxt, self.t + read_s)

    def noisy(self, seconds: float) -> float:
        cv = self.w.noise_cv
        if cv <= 0 or seconds <= 0:
            return seconds
        sigma = math.sqrt(math.log(1 + cv * cv))
        return seconds * self.rng.lognormvariate(-sigma * sigma / 2, sigma)  # mean preserved


def _drain_rps(worker: _Worker, name: str, m: SimModel) -> float:
    return drain_rps(worker.costs.batch_cost(name), m.max_batch_size)


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

    return _Sim(workload, make, max_events, record, merged).run()


def simulate_policies(workload: Workload, names: list[str]) -> list[SimResult]:
    """Each policy on the same workload (the same arrivals and noise)."""
    return [simulate(workload, name) for name in names]
