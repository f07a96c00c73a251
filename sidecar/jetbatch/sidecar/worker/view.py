"""What the worker knows and says: the scheduler's view of the queues (with the cluster share
applied) and the report it publishes (status and advert). Functions of what they are given:
they read no other module's private state."""

from __future__ import annotations

import heapq
import time
from typing import Collection, Mapping

from jetbatch.sdk import __version__
from jetbatch.sdk.protocol import SidecarReport

from ..policy import Budget, CostEstimator, QueueFacts, drain_rps
from .queues import QueueView
from .residency import Residency
from .slots import Slot

__all__ = ["TENANT_BACKLOG_MAX", "build_report", "queue_facts"]

# Tenants an advert names with their waiting requests (the most waiting first): a bounded advert.
TENANT_BACKLOG_MAX = 64


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
    http: str = "",
) -> SidecarReport:
    """The worker's status and advert (one report). Per-model maps list only the models with
    something to say (waiting, on the device, warm or loading, broken, holding requests back),
    each read from the set its owner keeps (``Residency``, ``QueueView``): made every heartbeat,
    the report walks no registered model beyond those, but ``models``, the names' list copied
    as it is (the advert leaves it out while peers know it: ``ClusterView.advertise``)."""
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
        broken=dict(sorted(residency.broken.items())),
        backlog={name: slots[name].backlog for name in sorted(active)},
        tenant_backlog=dict(heapq.nlargest(TENANT_BACKLOG_MAX, queues.tenant_waiting.items(), key=lambda kv: kv[1])),
        in_flight=dict(in_flight),
        unfetchable={name: slots[name].unfetchable for name in sorted(queues.holding_back) if slots[name].unfetchable},
        drain_rps=drain,
        load_cost_s={name: residency.load_cost_s(slots[name]) for name in sorted(active)},
        memory_bytes=sum(costs.memory_bytes(name) for name in residency.resident_names()),
        memory_budget_bytes=budget.max_bytes,
        max_resident_models=budget.max_models,
        host_memory_bytes=residency.host_used_bytes(),
        host_memory_budget_bytes=residency.host_budget_bytes,
        stats=dict(stats),
        started_at=started_at,
        updated_at=time.time(),
        valid_s=valid_s,
        http=http,
    )


def queue_facts(
    names: Collection[str],
    *,
    slots: Mapping[str, Slot],
    residency: Residency,
    served: Mapping[str, float],
    deferred: Collection[str] = (),
    last_used: Mapping[str, float],
) -> list[QueueFacts]:
    """The core's facts of ``names`` (see ``policy.visible_models``), as the live worker knows
    them: each queue from arrival and take events and the bulk count, where the model's copy is,
    what the peers holding it drain (``served``), whether it is left to a peer's first take
    (``deferred``); the driver turns them into the policy's view by the rule the simulator's
    facts go through too."""
    return [
        QueueFacts(
            name=name,
            waiting=slots[name].backlog,
            head_enqueued_at=slots[name].oldest_enqueued_at,
            head_deadline=slots[name].head_deadline,
            tier=slots[name].tier,
            reload_fits_host=residency.reload_fits_host(slots[name]),
            max_batch_size=slots[name].config.max_batch_size,
            max_wait_s=slots[name].config.max_wait_s,
            last_used_at=last_used.get(name),
            served_rps=served.get(name, 0.0),
            deferred=name in deferred,
            pinned=slots[name].config.pin,
            interactive=slots[name].interactive,
            interactive_enqueued_at=slots[name].interactive_enqueued_at,
        )
        for name in names
    ]
