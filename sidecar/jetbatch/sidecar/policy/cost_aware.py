"""The default policy: exhaustive visits that pay for their loads, and a cost-aware choice of what
comes next, with a wait bound derived from the cycle the traffic forces.

Grounded in the polling-system facts of ``docs/scheduler.md``: with switch costs S per cycle and
utilisation ρ, every model's queue is visited about once per S / (1 − ρ) seconds whatever the
order, so a wait bound shorter than that cycle cannot be kept by reordering and only turns the
policy into "most overdue first". Cost-awareness pays in choosing *which* model comes next, never
in cutting a paid-for visit short.
"""

from __future__ import annotations

import math
from typing import Any

from .base import PolicyBase, age, best, drain_seconds, interactive, interactive_age, oldest
from .state import PolicyState, real, reals
from .types import Budget, Decision, Idle, Load, ModelState, SchedulerState, Serve

__all__ = ["CostAware"]

_LN2 = math.log(2.0)


class CostAware(PolicyBase):
    """The default policy.

    - **Visits.** The resident model is served until its queue is empty (exhaustive service, the
      strong baseline on a closed burst and under open load). A visit that began with a load is
      never cut short before it has served the requests waiting at the load (gated service) and
      ``amortize`` × the load cost of device time; after that, it yields only to a model that has
      waited past its wait bound (below) longer than its own queue has, which is what keeps a
      model under overload from starving the others. Once paid for, a visit also ends when its queue no longer fills a
      batch and another model's backlog, its load and the current model's reload included,
      would be served at more requests per device second than that partial batch: where a
      batch's fixed cost is large, arrivals during each batch keep a queue from ever emptying,
      and exhaustive service camps on a model at a few requests a batch while the others' queues
      grow (200 req/s over 3 models with 50 ms batches: p99 15 s against 3.8 s).
    - **Which model next.** The waiting model with the most waiting relieved per second of
      switch, ``backlog × age / (switch cost + batch cost)`` (the switch cost is zero for a
      resident model), times an ageing factor ``1 + age / bound`` and a deadline factor (up to 2×
      for a model whose earliest deadline falls within one cycle and can still be met). A model
      past its bound comes first, most overdue first. With Poisson arrivals ``backlog × age`` is
      about ``rate × age²``, so a model comes up once its age reaches about
      ``sqrt(switch / rate)``: visit frequencies proportional to ``sqrt(rate / switch cost)``,
      which minimise the mean wait for a given share of time spent loading (the square-root rule
      of polling tables). Popular cheap models are visited often, rare costly ones in larger
      batches.
    - **The wait bound** is ``max(max_wait_s, wait_cycles × cycle)`` where the cycle is
      ``S / (1 − ρ)``: S sums the load costs of the models in recent use that cannot all stay
      resident, and ρ is this worker's measured busy share (decayed with ``demand_half_life_s``,
      capped at ``max_utilisation``). With no ``max_wait_s`` configured the bound follows the
      traffic alone.
    - **Several slots.** A resident model whose visit has not paid for its load and still has
      requests is never evicted for another model: the scheduler serves a resident queue instead
      until the load is amortised, so more memory cannot make it thrash. Nor does it shift the
      eviction onto a model worth more: when the model that should make room is mid-burst, the
      scheduler serves it first rather than evicting a costly model in steady use.
    - **Priority classes.** An interactive request counts ``interactive_weight`` times a batch
      request in the score (its queue comes up sooner); an overdue queue holding interactive work
      counts twice as overdue as a batch-only one (which, past twice its bound, still goes
      first); and a visit that serves only batch work yields, once amortised, to a queue whose
      oldest interactive request has waited ``interactive_bound_share`` of its bound. Batch work
      never starves: its queues age like any other. With one class all of this scales every
      queue alike and changes nothing.
    - **Gather window.** With ``gather_size`` > 0, wait until that many requests are queued in all
      or the oldest has waited ``gather_delay_s``.
    """

    name = "cost-aware"

    def __init__(
        self,
        *,
        amortize: float = 1.0,
        wait_cycles: float = 2.0,
        max_utilisation: float = 0.95,
        gather_size: int = 0,
        gather_delay_s: float = 0.0,
        interactive_weight: float = 8.0,
        interactive_bound_share: float = 0.25,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if amortize < 0 or wait_cycles <= 0 or not 0 < max_utilisation < 1:
            raise ValueError("cost-aware needs amortize >= 0, wait_cycles > 0 and 0 < max_utilisation < 1")
        if interactive_weight < 1 or not 0 < interactive_bound_share <= 1:
            raise ValueError("cost-aware needs interactive_weight >= 1 and 0 < interactive_bound_share <= 1")
        self.interactive_weight = interactive_weight
        self.interactive_bound_share = interactive_bound_share
        self.amortize = amortize
        self.wait_cycles = wait_cycles
        self.max_utilisation = max_utilisation
        self.gather_size = gather_size
        self.gather_delay_s = gather_delay_s
        self._burst_s: dict[str, float] = {}  # device seconds served since each model's load
        self._gate: dict[str, int] = {}  # requests still owed from the backlog that justified a load
        self._busy = 0.0  # decayed device seconds of batches
        self._excess = 0.0  # of those, spent on tenants' excess (decayed alike)
        self._busy_at: float | None = None
        self._since: float | None = None  # first event seen: the start of the busy-share window

    # --- state ------------------------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        return {
            **super().export_state(),
            "burst_s": reals(self._burst_s),
            "gate": dict(self._gate),
            "busy": real(self._busy),
            "excess": real(self._excess),
            "busy_at": None if self._busy_at is None else real(self._busy_at),
            "since": None if self._since is None else real(self._since),
        }

    def _import(self, state: PolicyState) -> None:
        super()._import(state)
        self._burst_s = dict(state.burst_s)
        self._gate = dict(state.gate)
        self._busy, self._excess, self._busy_at, self._since = state.busy, state.excess, state.busy_at, state.since

    # --- events -----------------------------------------------------------------------------

    def on_loaded(self, model: str, now: float, backlog: int = 0) -> None:
        super().on_loaded(model, now, backlog)
        if self._since is None:
            self._since = now
        self._burst_s[model] = 0.0
        self._gate[model] = backlog

    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0, *, excess_s: float = 0.0) -> None:
        super().on_batch_done(model, size, now, device_s, excess_s=excess_s)
        if self._since is None:
            self._since = now - device_s
        decay = self._decay(now - (self._busy_at if self._busy_at is not None else now))
        self._busy = self._busy * decay + device_s
        self._excess = self._excess * decay + min(excess_s, device_s)
        self._busy_at = now
        self._burst_s[model] = self._burst_s.get(model, 0.0) + device_s
        if model in self._gate:
            self._gate[model] = max(0, self._gate[model] - size)

    # --- estimates (read-only) --------------------------------------------------------------

    def utilisation(self, now: float, *, excess: bool | None = None) -> float:
        """The device's busy share over the recent past, as measured from batch times
        (``excess`` False: without the tenants' excess; True: the excess's share alone)."""
        if self._since is None or self._busy_at is None:
            return 0.0
        h = self.demand_half_life_s
        elapsed = max(now - self._since, 1e-9)
        window = (h / _LN2) * (1.0 - 0.5 ** (elapsed / h))  # what a device busy all along would show
        busy = {None: self._busy, False: self._busy - self._excess, True: self._excess}[excess] * self._decay(now - self._busy_at)
        return min(self.max_utilisation, max(busy, 0.0) / window)

    def cycle_s(self, state: SchedulerState, now: float, *, without_excess: bool = False) -> float:
        """The natural cycle S / (1 − ρ): how long the device takes to come back to a model
        (``without_excess``: with ρ less the tenants' excess, which gives way to everything)."""
        active = [m for m in state.models.values() if m.backlog > 0 or self.demand(m.name, now) >= 1.0]
        if not active:
            return 0.0
        slots = _slots(state.budget, active)
        if slots >= len(active):
            switch_s = sum(m.load_cost_s for m in active if not m.resident)
        else:
            # Each cycle reloads all but about (slots - 1) of the models in use.
            switch_s = sum(m.load_cost_s for m in active) * (len(active) - slots + 1) / len(active)
        return switch_s / (1.0 - self.utilisation(now, excess=False if without_excess else None))

    def bound_s(self, m: ModelState, cycle_s: float) -> float:
        """How long ``m``'s oldest request may wait before ``m`` comes next."""
        return max(m.max_wait_s or 0.0, self.wait_cycles * cycle_s, m.load_cost_s, 1e-3)

    def amortised(self, m: ModelState) -> bool:
        """The visit since the last load has paid for it (see the class docstring)."""
        return self._gate.get(m.name, 0) <= 0 and self._burst_s.get(m.name, math.inf) >= self.amortize * m.load_cost_s

    def score(self, m: ModelState, now: float, cycle_s: float) -> float:
        """Waiting time relieved per second of switch: ``backlog × age / (switch + batch)``, with
        ageing and the deadline factor (see the class docstring)."""
        switch_s = 0.0 if m.resident else m.load_cost_s
        waited_s = m.backlog * (age(m, now) + 1e-3)  # about twice the queue's summed waiting
        # Interactive requests count interactive_weight times (with one class: a common factor).
        waited_s += (self.interactive_weight - 1.0) * interactive(m) * (interactive_age(m, now) + 1e-3)
        ageing = 1.0 + age(m, now) / self.bound_s(m, cycle_s)
        per_switch = waited_s / max(switch_s + m.batch_cost.batch_cost_s, 1e-6)
        return per_switch * ageing * self._deadline_factor(m, now, cycle_s, switch_s)

    def _deadline_factor(self, m: ModelState, now: float, cycle_s: float, switch_s: float) -> float:
        if m.earliest_deadline is None or cycle_s <= 0:
            return 1.0
        slack = m.earliest_deadline - now - switch_s - m.batch_cost.seconds(min(m.backlog, m.max_batch_size))
        if slack < 0 or slack >= cycle_s:
            return 1.0  # already lost (it will be answered deadline_exceeded), or not pressing
        return 1.0 + (cycle_s - slack) / cycle_s

    # --- the decision -------------------------------------------------------------------------

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = [m for m in state.models.values() if m.backlog > 0]
        if not waiting:
            return Idle(now + self.idle_s)
        if self.gather_size > 0:
            total = sum(m.backlog for m in waiting)
            first = min(oldest(m, now) for m in waiting)
            if total < self.gather_size and now - first < self.gather_delay_s - 1e-9:
                return Idle(first + self.gather_delay_s, "gather")
        cycle = self.cycle_s(state, now)
        overdue = [m for m in waiting if age(m, now) >= self.bound_s(m, cycle)]
        protected = frozenset(m.name for m in waiting if m.resident and not self.amortised(m))
        current = state.models.get(state.current) if state.current else None

        def most_overdue(m: ModelState) -> tuple[float, bool]:
            # Interactive work counts twice as overdue: ahead of batch-only queues as late, never
            # of one past twice its bound (with one class: every queue alike).
            return ((2.0 if interactive(m) > 0 else 1.0) * age(m, now) / self.bound_s(m, cycle), m.resident)

        if current is not None and current.resident and current.backlog > 0:
            waited: list[ModelState] = []
            if self.utilisation(now, excess=True) >= EXCESS_SHARE and _mostly_bulk(current) and self._paid(current):
                # A tenant's excess keeps the device busy (docs/tenancy.md): with it, every cycle
                # and bound grows toward the utilisation cap, and a visit is protected until the
                # backlog that justified its load is served, so the excess in the batch line would
                # hold the device as long as it lasts. Interactive work waiting elsewhere past its
                # bound on the cycle without the excess goes first, once the visit paid for its
                # load's device time. Without tenants' excess (none moved) nothing changes.
                waited = self._interactive_waiting(state, current, now)
            if waited and interactive(current) > 0:
                # Its own interactive work first, in a batch of its own, then the visit yields.
                return Serve(current.name, min(interactive(current), current.max_batch_size), "interactive-first")
            if current.name in protected:
                if waited:
                    return self._visit(state, self._longest_waiting(waited, now, cycle), now, protected - {current.name}, cycle, "interactive")
                return Serve(current.name, current.max_batch_size, "burst")
            # Only a model more overdue than this one ends its visit: after an outage every queue
            # is past its bound, and leaving the oldest for a younger one went round in circles.
            mine = most_overdue(current)[0]
            others = [m for m in overdue if m.name != current.name and most_overdue(m)[0] > mine]
            if not others and not waited and interactive(current) == 0:
                # Serving batch work only: interactive work waiting long elsewhere goes first.
                waited = [
                    m for m in waiting
                    if m.name != current.name and interactive(m) > 0
                    and interactive_age(m, now) >= self.interactive_bound_share * self.bound_s(m, cycle)
                ]  # fmt: skip
            if not others and waited:
                return self._visit(state, self._longest_waiting(waited, now, cycle), now, protected, cycle, "interactive")
            if not others:
                faster = self._served_faster_elsewhere(state, current)
                if faster:
                    target = best(faster, lambda m: (self.score(m, now, cycle), m.resident))
                    return self._visit(state, target, now, protected, cycle, "batch-efficiency")
                return Serve(current.name, current.max_batch_size, "exhaustive")
            return self._visit(state, best(others, most_overdue), now, protected, cycle, "overdue")
        if overdue:
            return self._visit(state, best(overdue, most_overdue), now, protected, cycle, "overdue")
        target = best(waiting, lambda m: (self.score(m, now, cycle), m.resident, -oldest(m, now)))
        return self._visit(state, target, now, protected, cycle, "backlog")

    def _served_faster_elsewhere(self, state: SchedulerState, current: ModelState) -> list[ModelState]:
        """The other waiting models whose whole backlog, with its load and the current model's
        reload, is served at more requests per device second than ``current``'s next batch, when
        that batch is partial (see the class docstring's visits)."""
        n = min(current.backlog, current.max_batch_size)
        if n >= current.max_batch_size:
            return []
        staying = n / max(current.batch_cost.seconds(n), 1e-9)
        faster = []
        for m in state.models.values():
            if m.name == current.name or m.backlog <= 0:
                continue
            switch_s = 0.0 if m.resident else m.load_cost_s + current.load_cost_s
            if m.backlog / max(switch_s + drain_seconds(m, m.backlog), 1e-9) > staying:
                faster.append(m)
        return faster

    def _paid(self, m: ModelState) -> bool:
        """The visit since ``m``'s load held the device as long as the load took (``amortize``)."""
        return self._burst_s.get(m.name, math.inf) >= self.amortize * m.load_cost_s

    def _interactive_waiting(self, state: SchedulerState, current: ModelState, now: float) -> list[ModelState]:
        """Other models whose interactive work waited ``interactive_bound_share`` of its bound,
        measured on the cycle without the tenants' excess: the excess keeping the device busy does
        not lengthen how long interactive work elsewhere may wait."""
        cycle_i = self.cycle_s(state, now, without_excess=True)
        return [
            m for m in state.models.values()
            if m.name != current.name and interactive(m) > 0
            and interactive_age(m, now) >= self.interactive_bound_share * self.bound_s(m, cycle_i)
        ]  # fmt: skip

    def _longest_waiting(self, models: list[ModelState], now: float, cycle: float) -> ModelState:
        return best(models, lambda m: (interactive_age(m, now) / self.bound_s(m, cycle), m.resident))

    def _visit(
        self, state: SchedulerState, target: ModelState, now: float, protected: frozenset[str], cycle: float, reason: str
    ) -> Decision:
        if target.resident:
            return Serve(target.name, target.max_batch_size, reason)
        evict = self._evictions(state, target, now, protected)
        if evict is None:
            # Loading it would evict a model whose load has not paid off yet: serve that first.
            busy = [m for m in state.models.values() if m.name in protected]
            keep = best(busy, lambda m: (self.score(m, now, cycle), -oldest(m, now)))
            return Serve(keep.name, keep.max_batch_size, "protect-burst")
        return Load(target.name, evict, reason)


# The device's share busy with tenants' excess from which the excess stops protecting a visit.
EXCESS_SHARE = 0.01


def _mostly_bulk(m: ModelState) -> bool:
    """Whether ``m``'s next batch is mostly batch-class work: no interactive request waits, or
    fewer than half a batch of them next to batch requests (with one class: never)."""
    if m.interactive is None:
        return False
    urgent = interactive(m)
    return urgent == 0 or (urgent < m.max_batch_size // 2 and m.backlog > urgent)


def _slots(budget: Budget, models: list[ModelState]) -> int:
    """How many of ``models`` can be resident at once (the smallest first, for a byte budget)."""
    slots = len(models) if budget.max_models is None else min(budget.max_models, len(models))
    if budget.max_bytes is not None:
        used, fit = 0, 0
        for m in sorted(models, key=lambda m: m.memory_bytes):
            if used + m.memory_bytes > budget.max_bytes:
                break
            used += m.memory_bytes
            fit += 1
        slots = min(slots, max(fit, 1))
    return max(slots, 1)
