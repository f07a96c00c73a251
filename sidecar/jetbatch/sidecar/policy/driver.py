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

from dataclasses import dataclass
from typing import Iterable, Mapping

from .costs import CostEstimator, Tier
from .scheduling import Budget, Decision, ModelState, Policy, SchedulerState
from .share import effective_backlog, join_horizon_s, shared_head
from .window import cannot_finish

__all__ = ["Driver", "QueueFacts", "reload_tier"]


@dataclass(frozen=True)
class QueueFacts:
    """What one worker knows of one model at a decision: its queue (the live worker from arrival
    and take events and the bulk count, the simulator from its own queues), where its copy is,
    and what its peers do with it. The driver turns facts into the policy's ``ModelState`` by
    one rule for both."""

    name: str
    waiting: int  # requests in the queue, as this worker counts them
    head_enqueued_at: float | None  # the oldest one's enqueue time
    head_deadline: float | None  # the earliest deadline among them (the head's, usually)
    tier: Tier  # where this worker's copy is
    reload_fits_host: bool  # evicted now, its weights would stay in host memory (a warm reload)
    max_batch_size: int
    max_wait_s: float | None = None
    last_used_at: float | None = None
    served_rps: float = 0.0  # what the peers that hold it drain
    deferred: bool = False  # nobody holds it and a peer is its first taker, for now
    pinned: bool = False  # configured to stay resident: never a victim
    interactive: int | None = None  # of ``waiting``, the interactive class (None: not told apart)
    interactive_enqueued_at: float | None = None  # the oldest interactive one's enqueue time


def reload_tier(tier: Tier, reload_fits_host: bool) -> Tier:
    """The tier a load of the model would come from: its own, or for a resident model the one it
    would be reloaded from if it were evicted now (what evicting it costs)."""
    if tier == "resident":
        return "warm" if reload_fits_host else "cold"
    return tier


class Driver:
    """One worker's policy and cost estimator, and the events that feed them."""

    def __init__(self, policy: Policy, costs: CostEstimator | None = None) -> None:
        self.policy = policy
        self.costs = CostEstimator() if costs is None else costs

    @property
    def name(self) -> str:
        return self.policy.name

    def model_state(self, facts: QueueFacts, now: float) -> ModelState:
        """The policy's view of one model: its load cost by tier, the part of its queue that is
        this worker's (the cluster share, ``policy.share``; nothing while a peer is its first
        taker), its head's age (a queue peers serve is never overdue for us)."""
        resident = facts.tier == "resident"
        load_cost_s = self.costs.load_cost_s(facts.name, reload_tier(facts.tier, facts.reload_fits_host))
        backlog = 0
        if not facts.deferred:
            backlog = self.share(facts.waiting, facts.served_rps, load_cost_s, resident=resident, max_batch_size=facts.max_batch_size)
        head = shared_head(facts.head_enqueued_at, now, facts.served_rps, resident_here=resident)
        interactive = None if facts.interactive is None else min(facts.interactive, backlog)
        return ModelState(
            name=facts.name,
            backlog=backlog,
            oldest_enqueued_at=head if backlog else None,
            earliest_deadline=facts.head_deadline if backlog else None,
            resident=resident,
            load_cost_s=load_cost_s,
            batch_cost=self.costs.batch_cost(facts.name),
            memory_bytes=self.costs.memory_bytes(facts.name),
            max_batch_size=facts.max_batch_size,
            max_wait_s=facts.max_wait_s,
            last_used_at=facts.last_used_at,
            pinned=facts.pinned,
            interactive=interactive,
            # Like the head, a queue peers drain is never urgent for us.
            interactive_enqueued_at=shared_head(facts.interactive_enqueued_at, now, facts.served_rps, resident_here=resident) if interactive else None,
        )

    @staticmethod
    def idle_unloads(state: SchedulerState, idle_s: Mapping[str, float], active_since: Mapping[str, float], now: float) -> list[str]:
        """The resident models to evict for idleness: with an idle limit (``idle_s``), nothing
        waiting, not pinned, and neither a batch nor a load for that long (``active_since``: the
        later of its last batch and its load). The live worker and the simulator evict them when
        they are found, so the device memory goes back within one decision of the limit."""
        out = []
        for name, limit in idle_s.items():
            m = state.models.get(name)
            if m is None or not m.resident or m.pinned or m.backlog:
                continue
            since = active_since.get(name)
            if since is not None and now - since >= limit:
                out.append(name)
        return sorted(out)

    def callers_gone(
        self, model: str, tier: Tier, waiting: Iterable[tuple[float | None, bool]], now: float, *, probe: bool = False
    ) -> tuple[bool, float]:
        """Just before a load of ``model`` (from ``tier``): whether every waiting request's caller
        is gone or will be before it could be answered, so the load would serve nobody.
        ``waiting``: each request's deadline and whether its caller cancelled it. A request is
        gone when cancelled, or when its deadline passes before the load and one batch would end
        (the estimates; ``probe``: only deadlines already passed, so that an inflated estimate
        cannot lock a model out for good). Returns the verdict and the horizon used."""
        horizon_s = 0.0 if probe else self.costs.load_cost_s(model, tier) + self.costs.deadline_estimate_s(model, 1)
        seen = False
        for deadline, cancelled in waiting:
            seen = True
            if not cancelled and not cannot_finish(deadline, now, horizon_s):
                return False, horizon_s
        return seen, horizon_s

    @staticmethod
    def share(waiting: int, served_rps: float, load_cost_s: float, *, resident: bool, max_batch_size: int) -> int:
        """The part of a queue that is this worker's to chase: what the peers holding it would not
        drain within the join horizon of our load, and at least a batch (``policy.share``)."""
        return effective_backlog(waiting, served_rps, join_horizon_s(load_cost_s), resident_here=resident, min_share=max_batch_size)

    def state(
        self, facts: Iterable[QueueFacts], now: float, *, current: str | None, budget: Budget, arrival_order: tuple[str, ...] | None = None
    ) -> SchedulerState:
        """The snapshot the policy decides on (the models ``policy.visible_models`` chose)."""
        models = {f.name: self.model_state(f, now) for f in facts}
        return SchedulerState(models=models, current=current, budget=budget, arrival_order=arrival_order)

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

    def batch_done(self, model: str, *, taken: int, computed: int, seconds: float, now: float, excess: int = 0) -> None:
        """A batch of ``taken`` requests ended; ``computed`` of them ran for ``seconds``,
        ``excess`` of those a tenant's excess (their share of the seconds is the excess's)."""
        if computed > 0:
            self.costs.observe_batch(model, computed, seconds)
        excess_s = seconds * min(excess, computed) / computed if computed > 0 else 0.0
        self.policy.on_batch_done(model, taken, now, seconds, excess_s=excess_s)

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
