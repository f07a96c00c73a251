"""The comparison policies: exhaustive service (the strong polling-system baseline), arrival
order, round-robin and longest backlog, the last three with LRU eviction as the systems they
stand for use."""

from __future__ import annotations

from typing import Any

from .base import PolicyBase, best, oldest
from .state import PolicyState
from .types import Decision, Idle, Load, ModelState, SchedulerState, Serve

__all__ = ["Exhaustive", "Fifo", "LongestBacklog", "RoundRobin"]


class Exhaustive(PolicyBase):
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
        return self._next(state, waiting, current, now)

    def _next(self, state: SchedulerState, waiting: list[ModelState], current: ModelState | None, now: float) -> Decision:
        """The visit after the resident queue ran empty: here the longest queue."""
        target = best(waiting, lambda m: (m.resident, m.backlog, -oldest(m, now)))
        return self._go(state, target, now, "longest-queue")


class _LruBaseline(PolicyBase):
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
        target = best(waiting, lambda m: (m.backlog, m.resident, -oldest(m, now)))
        return self._go(state, target, now, "longest-backlog")


class Fifo(_LruBaseline):
    """Arrival order: serve the model of the oldest request, with the run of consecutive requests
    for that model at the head of the arrival order (what a batcher in front of a router sees).
    Without an arrival order (the live worker), the model with the oldest request, a full batch."""

    name = "fifo"
    uses_arrival_order = True  # its executors tell the waiting requests' models in arrival order

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
            return Load(head, self._evictions(state, target, now) or (), "fifo")
        target = min(waiting, key=lambda m: (oldest(m, now), m.name))
        others = [oldest(m, now) for m in waiting if m.name != target.name]
        if not target.resident:
            return Load(target.name, self._evictions(state, target, now) or (), "fifo")
        # The batch is the run of this model's requests older than any other model's oldest.
        return Serve(target.name, target.max_batch_size, "fifo", before=min(others) if others else None)


class RoundRobin(_LruBaseline):
    """One batch per model in turn, in name order, skipping empty queues."""

    name = "round-robin"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._last: str | None = None

    def export_state(self) -> dict[str, Any]:
        return {**super().export_state(), "last": self._last}

    def _import(self, state: PolicyState) -> None:
        super()._import(state)
        self._last = state.last

    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0, *, excess_s: float = 0.0) -> None:
        super().on_batch_done(model, size, now, device_s, excess_s=excess_s)
        self._last = model

    def decide(self, state: SchedulerState, now: float) -> Decision:
        waiting = sorted(m.name for m in state.models.values() if m.backlog > 0)
        if not waiting:
            return Idle(now + self.idle_s)
        after = [n for n in waiting if self._last is None or n > self._last]
        target = state.models[(after or waiting)[0]]
        return self._go(state, target, now, "round-robin")
