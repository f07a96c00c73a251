"""The driver: one worker's decisions and what each event counts. Pure: no I/O, time passed in.

It owns the worker's scheduling policy and cost estimator. The live worker (``sidecar/worker``)
and the simulator (``sidecar/simulator``) both hand it their events and ask it for decisions;
neither calls the policy nor feeds the estimator itself (``tests/test_architecture.py`` checks),
so an event counts the same live and simulated:

- a batch done: the requests it *computed* teach the estimator (a refused request measured
  nothing), all the requests it *took*, refused ones included, count as demand for the policy;
- a load done: its measured seconds per tier and the memory it took teach the estimator, the
  part of the backlog that justified it (the cluster share) is what the policy's visit owes;
- an eviction: the policy hears of it;
- a wake-up (an arrival, a batch or load done, a timer): :meth:`Driver.decide` on the state
  the worker built of what it knows (``SchedulerState``).
"""

from __future__ import annotations

from .costs import CostEstimator, Tier
from .scheduling import Decision, Policy, SchedulerState

__all__ = ["Driver"]


class Driver:
    """One worker's policy and cost estimator, and the events that feed them."""

    def __init__(self, policy: Policy, costs: CostEstimator | None = None) -> None:
        self.policy = policy
        self.costs = CostEstimator() if costs is None else costs

    @property
    def name(self) -> str:
        return self.policy.name

    def decide(self, state: SchedulerState, now: float) -> Decision:
        """The next decision (``decide()`` of the policy changes nothing)."""
        return self.policy.decide(state, now)

    def demand(self, model: str, now: float) -> float:
        """The model's recent demand (decayed requests), as far as the policy keeps it."""
        demand = getattr(self.policy, "demand", None)
        return float(demand(model, now)) if callable(demand) else 0.0

    @property
    def has_demand(self) -> bool:
        return callable(getattr(self.policy, "demand", None))

    def batch_done(self, model: str, *, taken: int, computed: int, seconds: float, now: float) -> None:
        """A batch of ``taken`` requests ended; ``computed`` of them ran for ``seconds``."""
        if computed > 0:
            self.costs.observe_batch(model, computed, seconds)
        self.policy.on_batch_done(model, taken, now, seconds)

    def loaded(
        self, model: str, *, tier: Tier, seconds: float, now: float, share: int, memory_bytes: int = 0, host_bytes: int = 0
    ) -> None:
        """``model`` became resident from ``tier`` in ``seconds``; ``share``: the backlog that was
        this worker's to serve when it decided the load."""
        self.costs.observe_load(model, seconds, tier)
        self.costs.observe_memory(model, memory_bytes)
        self.costs.observe_host_memory(model, host_bytes)
        self.policy.on_loaded(model, now, share)

    def evicted(self, model: str, now: float) -> None:
        self.policy.on_evicted(model, now)

    def warmed(self, model: str, host_bytes: int) -> None:
        """``model``'s weights were read into host memory (a prefetch): what they take there."""
        self.costs.observe_host_memory(model, host_bytes)
