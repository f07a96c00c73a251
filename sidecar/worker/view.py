"""What the worker knows and says: the scheduler's view of the queues (with the cluster share
applied) and the report it publishes (status and advert). Functions of what they are given:
they read no other module's private state."""

from __future__ import annotations

import time
from typing import Collection, Mapping

from jetbatch import __version__
from jetbatch.sdk.protocol import SidecarReport

from ..policy import Budget, CostEstimator, ModelState, SchedulerState, drain_rps, effective_backlog, join_horizon_s, shared_head
from .queues import QueueView
from .residency import Residency
from .slots import Slot

__all__ = ["build_report", "effective", "scheduler_state"]


def build_report(
    *,
    worker_id: str,
    slots: Mapping[str, Slot],
    queues: QueueView,
    residency: Residency,
    costs: CostEstimator,
    budget: Budget,
    in_flight: Mapping[str, int],
    stats: Mapping[str, int],
    started_at: float,
    valid_s: float,
) -> SidecarReport:
    """The worker's status and advert (one report). Per-model maps list only the models with
    something to say (waiting, on the device, warm or loading): with a thousand registered
    models the advert every peer decodes every heartbeat stays small."""
    drain: dict[str, float] = {}
    active = set(residency.held_names()) | queues.waiting | ({residency.loading} if residency.loading else set())
    for name in active:
        s = slots[name]
        if s.resident or s.name == residency.loading:
            drain[s.name] = drain_rps(costs.batch_cost(s.name), s.config.max_batch_size)
    return SidecarReport(
        role="worker",
        id=worker_id,
        version=__version__,
        models=list(slots),
        resident=[n for n in sorted(active) if slots[n].resident],
        warm=[n for n in sorted(active) if slots[n].tier == "warm"],
        loading=residency.loading,
        broken={s.name: s.broken for s in slots.values() if s.broken},
        backlog={name: slots[name].backlog for name in sorted(active)},
        in_flight=dict(in_flight),
        unfetchable={s.name: s.unfetchable for s in slots.values() if s.unfetchable},
        drain_rps=drain,
        load_cost_s={name: residency.load_cost_s(slots[name]) for name in sorted(active)},
        memory_bytes=sum(costs.memory_bytes(s.name) for s in slots.values() if s.resident),
        memory_budget_bytes=budget.max_bytes,
        max_resident_models=budget.max_models,
        host_memory_bytes=residency.host_used_bytes(),
        host_memory_budget_bytes=residency.host_budget_bytes,
        stats=dict(stats),
        started_at=started_at,
        updated_at=time.time(),
        valid_s=valid_s,
    )


def effective(slot: Slot, served_rps: float, load_cost_s: float) -> int:
    """Work other workers will drain before a load of ours would finish is not ours to chase."""
    return effective_backlog(
        slot.backlog, served_rps, join_horizon_s(load_cost_s), resident_here=slot.resident, min_share=slot.config.max_batch_size
    )


def scheduler_state(
    names: Collection[str],
    now: float,
    *,
    slots: Mapping[str, Slot],
    residency: Residency,
    costs: CostEstimator,
    served: Mapping[str, float],
    current: str | None,
    budget: Budget,
    deferred: Collection[str] = (),
) -> SchedulerState:
    """The policy's snapshot of ``names`` (see ``policy.visible_models``). A queue that peers
    drain counts only for its part that is ours, and never as overdue (``policy.share``): a
    peer's backlog, however old, is no reason for this worker to drop its work and load it.
    A ``deferred`` queue (nobody holds it; a peer is its first taker, ``policy.first_taker_rank``)
    counts as empty for now."""
    models = {}
    for name in names:
        slot = slots[name]
        cfg = slot.config
        load_cost_s = residency.load_cost_s(slot)
        served_rps = served.get(name, 0.0)
        backlog = 0 if name in deferred else effective(slot, served_rps, load_cost_s)
        oldest = shared_head(slot.oldest_enqueued_at, now, served_rps, resident_here=slot.resident)
        models[name] = ModelState(
            name=name,
            backlog=backlog,
            oldest_enqueued_at=oldest if backlog else None,
            earliest_deadline=slot.head_deadline if backlog else None,
            resident=slot.resident,
            load_cost_s=load_cost_s,
            batch_cost=costs.batch_cost(name),
            memory_bytes=costs.memory_bytes(name),
            max_batch_size=cfg.max_batch_size,
            max_wait_s=cfg.max_wait_s,
            last_used_at=slot.last_used_at,
        )
    return SchedulerState(models=models, current=current, budget=budget)
