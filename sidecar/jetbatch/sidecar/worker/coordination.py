"""What one worker does about its peers: its adverts, the share of each queue the peers leave it,
which queues it leaves to a peer's first take, and the claims around a placement change.

With coordination off (``worker.coordinate = false``, or no cluster view) every answer is the
lone worker's: nothing served by peers, nothing deferred, loads without claims. The rules
themselves are the policy core's (``policy.share``, ``Driver.share``); this module feeds them the
cluster view (cluster.py) and carries out the claims.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

import anyio
from jetbatch.sdk.protocol import SidecarReport

from ..cluster import ClusterView
from ..core import ClaimLost, WorkerCore
from ..policy import Budget, deferred_until, first_taker_rank, has_room
from .counters import Counters
from .queues import QueueView
from .residency import Residency
from .slots import Slot

__all__ = ["Coordinator"]

log = logging.getLogger("jetbatch.worker")


class Coordinator:
    """One worker's side of the cluster protocol around :class:`ClusterView`."""

    def __init__(
        self,
        cluster: ClusterView | None,
        *,
        worker_id: str,
        slots: Mapping[str, Slot],
        queues: QueueView,
        residency: Residency,
        core: WorkerCore,
        budget: Budget,
        counters: Counters,
        heartbeat_s: float,
        report: Callable[[], SidecarReport],
    ) -> None:
        self.cluster = cluster
        self.worker_id = worker_id
        self._slots = slots
        self._queues = queues
        self._residency = residency
        self._core = core
        self._budget = budget
        self._counters = counters
        self._heartbeat_s = heartbeat_s
        self._report = report
        self._live: dict[str, float] = {}  # the peers in view at the last departed() call, and when each started
        self._settling: anyio.Event | None = None  # set once the last load's advert and release are done
        self._names = list(slots or ())  # the registered models, as adverts name them (hashed once: cluster.py)

    @property
    def enabled(self) -> bool:
        return self.cluster is not None

    # --- adverts ---------------------------------------------------------------------------

    async def advertise(self) -> None:
        if self.cluster is None:
            return
        started = time.perf_counter()
        await self.cluster.advertise(self._report(), names=self._names)
        self._counters.sample("advert", time.perf_counter() - started)

    async def advertise_forever(self) -> None:
        while True:
            await anyio.sleep(self._heartbeat_s)
            await self.advertise()

    def reports_queues(self) -> bool:
        """Whether this worker's metrics carry the stream's queue depths: every worker counts
        every queue, so one of them reports (the lowest id among the live workers it sees;
        alone, itself) and a sum over workers means what it says."""
        if self.cluster is None:
            return True
        return all(self.worker_id < peer for peer in self.cluster.peers())

    def heard(self) -> bool:
        """Whether anyone hears this worker's take events: a peer in view (a stale view keeps
        every peer last heard), or no cluster view at all (coordination off: peers unknown)."""
        return self.cluster is None or bool(self.cluster.peers())

    def note_trouble(self) -> None:
        if self.cluster is not None:
            self.cluster.note_trouble()

    def knows_peers(self, now: float) -> bool:
        """Whether this worker hears its peers now: coordination on and the view fresh (its own
        advert heard within the TTL, no JetStream trouble lately)."""
        return self.cluster is not None and self.cluster.view_fresh(now)

    def registered_by_peers(self, now: float) -> set[str] | None:
        """The models live peers register (as their adverts last named them; a stale view keeps
        every peer last heard, so what it registered still counts). None while a live peer's
        set is not known (it changed, or the peer has not named it since we heard it: its next
        advert does, as we are new to it): an orphan check on a guess could answer its queues."""
        if self.cluster is None:
            return set()
        registered: set[str] = set()
        for worker in self.cluster.peers(now):
            names = self.cluster.registered(worker)
            if names is None:
                return None
            registered |= names
        return registered

    def departed(self, now: float) -> list[str]:
        """The peers that left the view since the last call: an advert withdrawn, one not heard
        within its timeout while the view is fresh, or one whose process was replaced (the same
        id, restarted at once: its advert's ``started_at`` changed). What a departed peer held
        unacked comes back to the queues at once if it stopped gracefully (it gives them back)
        and when their ack wait ends if it was killed, with no arrival event either way
        (JetStream sends none for a redelivery): the caller counts the queues then."""
        if self.cluster is None:
            return []
        live = {wid: adv.started_at for wid, adv in self.cluster.peers(now).items()}
        gone = [wid for wid, started in self._live.items() if live.get(wid, started) != started or wid not in live]
        self._live = live
        return gone

    def next_departure(self, now: float) -> float:
        """When the first peer in view leaves it unless heard again (inf: none): an idle worker
        wakes then to notice (:meth:`departed`)."""
        return self.cluster.next_expiry(now) if self.cluster is not None else math.inf

    def held_back(self, now: float) -> bool:
        """Whether a peer holds back requests it found unfetchable (``ClusterView.held_back``):
        until its recheck ends (nothing tells when) they are out of this worker's count of a
        model not on its device, and the peer will not fetch them either."""
        return bool(self.cluster.held_back(now)) if self.cluster is not None else False

    def not_ours(self, now: float) -> dict[str, int]:
        """Requests peers hold unacked, per model (``ClusterView.not_ours``; their hold-backs
        only of models not on this device)."""
        if self.cluster is None:
            return {}
        return self.cluster.not_ours(now, resident=self._residency.resident_names())

    # --- the share of each queue -----------------------------------------------------------

    def served(self) -> dict[str, float]:
        """Per model, what peers drain (their adverts), and models a peer is claiming now counted
        as fully served until its advert says more (see :meth:`stand_back`)."""
        served = dict(self.cluster.served_drain_rps()) if self.cluster is not None else {}
        now = time.time()
        for name, until in self._core.standing_back.items():
            if until > now:
                served[name] = math.inf
        return served

    def stand_back(self, model: str) -> None:
        """Leave ``model`` to the peer that holds its claim (or held it when the view went stale)
        for one heartbeat: the next decisions count its backlog as served, so this worker goes on
        with its own work at once instead of deciding the same refused load again and again (the
        failover bench saw thousands a second) or sleeping while its own queues wait. The core
        keeps it and applies it (``ClaimLost``), as it does for the simulator's lost claims."""
        self._core.handle(ClaimLost(model, time.time() + self._heartbeat_s))

    def share(self, slot: Slot, served: dict[str, float] | None = None) -> int:
        """The part of ``slot``'s backlog that is this worker's to serve (``Driver.share``)."""
        served = self.served() if served is None else served
        return self._core.driver.share(
            slot.backlog, served.get(slot.name, 0.0), self._residency.load_cost_s(slot), resident=slot.resident, max_batch_size=slot.config.max_batch_size,
        )  # fmt: skip

    def deferred(self, now: float) -> dict[str, float]:
        """Queues nobody holds whose first taker is a peer (``policy.first_taker_rank``), and
        until when they are left to it; the simulator applies the same rule."""
        if self.cluster is None or not self._queues.waiting:
            return {}
        peers = self.cluster.peers(now)
        if not peers:
            return {}
        held = self.cluster.held_by_peers(now)
        # A peer whose registered set is not known now is no taker (at worst a queue is not left
        # to it for a heartbeat or two).
        serves = {w: self.cluster.registered(w) or frozenset() for w in peers}
        out: dict[str, float] = {}
        costs = self._core.costs
        mine = self._residency.resident_names()
        used = sum(costs.memory_bytes(n) for n in mine)
        for name in self._queues.waiting:
            slot = self._slots[name]
            if slot.resident or name in held or slot.oldest_enqueued_at is None:
                continue
            warm_here = slot.tier == "warm"
            size = costs.memory_bytes(name)

            def room(w: str, size: int = size) -> bool:
                if w == self.worker_id:
                    return has_room(self._budget, len(mine), used, size)
                adv = peers[w]
                budget = Budget(max_bytes=adv.memory_budget_bytes, max_models=adv.max_resident_models)
                return has_room(budget, len(adv.resident) + (1 if adv.loading else 0), adv.memory_bytes, size)

            # Only a peer that serves the model can take it first (workers may serve different models).
            takers = [w for w in peers if name in serves[w]]
            if not takers:
                continue
            rank = first_taker_rank(
                name, self.worker_id, takers, has_room=room,
                has_warm=lambda w, name=name, warm_here=warm_here: warm_here if w == self.worker_id else name in peers[w].warm,
            )  # fmt: skip
            if rank:
                until = deferred_until(rank, slot.oldest_enqueued_at, self._residency.load_cost_s(slot))
                if until > now:
                    out[name] = until
        return out

    # --- placement changes -----------------------------------------------------------------

    def describe(self) -> tuple[dict[str, tuple[list[str], str | None]], str]:
        """The peers' placements and whether the view is fresh (for the load log line)."""
        if self.cluster is None:
            return {}, "fresh"
        peers = {p: (a.resident, a.loading) for p, a in self.cluster.peers().items()}
        return peers, "fresh" if self.cluster.view_fresh() else "stale (kept)"

    async def claim_load(self, slot: Slot, evict: tuple[str, ...], *, for_backlog: bool = True) -> list[str] | None:
        """Before paying a load, claim every model the change touches (``cluster.claim``: two
        workers never change the same models' placement at once), then check again that no peer
        now covers this model's backlog (workers must not all chase one queue). Returns the
        claimed models (:meth:`release` them after the load), or None to stand back.
        ``for_backlog`` False: a load the config asks for (pin, preload), made whatever waits."""
        if self.cluster is None:
            return []
        if self._settling is not None:
            # The last load's release first: a claim of a model it still holds would be refused
            # as a peer's (its keys are ours until deleted).
            await self._settling.wait()
        # Claimed even with no peer in view: a peer that started a moment ago is not in it yet
        # (the failover bench saw two workers load the same first model at startup).
        held = self.cluster.held_by_peers()
        if slot.name in held and not self.cluster.view_fresh():
            # What the peers hold is as last heard before JetStream failed us: taking one of their
            # models on that view is how two workers swapped back and forth after a lost node.
            log.info("not loading %s: a peer held it when the view went stale", slot.name)
            self.stand_back(slot.name)
            return None
        if for_backlog and self.share(slot) == 0:
            return None
        touched = [slot.name, *evict]
        started = time.perf_counter()
        claimed = await self.cluster.claim(touched)
        self._counters.sample("claim", time.perf_counter() - started)
        if claimed is False:
            log.info("another worker is changing the placement of %s now: standing back", " or ".join(sorted(touched)))
            self.stand_back(slot.name)
            return None
        if claimed is None and slot.name in held:
            self.stand_back(slot.name)
            return None  # no claim could be had: never take a peer's model without one
        if claimed and for_backlog and self.share(slot) == 0:
            # A peer that loaded it just before our claim has said so by now: its advert precedes
            # its release in the bucket, and our claim follows the release.
            await self.release(touched)
            return None
        self._residency.announce_loading(slot.name)
        if self.cluster.peers():
            # Peers count our drain from now on. With none in view there is nobody to tell: one
            # that starts meanwhile finds our claim, and reads our advert after the load before
            # the claim is given back.
            await self.advertise()
        return touched if claimed else []

    async def loaded(self, claimed: list[str]) -> None:
        """After a load (or its failure): advertise the new placement, then give the claim back
        (a peer that starts just now and does not know us yet reads the advert first)."""
        if self.cluster is None:
            return
        await self.advertise()
        await self.release(claimed)

    def loaded_soon(self, tg: anyio.abc.TaskGroup, claimed: list[str]) -> None:
        """:meth:`loaded` in ``tg``, beside the loaded model's first batch: two key-value round
        trips (3-4 ms) that no request waits for. The next claim waits for it."""
        if self.cluster is None:
            return
        settling = self._settling = anyio.Event()

        async def settle() -> None:
            try:
                await self.loaded(claimed)
            finally:
                settling.set()

        tg.start_soon(settle)

    async def release(self, models: list[str]) -> None:
        if self.cluster is None:
            return
        started = time.perf_counter()
        await self.cluster.release(models)
        self._counters.sample("release", time.perf_counter() - started)

