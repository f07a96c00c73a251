"""Carrying out a simulated worker's batches and loads: a batch's window and line order
(``policy.BatchWindow``, ``batch_line_first``), its deadline check at its start (the core's
``predicted_s``), its compute and answers on the cost model; a load's claim, consumer and cost;
the warm tier and prefetch (``policy.warm_copy_value``, ``prefetch_choice``). What the core is
told of each (``Fetched``, ``BatchChecked``, ``Computed``, ``BatchDone``, ``Settled``, ``LoadDue``,
``Loaded``, ``Evicted``) goes to it here."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..core import BatchChecked, BatchDone, ClaimLost, Computed, Evicted, Fetch, Fetched, LoadDue, Loaded, LoadModel, Reap, Settled
from ..policy import Tier, batch_line_first, cannot_finish, fits_host, listens, prefetch_choice, warm_copy_value

from .workers import SimWorker

if TYPE_CHECKING:
    from .queues import Request

__all__ = ["SimExecution"]


class SimExecution:
    """The device and host of the simulated workers of ``sim``."""

    def __init__(self, sim: Any) -> None:
        # The Simulation (engine.py) this part belongs to, typed loosely: it imports this module.
        self.sim = sim

    def serve(self, worker: SimWorker, decision: Fetch, cost_s: float = 0.0, *, held: bool = False) -> None:
        m = self.sim.w.models[decision.model]
        q = self.sim.queues[decision.model]
        if not q:
            self.sim.wake(worker, max(self.sim.next_arrival_at(), self.sim.t + 1e-6) if self.sim.next_arrival_at() < math.inf else self.sim.t + 1e-3)
            return
        # As live: a batch computes while earlier ones' answers are stored, as many as the core's
        # turn allowed (its pipeline bound; the device is free here, so none is computing).
        self.settle(worker)
        answering = worker.answering.setdefault(decision.model, [])
        window = self.sim.windows[decision.model]
        limit = max(1, min(decision.max_items, m.max_batch_size))
        # As live: the window opens at the first request the batch takes (its line's head) and
        # closes early enough for its deadline (deadlines are arrival + a per-model constant),
        # given the batch's estimated time.
        bulk_first = batch_line_first(len(q.urgent), len(q.bulk), q.run)
        head = q.first(bulk_first)
        latest_start = head.deadline - worker.costs.deadline_estimate_s(decision.model, limit) if head.deadline is not None else None
        close_at = window.close_at(head.arrival, head.arrival, latest_start)
        if not window.should_close(min(len(q), limit), close_at, self.sim.t) and len(q) < limit:
            # The window is open: committed to it until it closes or fills, as live (no turn between).
            worker.gathering = (decision, held)
            self.sim.wake(worker, max(min(close_at, self.sim.next_arrival_at()), self.sim.t + 1e-9))
            return
        batch: list[Request] = []
        q.count_batch(bulk_first)
        while q and len(batch) < limit:
            if decision.before is not None and batch and q.next.arrival >= decision.before:
                break
            batch.append(q.pop(bulk_first))
        if not q:
            self.sim.nonempty.discard(decision.model)
        worker.core.handle(Fetched(decision.model, len(batch), held=held))
        # As live: a fetch says what its line still holds; deep, the worker stops listening to
        # its arrivals (policy/interest.py) and sees that count until its next take.
        taken = {r.interactive for r in batch}
        for bulk, left in ((False, len(q.urgent)), (True, len(q.bulk))):
            line = (decision.model, bulk)
            if line in worker.quiet and (not bulk) not in taken:
                continue  # a quiet line this batch took nothing from: its count is still its last take's
            filled = not bulk and worker.core.serving == decision.model
            if listens(listening=line not in worker.quiet, draining=True, waiting=left, max_batch_size=m.max_batch_size, filled=filled):
                worker.quiet.pop(line, None)
            else:
                worker.quiet[line] = left
        start = self.sim.t + cost_s + self.sim.control_s("batch_overhead_s")
        predicted_s = worker.core.predicted_s(decision.model, len(batch))
        gone = [r for r in batch if r.gone(self.sim.t)]
        live = [r for r in batch if not cannot_finish(r.deadline, start, predicted_s) and not r.gone(self.sim.t)]
        worker.core.handle(BatchChecked(decision.model, refused_whole=not live and not gone and predicted_s > 0))
        for r in batch:
            if r not in live:
                if r.gone(self.sim.t):
                    self.sim.result.cancelled += 1
                else:
                    self.sim.result.deadline_exceeded += 1
                self._served(r, None, None)
        if not live:
            # As live: a batch refused whole still counts as demand and as use of the model, and
            # stores its answers (the refusals) within the same pipeline bound.
            answering.append(start + self.sim.control_s("answer_s"))
            worker.core.handle(Computed(decision.model))
            worker.core.handle(BatchDone(decision.model, taken=len(batch), computed=0, seconds=0.0, now=self.sim.t))
            self.sim.wake(worker, self.sim.t)
            return
        self.maybe_prefetch(worker, decision.model)
        duration = self.sim.noisy(m.batch_s(len(live))) + self.sim.control_s("compute_excess_s")
        end = start + duration
        answered = end + self.sim.control_s("answer_s")  # the caller has it once stored and sent
        answering.append(answered)
        self.sim.consumers[m.name] = start
        if self.sim.shares is not None:
            self.sim.shares.served(len(live), self.sim.t)  # the classifier hears it from the adverts
        if self.sim.w.tenants:
            by_tenant = self.sim.result.service_s_by_tenant
            # While requests still arrive, shares are what the tenants contend for.
            in_window = start < self.sim.result.offered_s
            window_s, window_n = self.sim.result.window_service_s_by_tenant, self.sim.result.window_completed_by_tenant
            for r in live:
                by_tenant[r.tenant] = by_tenant.get(r.tenant, 0.0) + duration / len(live)
                if in_window:
                    window_s[r.tenant] = window_s.get(r.tenant, 0.0) + duration / len(live)
                    window_n[r.tenant] = window_n.get(r.tenant, 0) + 1
        for r in live:
            self._served(r, start, answered)
            if m.max_wait_s is not None and start - r.arrival > m.max_wait_s + m.load_cost_s + m.batch_s(m.max_batch_size) + 1e-9:
                self.sim.result.late_beyond_bound += 1
        self.sim.result.batches.append((start, end, m.name, len(live), m.name in worker.fresh))
        worker.fresh.discard(m.name)
        worker.busy_until = end
        excess = sum(1 for r in live if r.excess)
        self.sim.wake(worker, end, f"done:batch:{m.name}:{len(live)}/{len(batch)}/{excess}:{duration}")

    def _served(self, r: Request, start: float | None, end: float | None) -> None:
        self.sim.served_ids.add(r.id)
        self.sim.result.served_ids.append(r.id)
        self.sim.tenant_waiting[r.tenant] -= 1
        if start is None or end is None:
            return
        if r.tenant:
            self.sim.result.latency_by_tenant.setdefault(r.tenant, []).append(end - r.arrival)
        self.sim.result.completed += 1
        self.sim.result.waits_s.append(start - r.arrival)
        self.sim.result.latencies_s.append(end - r.arrival)
        self.sim.result.latency_by_model.setdefault(r.model, []).append(end - r.arrival)
        if self.sim.classes:
            self.sim.result.latency_by_class.setdefault("interactive" if r.interactive else "batch", []).append(end - r.arrival)
        self.sim.result.completions.append((end, r.arrival))

    def load(self, worker: SimWorker, decision: LoadModel, cost_s: float = 0.0) -> None:
        q = self.sim.queues[decision.model]
        if q and decision.model not in worker.resident:
            # As live: a queue whose callers are all gone, or will be before the load and a batch
            # end (the estimates; only passed deadlines after PROBE_AFTER_REFUSALS such reaps in
            # a row), is answered without a load.
            tier: Tier = "warm" if decision.model in worker.warm else "cold"
            peer_serves = any(decision.model in p.resident or p.loading == decision.model for p in self.sim.workers if p is not worker)
            waiting = [(r.deadline, r.gone(self.sim.t)) for r in q]
            verdict = worker.core.handle(LoadDue(decision.model, tier, self.sim.t, waiting, peer_serves=peer_serves))
            if isinstance(verdict, Reap):
                while q:
                    r = q.pop()
                    if r.gone(self.sim.t):
                        self.sim.result.cancelled += 1
                    else:
                        self.sim.result.deadline_exceeded += 1
                    self._served(r, None, None)
                self.sim.nonempty.discard(decision.model)
                self.sim.result.reaped_queues += 1
                self.sim.wake(worker, self.sim.t + cost_s)
                return
        if any(p.loading == decision.model for p in self.sim.workers if p is not worker):
            # Another worker holds the load claim: the core leaves the queue to it until its load
            # ends (its advert then says it holds the model) and decides again at once.
            until = max(p.busy_until for p in self.sim.workers if p.loading == decision.model) + 1e-6
            worker.core.handle(ClaimLost(decision.model, until))
            self.sim.wake(worker, self.sim.t + cost_s + self.sim.control_s("claim_s"))  # the claim that was refused
            return
        for victim in decision.evict:
            if victim in worker.resident:
                self.evict(worker, victim)
        m = self.sim.w.models[decision.model]
        if decision.model in worker.resident:
            self.sim.wake(worker, self.sim.t)
            return
        tier = "warm" if decision.model in worker.warm else "cold"
        worker.warm.pop(decision.model, None)
        duration = self.sim.noisy(m.load_s(tier))
        start = self.sim.t + cost_s + self._load_overhead_s()
        last = self.sim.consumers.get(decision.model)
        # A model's consumer is made by its first load, while the model loads (as live), and
        # shared by every worker; the server removes it after consumer_idle_s unused.
        consumer_s = self.sim.control_s("consumer_create_s") if last is None or self.sim.t - last > self.sim.w.control.consumer_idle_s else 0.0
        self.sim.consumers[decision.model] = start
        self.sim.result.load_log.append((start, start + duration, m.name))
        self.sim.result.load_seconds += duration
        self.sim.result.loads += 1
        worker.loading = decision.model
        ready = start + max(duration, consumer_s)
        worker.busy_until = ready
        self.sim.wake(worker, ready, f"done:load:{decision.model}:{tier}:{duration}")

    def _load_overhead_s(self) -> float:
        """The control plane's part of a load that the load waits for: the consumer check, the
        claims, and with peers an advert (key-value round trips). The advert after the load and
        the claims' release run beside its first batch, live, and hold nothing."""
        advert_s = self.sim.control_s("advert_s") if len(self.sim.workers) > 1 else 0.0  # before the load only when peers listen
        return self.sim.w.control.load_overhead_s + self.sim.control_s("claim_s") + advert_s

    def settle(self, worker: SimWorker) -> None:
        """Tell the core of each batch of ``worker`` whose answers are stored by now (it leaves
        its model's pipeline); told before each turn, which is where the core reads them."""
        for model, times in list(worker.answering.items()):
            left = [t for t in times if t > self.sim.t]
            for _ in range(len(times) - len(left)):
                worker.core.handle(Settled(model))
            if left:
                times[:] = left
            else:
                del worker.answering[model]  # a step walks only the models with answers on their way

    def finish(self, worker: SimWorker, kind: str) -> None:
        _, what, model, arg, duration_text = kind.split(":", 4)
        duration = float(duration_text)
        if what == "batch":
            computed, size, excess = arg.split("/")
            worker.core.handle(Computed(model))
            worker.core.handle(BatchDone(model, taken=int(size), computed=int(computed), seconds=duration, now=self.sim.t, excess=int(excess)))
        else:
            worker.loading = None
            worker.resident.append(model)
            worker.fresh.add(model)
            self.sim.result.max_resident_seen = max(self.sim.result.max_resident_seen, len(worker.resident))
            self.sim.result.max_bytes_seen = max(self.sim.result.max_bytes_seen, sum(self.sim.w.models[r].memory_bytes for r in worker.resident))
            worker.core.handle(Loaded(model, arg, duration, self.sim.t, waiting=len(self.sim.queues[model])))  # type: ignore[arg-type]
        if worker.prefetching and worker.prefetching[1] <= self.sim.t:
            self.keep_warm(worker, worker.prefetching[0])
            worker.prefetching = None
        self.sim.wake(worker, self.sim.t)

    def evict(self, worker: SimWorker, name: str) -> None:
        worker.resident.remove(name)
        worker.fresh.discard(name)
        self.keep_warm(worker, name)
        worker.core.handle(Evicted(name, self.sim.t))

    def warm_value(self, worker: SimWorker, name: str) -> float:
        """What keeping ``name`` warm is worth to ``worker`` (``policy.warm_copy_value``, on the
        estimate, as live: the simulated worker does not know the true cost)."""
        recent = worker.driver.demand(name, self.sim.t)
        return warm_copy_value(worker.costs.load_cost_s(name, "cold"), len(self.sim.queues[name]), recent)

    def fits_host(self, worker: SimWorker, model: str) -> bool:
        """Whether the host tier would keep ``model`` evicted (``policy.fits_host``, as live)."""
        sizes = self.sim.w.models
        others = [(sizes[n].memory_bytes, self.warm_value(worker, n)) for n in worker.warm if n != model]
        used = sum(size for size, _ in others)
        return fits_host(self.sim.w.host_budget_bytes, sizes[model].memory_bytes, used, others, self.warm_value(worker, model))

    def keep_warm(self, worker: SimWorker, model: str) -> None:
        """Keep ``model`` in the host tier if it fits, dropping the warm copies worth least."""
        budget = self.sim.w.host_budget_bytes
        size = self.sim.w.models[model].memory_bytes
        if not self.fits_host(worker, model):
            return
        while sum(self.sim.w.models[n].memory_bytes for n in worker.warm) + size > budget and worker.warm:
            del worker.warm[min(worker.warm, key=lambda n: (self.warm_value(worker, n), n))]
        worker.warm[model] = self.sim.t

    def _share(self, worker: SimWorker, name: str) -> int:
        """The part of ``name``'s queue that is ``worker``'s to serve (``Driver.share``, as live)."""
        m = self.sim.w.models[name]
        return worker.driver.share(
            len(self.sim.queues[name]), worker.served_by.get(name, 0.0), worker.costs.load_cost_s(name, "cold"), resident=False,
            max_batch_size=m.max_batch_size,
        )  # fmt: skip

    def maybe_prefetch(self, worker: SimWorker, serving: str) -> None:
        if not self.sim.w.prefetch or self.sim.w.host_budget_bytes <= 0 or worker.prefetching is not None:
            return
        # The live worker's rule, on the backlog that is this worker's (the cluster share).
        cold = [n for n in self.sim.nonempty if n != serving and n not in worker.resident and n not in worker.warm and worker.registers(n)]
        nxt = prefetch_choice((n, self._share(worker, n)) for n in cold)
        if nxt is None:
            return
        m = self.sim.w.models[nxt]
        read_s = max(0.0, m.load_s("cold") - m.load_s("warm"))  # host time, beside the device
        worker.prefetching = (nxt, self.sim.t + read_s)
