"""What a simulated worker knows at a turn: the core's ``Turn``, built from the simulator's
queues as the live worker builds it from its events and counts (the same rules:
``policy.visible_models``, ``policy.listens`` for the lines it does not listen to,
``policy.first_taker_rank`` and ``deferred_until`` for queues left to a peer's first take)."""

from __future__ import annotations

import math
from typing import Any

from ..core import Turn
from ..policy import QueueFacts, Tier, deferred_until, drain_rps, first_taker_rank, has_room, listens, visible_models

from .workers import SimWorker

__all__ = ["WorkerViews"]


class WorkerViews:
    """Turns of the simulated workers of ``sim``."""

    def __init__(self, sim: Any) -> None:
        # The Simulation (engine.py) this part belongs to, typed loosely: it imports this module.
        self.sim = sim

    def turn(self, worker: SimWorker) -> Turn:
        """What ``worker`` knows now, as the core's :class:`Turn`."""
        # What the peers drain per model: a pass over their (few) resident models, not over all
        # models for each peer, so a decision stays cheap at 100 workers x 1000 models.
        served_by: dict[str, float] = {}
        for p in self.sim.workers:
            if p is worker:
                continue
            for name in {*p.resident, *([p.loading] if p.loading else [])}:
                served_by[name] = served_by.get(name, 0.0) + drain_rps(p.costs.batch_cost(name), self.sim.w.models[name].max_batch_size)
        worker.served_by = served_by  # what the peers drain, as this turn saw it (a prefetch reads it)
        facts = []
        defer_until = math.inf
        core = worker.core
        for (name, bulk), seen in list(worker.quiet.items()):
            draining = name == core.current and name in worker.resident
            line = self.sim.queues[name].bulk if bulk else self.sim.queues[name].urgent
            filled = not bulk and name == core.serving
            if listens(listening=False, draining=draining, waiting=min(seen, len(line)), max_batch_size=self.sim.w.models[name].max_batch_size, filled=filled):
                del worker.quiet[(name, bulk)]  # listening again: it sees the line's true count
        slots: dict[str, tuple[int, int]] | None = None  # made when a queue nobody holds needs it
        for name in self._visible(worker):
            m = self.sim.w.models[name]
            q = self.sim.queues[name]
            resident = name in worker.resident
            tier: Tier = "resident" if resident else ("warm" if name in worker.warm else "cold")
            deferred = False
            if q and not resident and name not in served_by and len(self.sim.workers) > 1 and worker.serves is None:
                # Nobody holds it: left to its first taker for a while (the live worker's rule).
                if slots is None:
                    slots = {
                        p.id: (len(p.resident) + (1 if p.loading else 0), sum(self.sim.w.models[r].memory_bytes for r in p.resident))
                        for p in self.sim.workers
                    }
                until = self._deferred_until(worker, name, q.head.arrival, worker.costs.load_cost_s(name, tier), slots)
                if until > self.sim.t:
                    deferred = True
                    defer_until = min(defer_until, until)
            # A line it does not listen to: the count of the last take (less what peers took since).
            urgent, in_bulk = len(q.urgent), len(q.bulk)
            if worker.quiet:
                urgent = min(urgent, worker.quiet.get((name, False), urgent))
                in_bulk = min(in_bulk, worker.quiet.get((name, True), in_bulk))
            facts.append(QueueFacts(
                name=name,
                waiting=urgent + in_bulk,
                head_enqueued_at=q.head.arrival if q else None,
                # Deadlines are arrival + a per-model constant, so the queue's head has the earliest.
                head_deadline=q.head.deadline if q else None,
                tier=tier,
                reload_fits_host=resident and self.sim.execution.fits_host(worker, name),  # keep_warm's rule, as live
                max_batch_size=m.max_batch_size,
                max_wait_s=m.max_wait_s,
                last_used_at=core.last_used.get(name),
                served_rps=served_by.get(name, 0.0),
                deferred=deferred,
                pinned=m.pin,
                interactive=urgent if self.sim.classes else None,
                interactive_enqueued_at=q.urgent[0].arrival if self.sim.classes and q.urgent else None,
            ))  # fmt: skip
        order = None
        if worker.core.wants_arrival_order:
            while self.sim.arrival_log and self.sim.arrival_log[0].id in self.sim.served_ids:
                self.sim.arrival_log.popleft()
            order = [r.model for r in list(self.sim.arrival_log)[:256] if r.id not in self.sim.served_ids]
        return Turn(
            now=self.sim.t, facts=facts, defer_until=defer_until if math.isfinite(defer_until) else None, arrival_order=order,
        )  # fmt: skip

    def next_cancel(self, worker: SimWorker, after: float) -> float:
        """When, after ``after``, the first caller cancels a request ``worker`` knows to wait: the
        SDK's cancel notice wakes the live worker (``Worker._on_cancel``) when it names one it
        heard arrive, so not one on a line it does not listen to (``worker.quiet``, the served
        model's interactive line). Cancel times follow arrival order within a line (arrival +
        the model's ``cancel_after_s``)."""
        if not self.sim.cancels:
            return math.inf
        first = math.inf
        for name in self._waiting(worker):
            q = self.sim.queues[name]
            for bulk, line in ((False, q.urgent), (True, q.bulk)):
                if (name, bulk) in worker.quiet or (not bulk and name == worker.core.serving):
                    continue
                for r in line:
                    if r.cancel_at > after:
                        first = min(first, r.cancel_at)
                        break
        return first

    def _deferred_until(self, worker: SimWorker, name: str, head_at: float, load_cost_s: float, slots: dict[str, tuple[int, int]]) -> float:
        """``slots``: per worker id, its models on the device (loading counted) and their bytes,
        made once per decision."""
        size = self.sim.w.models[name].memory_bytes
        by_id = self.sim.by_id

        def room(w: str) -> bool:
            return has_room(self.sim.w.budget, slots[w][0], slots[w][1], size)

        rank = first_taker_rank(name, worker.id, by_id, has_warm=lambda w: name in by_id[w].warm, has_room=room)
        return deferred_until(rank, head_at, load_cost_s) if rank else -math.inf

    def _waiting(self, worker: SimWorker) -> set[str]:
        """The models with requests queued that ``worker`` registers (all, unless sharded)."""
        return self.sim.nonempty if worker.serves is None else {n for n in self.sim.nonempty if n in worker.serves}

    def _visible(self, worker: SimWorker) -> Any:
        """The models a decision looks at: the live worker's rule (``policy.visible_models``)."""
        return visible_models(
            self.sim.w.models if worker.serves is None else worker.serves, self.sim.t,
            waiting=self._waiting(worker), on_device=worker.resident,
            current=worker.core.current, last_used=worker.core.last_used, demand=worker.driver.demand if worker.driver.has_demand else None,
        )  # fmt: skip
