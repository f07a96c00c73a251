"""The worker core: every rule a worker decides by, in one object with no I/O and no clock.

Events in (``core/events.py``), actions out (``core/actions.py``), as h11 or vLLM's scheduler: the
live worker (``sidecar/worker``) turns NATS and torch into events and carries out the actions;
the simulator (``sidecar/simulator``) does the same with a workload, a cost model and a simulated
clock. Neither calls the policy, feeds the estimator or keeps a rule of its own about what to do
next: each asks :meth:`WorkerCore.handle`. Everything handed to ``handle`` can be recorded
(``sidecar/recording.py``), and a fresh core fed the same events emits the same actions
(``sidecar/recording.py``).

What the core owns and only it writes: the driver (policy and cost estimator), the model whose
batches the worker serves from held pulls and whether its last hold came back empty, the model
last served or loaded, when each model was last used and became resident, the backlog share each
load owes, each model's batches under way (in flight, and of those computing), the models left to
a peer that holds their load claim, and the probe counters of refused batches and reaped loads.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from typing import Any, Callable, Mapping, Protocol

from ..policy import (
    PROBE_AFTER_REFUSALS,
    RECENT_S,
    BatchCost,
    Budget,
    CostEstimator,
    Driver,
    Idle,
    Load,
    ModelState,
    Policy,
    SchedulerState,
    Serve,
    hold_s,
    make_policy,
    pipeline_has_room,
    serves_on,
)
from ..policy.state import read_state, real, reals
from .actions import Action, Fetch, Hold, LoadModel, Proceed, Reap, Recount, Sleep, Unload, WaitFree, WaitRoom
from .events import BatchChecked, BatchDone, ClaimLost, Computed, Event, Evicted, Fetched, LoadDue, Loaded, ModelRules, Settled, Started, Turn, Warmed
from .state import CoreFields

__all__ = ["Recorder", "WorkerCore"]

# How often the last-used times older than RECENT_S are dropped (they only matter to which
# models a decision looks at): a walk per turn would cost O(models used) on every decision.
_FORGET_EVERY_S = RECENT_S / 10


class Recorder(Protocol):
    """Where a core writes what it was told and what it answered (``sidecar/recording.py``)."""

    def write(self, event: Event, action: Action | None) -> None: ...


class WorkerCore:
    """One worker's state and rules. ``started`` names the policy, the models and the budget;
    ``policy``: an instance to use instead of building ``started.policy`` (the simulator's single
    custom policy); ``recorder``: receives every event and the action it produced."""

    def __init__(self, started: Started, *, policy: Policy | None = None, recorder: Recorder | None = None) -> None:
        self.started = started
        self.rules: Mapping[str, ModelRules] = started.models
        costs = CostEstimator()
        for name, r in started.models.items():
            costs.seed(name, load_cost_s=r.load_cost_s, batch_cost=BatchCost(r.batch_cost_s, r.item_cost_s), memory_bytes=r.memory_bytes)
        self.driver = Driver(policy if policy is not None else make_policy(started.policy, **started.options), costs)
        self.budget = Budget(max_bytes=started.max_bytes, max_models=started.max_models)
        # The model whose batches the worker serves, its interactive line filled by held pulls
        # and not listened to (policy/interest.py), and whether the last hold came back empty.
        self.serving: str | None = None
        self.hold_missed = False
        self.current: str | None = None  # the model the last batch or load was for
        self.last_used: dict[str, float] = {}  # model -> when its last batch ended (recent ones)
        self.resident_since: dict[str, float] = {}
        self.idle_wake = math.inf  # when the first resident model falls due for an idle unload
        self._revisit = False  # the last turn put off a load until its victims were free
        self._load_share: dict[str, int] = {}  # model -> the backlog share its load under way owes
        self._refusals: dict[str, int] = {}  # batches in a row refused whole on a prediction
        self._reaps: dict[str, int] = {}  # loads in a row not paid because the estimates said nobody would wait
        self._forget_at = -math.inf
        # model -> batches gathered and not yet settled, and of those the ones that may still run
        # the model (only models with some are keys).
        self._in_flight: dict[str, int] = {}
        self._computing: dict[str, int] = {}
        self._standing_back: dict[str, float] = {}  # model -> until when a peer's claim covers its queue
        self._handlers: dict[type, Callable[[Any], Action | None]] = {
            Turn: self._turn,
            Fetched: self._fetched,
            Computed: self._computed,
            Settled: self._settled,
            BatchChecked: self._checked,
            BatchDone: self._batch_done,
            LoadDue: self._load_due,
            Loaded: self._loaded,
            Evicted: self._evicted,
            Warmed: self._warmed,
            ClaimLost: self._claim_lost,
        }
        self.recorder = recorder
        if recorder is not None:
            recorder.write(started, None)

    @property
    def costs(self) -> CostEstimator:
        """The estimator (read it; only the core's events teach it)."""
        return self.driver.costs

    def handle(self, event: Event) -> Action | None:
        """Apply ``event``; the action it asks for (a :class:`Turn` always asks one, a
        :class:`LoadDue` a :class:`Reap` or :class:`Proceed`; the other events none)."""
        action = self._handlers[type(event)](event)
        if self.recorder is not None:
            self.recorder.write(event, action)
        return action

    def export_state(self) -> dict[str, Any]:
        """Everything the core has learnt and decides by, as JSON data: its own fields, its
        policy's and its estimator's (``policy/state.py``: a non-finite float is a string).
        Given to a fresh core made from the same ``Started`` (:meth:`import_state`), it answers
        the next events as this one would. A recording that starts mid-run
        (``recording.RingRecorder``) starts from it."""
        export = getattr(self.driver.policy, "export_state", None)
        if export is None:
            raise TypeError(f"policy {self.driver.name!r} cannot export its state")
        core = {
            "serving": self.serving, "hold_missed": self.hold_missed, "current": self.current,
            "last_used": reals(self.last_used), "resident_since": reals(self.resident_since), "idle_wake": real(self.idle_wake),
            "revisit": self._revisit, "load_share": dict(self._load_share), "refusals": dict(self._refusals), "reaps": dict(self._reaps),
            "forget_at": real(self._forget_at), "in_flight": dict(self._in_flight), "computing": dict(self._computing),
            "standing_back": reals(self._standing_back),
        }  # fmt: skip
        return {"core": core, "policy": export(), "costs": self.costs.export_state()}

    def import_state(self, state: object) -> None:
        """Take over ``state`` from :meth:`export_state` (of a core made from the same
        ``Started``). A ValueError names what is not a core's state; then nothing changed."""
        if not isinstance(state, dict) or set(state) != {"core", "policy", "costs"}:
            raise ValueError("not a core's state: expected the fields core, policy and costs")
        core = read_state(state["core"], CoreFields, "a core")
        if not hasattr(self.driver.policy, "import_state"):
            raise ValueError(f"policy {self.driver.name!r} cannot import a state")
        # Tried on copies first: a state refused halfway leaves the core's own objects as they were.
        copy.deepcopy(self.driver.policy).import_state(state["policy"])
        copy.deepcopy(self.costs).import_state(state["costs"])
        self.driver.policy.import_state(state["policy"])
        self.costs.import_state(state["costs"])
        self.serving, self.hold_missed, self.current = core.serving, core.hold_missed, core.current
        self.last_used, self.resident_since, self.idle_wake = dict(core.last_used), dict(core.resident_since), core.idle_wake
        self._revisit, self._load_share, self._refusals, self._reaps = core.revisit, dict(core.load_share), dict(core.refusals), dict(core.reaps)
        self._forget_at = core.forget_at
        self._in_flight, self._computing = dict(core.in_flight), dict(core.computing)
        self._standing_back = dict(core.standing_back)

    def in_flight(self, model: str) -> int:
        """``model``'s batches gathered and not yet settled."""
        return self._in_flight.get(model, 0)

    def computing(self, model: str) -> int:
        """Of ``model``'s batches in flight, those that may still run the model."""
        return self._computing.get(model, 0)

    def stands_back(self, model: str, now: float) -> bool:
        """Whether ``model``'s queue is left to the peer that holds its load claim at ``now``."""
        return self._standing_back.get(model, -math.inf) > now

    @property
    def standing_back(self) -> Mapping[str, float]:
        """The queues left to peers that hold their load claims, and until when (read it; expired
        ones are dropped at the next turn)."""
        return types.MappingProxyType(self._standing_back)

    @property
    def wants_arrival_order(self) -> bool:
        """Whether a turn should say the waiting requests' models in arrival order
        (``Turn.arrival_order``): only a policy that reads it (``fifo``) is worth the walk."""
        return bool(getattr(self.driver.policy, "uses_arrival_order", False))

    def predicted_s(self, model: str, n: int) -> float:
        """The batch time a deadline check assumes for ``n`` requests of ``model``: the estimate,
        and 0 after ``PROBE_AFTER_REFUSALS`` batches in a row were refused whole on it (that batch
        measures the model again, so an inflated estimate cannot lock a model out for good)."""
        if self._refusals.get(model, 0) >= PROBE_AFTER_REFUSALS:
            return 0.0
        return self.costs.deadline_estimate_s(model, n)

    # --- the turn -------------------------------------------------------------------------------

    def _turn(self, ev: Turn) -> Action:
        now = ev.now
        # A load's Loaded comes before the next turn (both executors carry a load out whole); a
        # share still here belongs to a load that was not paid (a lost claim, a refused look).
        self._load_share.clear()
        if now >= self._forget_at:
            self._forget_at = now + _FORGET_EVERY_S
            for name in [n for n, at in self.last_used.items() if at < now - RECENT_S]:
                del self.last_used[name]
        order = tuple(ev.arrival_order) if ev.arrival_order is not None else None
        facts = ev.facts
        if self._standing_back:
            # A queue whose load claim a peer holds counts as fully served by peers (its share of
            # it none) until their adverts say more: the worker goes on with its own work at once
            # instead of deciding the refused load again and again, or sleeping.
            for name in [n for n, until in self._standing_back.items() if until <= now]:
                del self._standing_back[name]
            facts = [dataclasses.replace(f, served_rps=math.inf) if f.name in self._standing_back else f for f in facts]
        state = self.driver.state(facts, now, current=self.current, budget=self.budget, arrival_order=order)
        idle = self._idle_unloads(state, now, busy=self._in_flight)
        if idle:
            return Unload(idle)
        decision = self.driver.decide(state, now)
        revisit, self._revisit = self._revisit, False
        if isinstance(decision, Idle):
            held_s = hold_s(state, self.serving, until=decision.until, now=now)
            if held_s > 0 and self.serving is not None:
                # Rather than idle, hold the served model's next batch open on a pull: its first
                # request opens the window with no arrival event and no decision between.
                if not self._has_room(self.serving):
                    return WaitRoom(self.serving)
                return Hold(self.serving, self.rules[self.serving].max_batch_size, held_s)
            if self.serving is not None:
                return self._recount()
            until = min(decision.until, self.idle_wake, math.inf if ev.defer_until is None else ev.defer_until, *self._standing_back.values())
            return Sleep(until if math.isfinite(until) else None, decision.reason)
        chosen = state.models.get(decision.model)
        resident = chosen is not None and chosen.resident
        if self.serving is not None and not (isinstance(decision, Serve) and resident and decision.model == self.serving):
            # Decided while the served model's interactive line was not listened to: its count is
            # what the last fetch left. Count it and decide again on that count.
            return self._recount()
        if isinstance(decision, Serve) and resident:
            if not self._has_room(decision.model):
                # The next batch is gathered while earlier ones compute and store their answers,
                # a bounded number of them: decided again once one of them moves on.
                return WaitRoom(decision.model)
            limit = max(1, min(decision.max_items, self.rules[decision.model].max_batch_size))
            return Fetch(decision.model, limit, decision.reason, decision.before)
        if isinstance(decision, Load):
            computing = [n for n in decision.evict if n in self._computing]
            if computing and not revisit:
                # Decided while a victim still computes (the next batch was gathered early):
                # what arrives meanwhile would wait a whole cycle. Decide again once it is free.
                self._revisit = True
                return WaitFree(computing)
            return self._load(decision.model, list(decision.evict), decision.reason, chosen)
        # A policy that serves a model not on the device gets the load it implies, with no
        # eviction (the core does not guess what to give up).
        return self._load(decision.model, [], "serve-non-resident", chosen)

    def _has_room(self, model: str) -> bool:
        return pipeline_has_room(self.in_flight(model), self.computing(model), self.rules[model].max_concurrent_batches)

    def _recount(self) -> Recount:
        served, self.serving = self.serving, None
        assert served is not None
        return Recount(served)

    def _load(self, model: str, evict: list[str], reason: str, chosen: ModelState | None) -> LoadModel:
        # The part of the backlog that justified the load (the cluster share) is what the policy's
        # visit owes; never more than what waits when the load ends (``Loaded.waiting``).
        self._load_share[model] = chosen.backlog if chosen is not None else 0
        return LoadModel(model, evict, reason)

    def _idle_unloads(self, state: SchedulerState, now: float, *, busy: Mapping[str, int]) -> list[str]:
        """Resident models idle past their limit (``Driver.idle_unloads``); notes when the next one
        falls due (``idle_wake``), which a sleep wakes for."""
        limits: dict[str, float] = {}
        since: dict[str, float] = {}
        for name, m in state.models.items():
            rules = self.rules.get(name)
            if not m.resident or rules is None or rules.idle_unload_s is None or rules.pin:
                continue
            if name not in self.resident_since:
                self.resident_since[name] = now  # resident before the core knew it: counted from now
            limits[name] = rules.idle_unload_s
            since[name] = max(self.last_used.get(name, -math.inf), self.resident_since[name])
        self.idle_wake = min((since[n] + limits[n] for n in limits), default=math.inf)
        if not limits:
            return []
        return [n for n in self.driver.idle_unloads(state, limits, since, now) if n not in busy]

    # --- what the executor reports --------------------------------------------------------------

    def _fetched(self, ev: Fetched) -> None:
        if ev.n > 0:
            self._in_flight[ev.model] = self._in_flight.get(ev.model, 0) + 1
            self._computing[ev.model] = self._computing.get(ev.model, 0) + 1
        if ev.n == 0:
            if ev.held:
                # A hold that came back empty (or was cut short) ends the serving: the next turn
                # listens to the line again and counts it.
                self.hold_missed = True
                self.serving = None
            return None
        if serves_on(ev.n, self.rules[ev.model].max_batch_size, missed=self.hold_missed):
            # More are coming: its next batches fill from held pulls, not its arrival events.
            self.serving = ev.model
            self.hold_missed = False
        self.current = ev.model
        return None

    def _computed(self, ev: Computed) -> None:
        _decrement(self._computing, ev.model)
        return None

    def _settled(self, ev: Settled) -> None:
        _decrement(self._in_flight, ev.model)
        return None

    def _checked(self, ev: BatchChecked) -> None:
        self._refusals[ev.model] = self._refusals.get(ev.model, 0) + 1 if ev.refused_whole else 0
        return None

    def _batch_done(self, ev: BatchDone) -> None:
        self.driver.batch_done(ev.model, taken=ev.taken, computed=ev.computed, seconds=ev.seconds, now=ev.now, excess=ev.excess)
        self.last_used[ev.model] = ev.now
        return None

    def _load_due(self, ev: LoadDue) -> Action:
        if ev.waiting is None:
            self._reaps[ev.model] = 0  # a request never seen arriving may be wanted
            return Proceed()
        # The estimates say nothing of a peer that holds (or loads) the model: it may serve these
        # callers in time, so then only callers already gone count; so too after a run of reaps.
        probe = self._reaps.get(ev.model, 0) >= PROBE_AFTER_REFUSALS or ev.peer_serves
        gone, horizon_s = self.driver.callers_gone(ev.model, ev.tier, ev.waiting, ev.now, probe=probe)
        if not gone:
            self._reaps[ev.model] = 0
            return Proceed()
        # Counted toward the probe only when the estimate decided it (no deadline passed yet).
        predicted = any(not cancelled and (d is None or d > ev.now) for d, cancelled in ev.waiting)
        self._reaps[ev.model] = self._reaps.get(ev.model, 0) + 1 if predicted else 0
        return Reap(ev.model, horizon_s)

    def _loaded(self, ev: Loaded) -> None:
        share = min(self._load_share.pop(ev.model, ev.waiting), ev.waiting)
        self.driver.loaded(
            ev.model, tier=ev.tier, seconds=ev.seconds, now=ev.now, share=share, memory_bytes=ev.memory_bytes, host_bytes=ev.host_bytes
        )
        self.resident_since[ev.model] = ev.now
        self.current = ev.model
        return None

    def _evicted(self, ev: Evicted) -> None:
        self.driver.evicted(ev.model, ev.now)
        self.resident_since.pop(ev.model, None)
        return None

    def _claim_lost(self, ev: ClaimLost) -> None:
        self._standing_back[ev.model] = max(ev.until, self._standing_back.get(ev.model, -math.inf))
        return None

    def _warmed(self, ev: Warmed) -> None:
        self.driver.warmed(ev.model, ev.host_bytes)
        return None


def _decrement(counts: dict[str, int], model: str) -> None:
    """One batch of ``model`` fewer (an event with none counted, a forged or replayed one, is
    ignored: a count never goes below zero)."""
    n = counts.get(model, 0) - 1
    if n > 0:
        counts[model] = n
    else:
        counts.pop(model, None)
