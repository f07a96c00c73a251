"""Bookkeeping every policy shares: recency, decayed demand, eviction, and small helpers."""

from __future__ import annotations

import math
from typing import Any, Sequence

from .state import PolicyState, read_state, real, reals
from .types import Decision, Load, ModelState, SchedulerState, Serve, fits

__all__ = ["PolicyBase", "age", "best", "drain_seconds", "interactive", "interactive_age", "oldest"]


def drain_seconds(m: ModelState, n: int) -> float:
    """Device seconds to serve ``n`` requests of ``m`` in full batches."""
    if n <= 0:
        return 0.0
    batches = math.ceil(n / m.max_batch_size)
    return batches * m.batch_cost.batch_cost_s + n * m.batch_cost.item_cost_s


def best(models: Sequence[ModelState], key: Any) -> ModelState:
    """The model maximising ``key``; ties go to the model whose name sorts first (deterministic)."""
    return max(sorted(models, key=lambda m: m.name), key=key)


def oldest(m: ModelState, now: float) -> float:
    return m.oldest_enqueued_at if m.oldest_enqueued_at is not None else now


def age(m: ModelState, now: float) -> float:
    return 0.0 if m.oldest_enqueued_at is None else max(0.0, now - m.oldest_enqueued_at)


def interactive(m: ModelState) -> int:
    """How many of ``m``'s waiting requests are interactive (all, when classes are not told)."""
    return m.backlog if m.interactive is None else min(m.interactive, m.backlog)


def interactive_age(m: ModelState, now: float) -> float:
    """How long ``m``'s oldest interactive request has waited (0 when none waits)."""
    if m.interactive is None:
        return age(m, now)
    if not interactive(m) or m.interactive_enqueued_at is None:
        return 0.0
    return max(0.0, now - m.interactive_enqueued_at)


class PolicyBase:
    """Bookkeeping shared by the policies: recency, decayed demand, and eviction."""

    name = "base"

    def __init__(self, *, eviction: str = "cost", demand_half_life_s: float = 30.0, idle_s: float = 0.25) -> None:
        if eviction not in ("cost", "lru"):
            raise ValueError(f"eviction must be 'cost' or 'lru', got {eviction!r}")
        if not demand_half_life_s > 0:
            raise ValueError(f"demand_half_life_s must be positive, got {demand_half_life_s!r}")
        self.eviction = eviction
        self.demand_half_life_s = demand_half_life_s
        self.idle_s = idle_s
        self._last_used: dict[str, float] = {}
        self._demand: dict[str, tuple[float, float]] = {}  # model -> (decayed count, at)

    # state
    def export_state(self) -> dict[str, Any]:
        """What this policy has learnt from its events, as JSON data (``policy/state.py``): a
        policy of the same name and options given it (:meth:`import_state`) decides as this one."""
        return {
            "name": self.name,
            "last_used": reals(self._last_used),
            "demand": {m: [real(count), real(at)] for m, (count, at) in self._demand.items()},
        }

    def import_state(self, data: object) -> None:
        """Take over the state :meth:`export_state` gave (ValueError, and nothing changed, when it
        is not this policy's)."""
        self._import(self._read(data))

    def _read(self, data: object) -> PolicyState:
        state = read_state(data, PolicyState, "a policy")
        if state.name != self.name:
            raise ValueError(f"the state of policy {state.name!r}, not of {self.name!r}")
        return state

    def _import(self, state: PolicyState) -> None:
        self._last_used = dict(state.last_used)
        self._demand = dict(state.demand)

    # events
    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0, *, excess_s: float = 0.0) -> None:
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

    def _evictions(
        self, state: SchedulerState, target: ModelState, now: float, protected: frozenset[str] = frozenset()
    ) -> tuple[str, ...] | None:
        """Which resident models to unload so ``target`` fits the budget; None when the model that
        should go is ``protected`` (its load has not paid off yet: serve it first, then ask again).

        ``cost`` eviction unloads the models whose reload would cost least given what they are
        likely to be asked for next (load cost × (backlog + recent demand)); ``lru`` evicts the
        least recently used, the baseline of Ray Serve's multiplexing and ModelMesh. A protected
        model never moves that choice onto a model worth more: evicting a costly, steadily used
        model because a cheap one is mid-burst would pay the costly load again soon after.
        """
        resident = [m for m in state.models.values() if m.resident and m.name != target.name]
        evict: list[str] = []
        while not fits(state.budget, [m for m in resident if m.name not in evict], target):
            # Pinned models are never victims (the config leaves room for the others beside them).
            victims = [m for m in resident if m.name not in evict and not m.pinned]
            if not victims:
                break
            if self.eviction == "lru":
                victim = min(victims, key=lambda m: (self._last_used.get(m.name, -math.inf), m.name))
            else:
                victim = min(
                    victims,
                    key=lambda m: (m.load_cost_s * (m.backlog + self.demand(m.name, now)), self._last_used.get(m.name, -math.inf), m.name),
                )
            if victim.name in protected:
                return None
            evict.append(victim.name)
        return tuple(evict)

    def _go(self, state: SchedulerState, target: ModelState, now: float, reason: str) -> Decision:
        if target.resident:
            return Serve(target.name, target.max_batch_size, reason)
        return Load(target.name, self._evictions(state, target, now) or (), reason)
