"""Which model to serve next: pure decision logic, no I/O and no clock.

The live worker (sidecar.worker) and the simulator (sidecar.simulator) build a
:class:`SchedulerState` snapshot, pass the current time in, and carry out the returned decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

__all__ = [
    "BatchCost",
    "Budget",
    "Decision",
    "Idle",
    "Load",
    "ModelState",
    "Policy",
    "SchedulerState",
    "Serve",
    "make_policy",
]


@dataclass(frozen=True)
class BatchCost:
    """Estimated seconds to run a batch of n items: ``fixed_s + per_item_s * n``."""

    fixed_s: float
    per_item_s: float

    def seconds(self, n: int) -> float:
        return self.fixed_s + self.per_item_s * n


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


@dataclass(frozen=True)
class Serve:
    """Run one batch of up to ``max_items`` requests of the (resident) ``model``."""

    model: str
    max_items: int
    reason: str = "backlog"


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
    """A scheduling policy. It may keep internal state (hysteresis, burst counters) between calls,
    updated only through ``decide`` and the ``on_*`` notifications, never from a clock."""

    name: str

    def decide(self, state: SchedulerState, now: float) -> Decision: ...

    def on_batch_done(self, model: str, size: int, now: float) -> None: ...

    def on_loaded(self, model: str, now: float) -> None: ...

    def on_evicted(self, model: str, now: float) -> None: ...


@dataclass
class LongestBacklog:
    """Walking-skeleton policy: serve the resident model with the longest backlog, else load the
    model with the longest backlog, evicting the least recently used model if the budget is full."""

    name: str = "longest-backlog"
    idle_s: float = 0.25
    _last_used: dict[str, float] = field(default_factory=dict)

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = [m for m in state.models.values() if m.backlog > 0]
        if not waiting:
            return Idle(until=now + self.idle_s)
        best = max(waiting, key=lambda m: (m.backlog, m.resident))
        if best.resident:
            return Serve(best.name, best.max_batch_size)
        resident = [m for m in state.models.values() if m.resident]
        evict: list[str] = []
        while not _fits(state.budget, [m for m in resident if m.name not in evict], best):
            victims = [m for m in resident if m.name not in evict]
            if not victims:
                break
            victim = min(victims, key=lambda m: self._last_used.get(m.name, float("-inf")))
            evict.append(victim.name)
        return Load(best.name, tuple(evict))

    def on_batch_done(self, model: str, size: int, now: float) -> None:
        self._last_used[model] = now

    def on_loaded(self, model: str, now: float) -> None:
        self._last_used[model] = now

    def on_evicted(self, model: str, now: float) -> None:
        self._last_used.pop(model, None)


def _fits(budget: Budget, resident: list[ModelState], candidate: ModelState) -> bool:
    if budget.max_models is not None and len(resident) + 1 > budget.max_models:
        return False
    if budget.max_bytes is not None:
        used = sum(m.memory_bytes for m in resident)
        if used + candidate.memory_bytes > budget.max_bytes:
            return False
    return True


def make_policy(name: str) -> Policy:
    """Build a policy by name."""
    if name == "longest-backlog":
        return LongestBacklog()
    raise ValueError(f"unknown policy {name!r}")
