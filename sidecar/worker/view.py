"""What the worker knows and says: the scheduler's view of the queues (with the cluster share
applied) and the report it publishes (status and advert)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jetbatch import __version__
from jetbatch.sdk.protocol import SidecarReport

from ..policy import ModelState, SchedulerState, effective_backlog
from .parts import Slot

if TYPE_CHECKING:
    from .loop import Worker

__all__ = ["build_report", "effective", "in_flight_by_model", "scheduler_state"]


def build_report(self: "Worker") -> SidecarReport:
    """The worker's status and advert (one report)."""
    drain: dict[str, float] = {}
    for s in self.slots.values():
        if s.resident or s.name == self.residency.loading:
            n = s.config.max_batch_size
            drain[s.name] = n / max(self.costs.batch_cost(s.name).seconds(n), 1e-6)
    return SidecarReport(
        role="worker",
        id=self.worker_id,
        version=__version__,
        models=list(self.slots),
        resident=[s.name for s in self.slots.values() if s.resident],
        warm=[s.name for s in self.slots.values() if s.tier == "warm"],
        loading=self.residency.loading,
        broken={s.name: s.broken for s in self.slots.values() if s.broken},
        backlog={s.name: s.backlog for s in self.slots.values()},
        in_flight=self._in_flight_by_model(),
        unfetchable={s.name: s.unfetchable for s in self.slots.values() if s.unfetchable},
        drain_rps=drain,
        load_cost_s={name: self.residency.load_cost_s(s) for name, s in self.slots.items()},
        memory_bytes=sum(self.costs.memory_bytes(s.name) for s in self.slots.values() if s.resident),
        memory_budget_bytes=self.budget.max_bytes,
        host_memory_bytes=self.residency.host_used_bytes(),
        host_memory_budget_bytes=self.residency.host_budget_bytes,
        stats=dict(self.stats),
        started_at=self._started_at,
        updated_at=time.time(),
        valid_s=self.config.worker.peer_timeout_s,
    )


def in_flight_by_model(self: "Worker") -> dict[str, int]:
    out: dict[str, int] = {}
    for m in self._in_flight_msgs.values():
        name = self.subjects.model_from_subject(m.subject) or ""
        out[name] = out.get(name, 0) + 1
    return out


def effective(self: "Worker", slot: Slot, served: dict[str, float] | None = None) -> int:
    """Work other workers will drain before a load of ours would finish is not ours to chase."""
    if served is None:
        served = dict(self.cluster.served_drain_rps()) if self.cluster is not None else {}
    return effective_backlog(slot.backlog, served.get(slot.name, 0.0), self.residency.load_cost_s(slot), resident_here=slot.resident)


def scheduler_state(self: "Worker") -> SchedulerState:
    served = dict(self.cluster.served_drain_rps()) if self.cluster is not None else {}
    models = {}
    for name, slot in self.slots.items():
        cfg = slot.config
        load_cost_s = self.residency.load_cost_s(slot)
        backlog = self._effective_backlog(slot, served)
        models[name] = ModelState(
            name=name,
            backlog=backlog,
            oldest_enqueued_at=slot.oldest_enqueued_at if backlog else None,
            earliest_deadline=slot.head_deadline if backlog else None,
            resident=slot.resident,
            load_cost_s=load_cost_s,
            batch_cost=self.costs.batch_cost(name),
            memory_bytes=self.costs.memory_bytes(name),
            max_batch_size=cfg.max_batch_size,
            max_wait_s=cfg.max_wait_ms / 1000.0 if cfg.max_wait_ms is not None else None,
            last_used_at=slot.last_used_at,
        )
    return SchedulerState(models=models, current=self._current, budget=self.budget)

