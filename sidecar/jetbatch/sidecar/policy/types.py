"""What the scheduler sees and says: the state snapshot a policy decides on, its decisions, the
memory budget and the policy protocol. Pure data, no I/O and no clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from .costs import BatchCost

__all__ = ["Budget", "Decision", "Idle", "Load", "ModelState", "Policy", "SchedulerState", "Serve", "fits"]


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
    # Bounded-waiting target for this model's requests; None: derived from the traffic (the cycle
    # the load costs and the utilisation force, see CostAware).
    max_wait_s: float | None = None
    earliest_deadline: float | None = None  # earliest request deadline among waiting requests, if known
    last_used_at: float | None = None  # when this model last served a batch (for LRU baselines)
    pinned: bool = False  # never evicted (configured `pin = true`)
    # Of the backlog, requests of the interactive class (``Jetbatch-Priority``) and the oldest
    # one's enqueue time. None: the caller does not tell classes apart, all count as interactive.
    interactive: int | None = None
    interactive_enqueued_at: float | None = None


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

    def on_batch_done(self, model: str, size: int, now: float, device_s: float = 0.0, *, excess_s: float = 0.0) -> None:
        """A batch of ``size`` requests of ``model`` finished; it held the device ``device_s``,
        ``excess_s`` of them for a tenant's excess (requests moved to the batch line beyond the
        tenant's fair share, docs/tenancy.md)."""

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
