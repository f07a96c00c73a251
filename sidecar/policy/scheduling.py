"""Which model to serve next: pure decision logic, no I/O and no clock.

The live worker (sidecar.worker) and the simulator (sidecar.simulator) build a
:class:`SchedulerState` snapshot, pass the current time in, and carry out the returned decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from .costs import BatchCost

__all__ = [
    "POLICIES",
    "BatchCost",
    "Budget",
    "CostAware",
    "Decision",
    "Exhaustive",
    "Fifo",
    "Idle",
    "Load",
    "LongestBacklog",
    "ModelState",
    "Policy",
    "RoundRobin",
    "SchedulerState",
    "Serve",
    "fits",
    "make_policy",
]


@dataclass(frozen=True)
class ModelState:
    """What the scheduler knows about one model at a decision point.

    Times are in the caller's clock (the same clock as ``now``), in seconds.
    """

    name: str
    backlog: int  # requests waiting in the model's queue (not yet fetched)
    oldest_enqueued_at: float | None  # when the oldest waiting request was enqueued, None if backlog == 0
    resident: bool  # loaded on the device now
    load_cost_s: float  # measured (EWMA) or configured seconds to load
    batch_cost: BatchCost
    memory_bytes: int
    max_batch_size: int
    max_wait_s: float  # bounded-waiting target for this model's requests
    earliest_deadline: float | None = None  # earliest request deadline among waiting requests, if known
    last_used_at: float | None = None  # when this model last served a batch (for LRU baselines)


@dataclass(frozen=True)
class Budget:
    """Device memory budget: bytes, a count of resident models, or both (None: unbounded)."""

    max_bytes: int | None = None
    max_models: int | None = 1


@dataclass(frozen=True)
class SchedulerState:
    models: Mapping[str, ModelState]
    current: str | None  # the model whose batch ran last, if any
    budget: Budget
    # Models of the first waiting requests in arrival order, when the caller knows it (the
    # simulator does; the live worker, whose queues are per model, does not). Only `fifo` uses it.
    arrival_order: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Serve:
    """Run one batch of up to ``max_items`` requests of the (resident) ``model``."""

    model: str
    max_items: int
    reason: str = "backlog"
    # Only requests enqueued before this time (arrival-order batching, used by `fifo` when the
    # caller cannot give the arrival order): the batch ends at the first newer request.
    before: float | None = None


@dataclass(frozen=True)
class Load:
    """Load ``model`` onto the device, first evicting the models in ``evict`` (in order)."""

    model: str
    evict: tuple[str, ...] = ()
    reason: str = "backlog"


@dataclass(frozen=True)
class Idle:
    """Nothing worth doing: wait until ``until`` (or until new work arrives, whichever first)."""

    until: float
    reason: str = "idle"


Decision = Serve | Load | Idle


class Policy(Protocol):
    """A scheduling policy. It may keep internal state (bursts, demand) between calls, changed
    only by the ``on_*`` events, never by ``decide`` (which can be asked "what would you do?"
    any number of times) and never from a clock."""

    name: str

    def decide(self, state: SchedulerState, now: float) -> Decision: ...

    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0) -> None:
        """A batch of ``size`` requests of ``model`` finished; it held the device ``device_s``."""

    def on_loaded(self, model: str, now: float, backlog: int = 0) -> None:
        """``model`` became resident with ``backlog`` requests waiting for it."""

    def on_evicted(self, model: str, now: float) -> None: ...


def fits(budget: Budget, resident: Sequence[ModelState], candidate: ModelState) -> bool:
    """Whether ``candidate`` can be loaded next to ``resident`` within ``budget``."""
    others = [m for m in resident if m.name != candidate.name]
    if budget.max_models is not None and len(others) + 1 > budget.max_models:
        return False
    if budget.max_bytes is not None and sum(m.memory_bytes for m in others) + candidate.memory_bytes > budget.max_bytes:
        return False
    return True


def _drain_seconds(m: ModelState, n: int) -> float:
    """Device seconds to serve ``n`` requests of ``m`` in full batches."""
    if n <= 0:
        return 0.0
    batches = math.ceil(n / m.max_batch_size)
    return batches * m.batch_cost.batch_cost_s + n * m.batch_cost.item_cost_s


def _best(models: Sequence[ModelState], key: Any) -> ModelState:
    """The model maximising ``key``; ties go to the model whose name sorts first (deterministic)."""
    return max(sorted(models, key=lambda m: m.name), key=key)


def _oldest(m: ModelState, now: float) -> float:
    return m.oldest_enqueued_at if m.oldest_enqueued_at is not None else now


def _age(m: ModelState, now: float) -> float:
    return 0.0 if m.oldest_enqueued_at is None else max(0.0, now - m.oldest_enqueued_at)


class _Base:
    """Bookkeeping shared by the policies: recency, decayed demand, and eviction."""

    name = "base"

    def __init__(self, *, eviction: str = "cost", demand_half_life_s: float = 30.0, idle_s: float = 0.25) -> None:
        if eviction not in ("cost", "lru"):
            raise ValueError(f"eviction must be 'cost' or 'lru', got {eviction!r}")
        self.eviction = eviction
        self.demand_half_life_s = demand_half_life_s
        self.idle_s = idle_s
        self._last_used: dict[str, float] = {}
        self._demand: dict[str, tuple[float, float]] = {}  # model -> (decayed count, at)

    # events
    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0) -> None:
        self._last_used[model] = now
        count, at = self._demand.get(model, (0.0, now))
        self._demand[model] = (count * self._decay(now - at) + size, now)

    def on_loaded(self, model: str, now: float, backlog: int = 0) -> None:
        self._last_used[model] = now

    def on_evicted(self, model: str, now: float) -> None:
        pass

    def _decay(self, dt: float) -> float:
        return 0.5 ** (max(dt, 0.0) / self.demand_half_life_s)

    def demand(self, model: str, now: float) -> float:
        """Requests served recently, exponentially decayed (half-life ``demand_half_life_s``)."""
        count, at = self._demand.get(model, (0.0, now))
        return count * self._decay(now - at)

    def _evictions(self, state: SchedulerState, target: ModelState, now: float) -> tuple[str, ...]:
        """Which resident models to unload so ``target`` fits the budget.

        ``cost`` eviction keeps the models whose reload would cost most given what they are likely
        to be asked for next (load cost × (backlog + recent demand)); ``lru`` evicts the least
        recently used, the baseline of Ray Serve's multiplexing and ModelMesh.
        """
        resident = [m for m in state.models.values() if m.resident and m.name != target.name]
        evict: list[str] = []
        while not fits(state.budget, [m for m in resident if m.name not in evict], target):
            victims = [m for m in resident if m.name not in evict]
            if not victims:
                break
            if self.eviction == "lru":
                victim = min(victims, key=lambda m: (self._last_used.get(m.name, -math.inf), m.name))
            else:
                victim = min(
                    victims,
                    key=lambda m: (m.load_cost_s * (m.backlog + self.demand(m.name, now)), self._last_used.get(m.name, -math.inf), m.name),
                )
            evict.append(victim.name)
        return tuple(evict)

    def _go(self, state: SchedulerState, target: ModelState, now: float, reason: str) -> Decision:
        if target.resident:
            return Serve(target.name, target.max_batch_size, reason)
        return Load(target.name, self._evictions(state, target, now), reason)


class CostAware(_Base):
    """The default policy: bursts on the resident model, switches justified by backlog versus
    load cost, bounded waiting without thrashing, and cost-based eviction.

    - **Bursts.** A load is paid for the backlog that justified it: after loading a model, serve
      at least the requests that were waiting at the load (gated service) and at least
      ``amortize`` × its load cost of device time, or until its queue is empty. A wait bound never
      cuts such a burst short (the thrash trap of naive wait bounds); it only chooses what comes
      next. Gated bursts keep the cycle stable under overload, where time-only bursts would not.
    - **Which model next.** A model whose oldest request has waited ``urgency`` × its ``max_wait_s``
      is urgent; the most overdue urgent model comes next. Otherwise the model with the best rate of
      work per device second, ``backlog / (switch cost + drain time)``, where the switch cost is
      zero for resident models; ageing (``1 + age / max_wait``) keeps small queues from starving.
    - **Hysteresis.** After an amortised burst, the current model is left for another only if that
      one scores ``hysteresis`` × better (or is urgent), so two busy models do not ping-pong.
    - **Gather window.** With ``gather_size`` > 0, wait until that many requests are queued in all
      (it may exceed ``max_batch_size``) or the oldest has waited ``gather_delay_s``.
    """

    name = "cost-aware"

    def __init__(
        self,
        *,
        amortize: float = 1.0,
        urgency: float = 0.5,
        hysteresis: float = 2.0,
        gather_size: int = 0,
        gather_delay_s: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if amortize < 0 or not 0 < urgency <= 1 or hysteresis < 1:
            raise ValueError("cost-aware needs amortize >= 0, 0 < urgency <= 1 and hysteresis >= 1")
        self.amortize = amortize
        self.urgency = urgency
        self.hysteresis = hysteresis
        self.gather_size = gather_size
        self.gather_delay_s = gather_delay_s
        self._burst_s: dict[str, float] = {}  # device seconds served since each model's load
        self._gate: dict[str, int] = {}  # requests still owed from the backlog that justified a load

    def on_loaded(self, model: str, now: float, backlog: int = 0) -> None:
        super().on_loaded(model, now, backlog)
        self._burst_s[model] = 0.0
        self._gate[model] = backlog

    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0) -> None:
        super().on_batch_done(model, size, now, device_s)
        self._burst_s[model] = self._burst_s.get(model, 0.0) + device_s
        if model in self._gate:
            self._gate[model] = max(0, self._gate[model] - size)

    def amortised(self, m: ModelState) -> bool:
        """The burst since the last load has paid for it (see the class docstring)."""
        return self._gate.get(m.name, 0) <= 0 and self._burst_s.get(m.name, math.inf) >= self.amortize * m.load_cost_s

    def score(self, m: ModelState, now: float) -> float:
        switch_s = 0.0 if m.resident else m.load_cost_s
        work_s = switch_s + _drain_seconds(m, m.backlog)
        ageing = 1.0 + _age(m, now) / m.max_wait_s
        return (m.backlog / max(work_s, 1e-9)) * ageing

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = [m for m in state.models.values() if m.backlog > 0]
        if not waiting:
            return Idle(now + self.idle_s)
        if self.gather_size > 0:
            total = sum(m.backlog for m in waiting)
            oldest = min(m.oldest_enqueued_at if m.oldest_enqueued_at is not None else now for m in waiting)
            if total < self.gather_size and now - oldest < self.gather_delay_s - 1e-9:
                return Idle(oldest + self.gather_delay_s, "gather")
        urgent = [m for m in waiting if _age(m, now) >= self.urgency * m.max_wait_s]
        current = state.models.get(state.current) if state.current else None
        if current is not None and (not current.resident or current.backlog == 0):
            current = None
        if current is not None and not self.amortised(current):
            # Paid for and not yet amortised: stay, unless an urgent model is resident too (free switch).
            free = [m for m in urgent if m.resident and m.name != current.name]
            if free:
                return Serve(max(free, key=lambda m: _age(m, now) / m.max_wait_s).name, current.max_batch_size, "urgent-resident")
            return Serve(current.name, current.max_batch_size, "burst")
        if urgent:
            target = _best(urgent, lambda m: (_age(m, now) / m.max_wait_s, m.resident))
            return self._go(state, target, now, "urgent")
        target = _best(waiting, lambda m: (self.score(m, now), m.resident, -_oldest(m, now)))
        if current is not None and target.name != current.name and not target.resident:
            if self.score(target, now) < self.hysteresis * self.score(current, now):
                return Serve(current.name, current.max_batch_size, "hysteresis")
        return self._go(state, target, now, "backlog")


class Exhaustive(_Base):
    """Serve the resident model until its queue is empty, then the longest queue (the strong
    polling-system baseline)."""

    name = "exhaustive"

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = [m for m in state.models.values() if m.backlog > 0]
        if not waiting:
            return Idle(now + self.idle_s)
        current = state.models.get(state.current) if state.current else None
        if current is not None and current.resident and current.backlog > 0:
            return Serve(current.name, current.max_batch_size, "exhaustive")
        target = _best(waiting, lambda m: (m.resident, m.backlog, -_oldest(m, now)))
        return self._go(state, target, now, "longest-queue")


class _LruBaseline(_Base):
    """Comparison policies evict least recently used, as the systems they stand for do."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("eviction", "lru")
        super().__init__(**kw)


class LongestBacklog(_LruBaseline):
    """Serve the model with the longest backlog, loading it if needed (switches freely)."""

    name = "longest-backlog"

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = [m for m in state.models.values() if m.backlog > 0]
        if not waiting:
            return Idle(now + self.idle_s)
        target = _best(waiting, lambda m: (m.backlog, m.resident, -_oldest(m, now)))
        return self._go(state, target, now, "longest-backlog")


class Fifo(_LruBaseline):
    """Arrival order: serve the model of the oldest request, with the run of consecutive requests
    for that model at the head of the arrival order (what a batcher in front of a router sees).
    Without an arrival order (the live worker), the model with the oldest request, a full batch."""

    name = "fifo"

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = [m for m in state.models.values() if m.backlog > 0]
        if not waiting:
            return Idle(now + self.idle_s)
        if state.arrival_order:
            head = state.arrival_order[0]
            run = 0
            for name in state.arrival_order:
                if name != head:
                    break
                run += 1
            target = state.models[head]
            if target.resident:
                return Serve(head, min(run, target.max_batch_size), "fifo")
            return Load(head, self._evictions(state, target, now), "fifo")
        target = min(waiting, key=lambda m: (_oldest(m, now), m.name))
        others = [_oldest(m, now) for m in waiting if m.name != target.name]
        if not target.resident:
            return Load(target.name, self._evictions(state, target, now), "fifo")
        # The batch is the run of this model's requests older than any other model's oldest.
        return Serve(target.name, target.max_batch_size, "fifo", before=min(others) if others else None)


class RoundRobin(_LruBaseline):
    """One batch per model in turn, in name order, skipping empty queues."""

    name = "round-robin"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._last: str | None = None

    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0) -> None:
        super().on_batch_done(model, size, now, device_s)
        self._last = model

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = sorted(m.name for m in state.models.values() if m.backlog > 0)
        if not waiting:
            return Idle(now + self.idle_s)
        after = [n for n in waiting if self._last is None or n > self._last]
        target = state.models[(after or waiting)[0]]
        return self._go(state, target, now, "round-robin")


POLICIES: tuple[str, ...] = ("cost-aware", "cost-aware-lru", "exhaustive", "fifo", "round-robin", "longest-backlog")


def make_policy(name: str, **options: Any) -> Policy:
    """Build a policy by name (see :data:`POLICIES`); options are the policy's keyword arguments."""
    if name == "cost-aware":
        return CostAware(**options)
    if name == "cost-aware-lru":
        policy = CostAware(**{"eviction": "lru", **options})
        policy.name = "cost-aware-lru"
        return policy
    classes: dict[str, Any] = {"exhaustive": Exhaustive, "fifo": Fifo, "round-robin": RoundRobin, "longest-backlog": LongestBacklog}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return classes[name](**options)  # type: ignore[no-any-return]
