"""The cost estimator: what a load, a batch and a model's memory cost, learned from measurements.

Pure: observations come in with their values, estimates go out; no clock, no I/O. The live
worker feeds it what it measures and the simulator feeds it what it simulates, so both schedule
on estimates, never on hidden true costs.

A load's cost depends on the tier the model comes from: *cold* (read and deserialise from disk),
*warm* (a host-to-device copy from host memory) or *resident* (free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

from .state import CostsState, read_state, real, reals

__all__ = ["BatchCost", "CostEstimator", "Tier", "fits_host", "prefetch_choice", "warm_copy_value"]

Tier = Literal["cold", "warm", "resident"]

# Until a warm load is measured, assume it costs this share of a cold one (a host-to-device
# copy against a disk read plus deserialisation; bench/models/loading.py measures the real ratio).
WARM_SHARE_PRIOR = 0.3


@dataclass(frozen=True)
class BatchCost:
    """Estimated seconds to run a batch of n items: ``batch_cost_s + item_cost_s * n``."""

    batch_cost_s: float
    item_cost_s: float

    def seconds(self, n: int) -> float:
        return self.batch_cost_s + self.item_cost_s * n


class CostEstimator:
    """Exponentially weighted measurements (weight ``alpha`` on the newest) of load time per tier,
    batch time (fixed + per item) and memory per model, seeded from the configuration."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._load: dict[tuple[str, str], float] = {}
        self._measured: set[tuple[str, str]] = set()  # (model, tier) loads seen, not only configured
        self._batch: dict[str, BatchCost] = {}
        self._memory: dict[str, int] = {}
        self._host_memory: dict[str, int] = {}
        self._fastest: dict[str, float] = {}  # the shortest batch seen per model

    def export_state(self) -> dict[str, Any]:
        """What the estimator has learnt, as JSON data (``policy/state.py``): an estimator given it
        (:meth:`import_state`) estimates as this one."""
        return {
            "load": [[model, tier, real(s)] for (model, tier), s in self._load.items()],
            "measured": sorted([model, tier] for model, tier in self._measured),
            "batch": {m: [real(c.batch_cost_s), real(c.item_cost_s)] for m, c in self._batch.items()},
            "memory": dict(self._memory),
            "host_memory": dict(self._host_memory),
            "fastest": reals(self._fastest),
        }

    def import_state(self, data: object) -> None:
        """Take over the state :meth:`export_state` gave (ValueError, and nothing changed, when it
        is not an estimator's)."""
        state = read_state(data, CostsState, "the cost estimator")
        self._load = {(model, tier): s for model, tier, s in state.load}
        self._measured = {(model, tier) for model, tier in state.measured}
        self._batch = {m: BatchCost(fixed, per_item) for m, (fixed, per_item) in state.batch.items()}
        self._memory = dict(state.memory)
        self._host_memory = dict(state.host_memory)
        self._fastest = dict(state.fastest)

    def seed(
        self,
        model: str,
        *,
        load_cost_s: float,
        batch_cost: BatchCost,
        memory_bytes: int = 0,
    ) -> None:
        """The configured costs, before any measurement (the warm tier's is a share of the cold
        load until one is measured)."""
        self._load[(model, "cold")] = load_cost_s
        self._batch[model] = batch_cost
        self._memory[model] = memory_bytes

    def observe_load(self, model: str, seconds: float, tier: Tier = "cold") -> None:
        if tier == "resident":
            return
        key = (model, tier)
        prior = self._load.get(key)
        self._load[key] = seconds if prior is None else (1 - self.alpha) * prior + self.alpha * seconds
        self._measured.add(key)

    def measured_load_s(self, model: str, tier: Tier = "cold") -> float | None:
        """The load time estimate of ``model`` from ``tier`` once a load was measured here (the
        configured figure blended with what was seen), or None while it is the configured guess."""
        if tier == "resident":
            return 0.0
        return self._load[(model, tier)] if (model, tier) in self._measured else None

    def observe_batch(self, model: str, n: int, seconds: float) -> None:
        self._fastest[model] = min(seconds, self._fastest.get(model, seconds))
        # Keep the fixed part and refit the per-item part from this observation, and vice versa.
        cost = self._batch.get(model, BatchCost(0.0, 0.0))
        per_item = max(0.0, (seconds - cost.batch_cost_s) / max(n, 1))
        fixed = max(0.0, seconds - cost.item_cost_s * n)
        a = self.alpha
        self._batch[model] = BatchCost((1 - a) * cost.batch_cost_s + a * fixed, (1 - a) * cost.item_cost_s + a * per_item)

    def observe_memory(self, model: str, nbytes: int) -> None:
        if nbytes > 0:
            self._memory[model] = nbytes

    def observe_host_memory(self, model: str, nbytes: int) -> None:
        if nbytes > 0:
            self._host_memory[model] = nbytes

    def load_cost_s(self, model: str, tier: Tier = "cold") -> float:
        """Estimated seconds to make ``model`` resident from ``tier``."""
        if tier == "resident":
            return 0.0
        cold = self._load.get((model, "cold"), 1.0)
        if tier == "warm":
            return self._load.get((model, "warm"), cold * WARM_SHARE_PRIOR)
        return cold

    def deadline_estimate_s(self, model: str, n: int) -> float:
        """The batch time a deadline check assumes: the estimate for ``n``, capped by the fastest
        batch seen, so that a request is refused only when even a fast batch would be late."""
        estimate = self.batch_cost(model).seconds(n)
        fastest = self._fastest.get(model)
        return estimate if fastest is None else min(estimate, fastest)

    def batch_cost(self, model: str) -> BatchCost:
        return self._batch.get(model, BatchCost(0.005, 0.0005))

    def memory_bytes(self, model: str) -> int:
        return self._memory.get(model, 0)

    def host_memory_bytes(self, model: str) -> int:
        """Host bytes of the model's warm copy (measured; the device size until then)."""
        return self._host_memory.get(model, self._memory.get(model, 0))


def prefetch_choice(waiting: Iterable[tuple[str, int]]) -> str | None:
    """Which cold model's weights to read into host memory while the device computes: the one
    with the largest backlog that is ours to serve (ties: the later name), None when none waits.
    ``waiting``: (model, backlog) of the cold models, the one being served left out."""
    best = max(((n, name) for name, n in waiting if n > 0), default=None)
    return None if best is None else best[1]


def fits_host(budget_bytes: int, nbytes: int, used_bytes: int, others: Iterable[tuple[int, float]], value: float) -> bool:
    """Whether a copy of ``nbytes`` worth ``value`` (``warm_copy_value``) fits the host budget,
    ``used_bytes`` of it taken, once the other warm copies worth no more than it go (``others``:
    each one's bytes and value). A copy worth less than what it would displace is not kept."""
    if budget_bytes <= 0 or nbytes > budget_bytes:
        return False
    if used_bytes + nbytes <= budget_bytes:
        return True
    freeable = sum(size for size, worth in others if worth <= value)
    return used_bytes - freeable + nbytes <= budget_bytes


def warm_copy_value(cold_load_cost_s: float, backlog: int, recent_demand: float) -> float:
    """What keeping a model's weights in host memory is worth: the cold reload it saves times
    its likely demand (its waiting requests and its recent, decayed ones). The warm copies worth
    least go first when the host budget is full (live and simulated alike)."""
    return cold_load_cost_s * (backlog + recent_demand)
