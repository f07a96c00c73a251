"""Coordination between workers through a JetStream key-value bucket.

Every worker puts its :class:`SidecarReport` (what it holds, what it is loading, how fast it drains
each resident model) under its id every ``heartbeat_s``; the bucket's TTL drops a worker that
stopped advertising. Each worker watches the bucket and turns the view into *effective backlog*
for its own scheduler: a model that other workers already serve counts only for the backlog those
workers would not drain within one load time of ours. So an idle worker prefers unserved work,
a second replica joins a model only when its backlog outruns the replicas serving it, and workers
do not all chase the same longest queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping

import msgspec
from nats.js import JetStreamContext

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import SidecarReport, Subjects

from .errors import TRANSPORT_ERRORS, SidecarError
from .registered import KnownSets, Shipping
from .workers_bucket import WorkersBucket

__all__ = ["CLAIM_PREFIX", "ClusterView", "DuplicateWorkerId"]

# Keys of the workers' bucket that are load claims, not adverts.
CLAIM_PREFIX = "claim."

log = logging.getLogger("jetbatch.cluster")

# Adverts kept at most: far beyond any fleet, a bound on what a bucket flooded with keys (anyone
# who may write to it) costs the view's memory and every decision's scan of it.
MAX_PEERS = 4096

_decoder = msgspec.json.Decoder(SidecarReport)
# How often a second live worker's adverts under this worker's id are logged, at most.
DUPLICATE_LOG_EVERY_S = 30.0


class DuplicateWorkerId(SidecarError):
    """Another live worker advertises under this worker's id: two workers sharing an id each
    take the other's residency and claims for their own and swap models without end."""


@dataclass
class ClusterView:
    """This worker's advert loop and its live view of the others."""

    js: JetStreamContext
    subjects: Subjects
    worker_id: str
    heartbeat_s: float = 1.0
    replicas: int = 1
    # A peer silent this long, while we hear ourselves, is gone. Longer than a NATS reconnect or a
    # stream leader election: a peer that cannot advertise for a few seconds is usually alive.
    peer_timeout_s: float = 5.0
    # The server's max_payload, read at each advert (a reconnect may reach another server).
    max_payload: Callable[[], int] = lambda: 1 << 20

    def __post_init__(self) -> None:
        self._peers: dict[str, SidecarReport] = {}
        self._seen_at: dict[str, float] = {}  # local clock when each advert last arrived
        self._own_seen_at = 0.0  # when our own advert last came back through the watch
        self._trouble_at = -1e18  # when we last saw JetStream fail (a fetch, a put, a stream info)
        self._forgot_at = -math.inf  # when adverts unheard past the timeout were last forgotten
        self._refused = 0  # adverts of new peers refused at MAX_PEERS
        self._bucket = WorkersBucket(self.js, self.subjects.kv_bucket, ttl_s=self.ttl_s, replicas=self.replicas)
        self._opened_at = math.inf  # when the bucket was last opened (start, reopen_if_lost)
        self._own_started_at = 0.0  # our adverts' process start: another under our id has another
        self._duplicate_logged_at = -math.inf
        self.duplicate_adverts = 0  # adverts under our id that we did not put (another live worker's)
        self._first_revision: int | None = None  # the bucket's revision of our first advert
        # Adverts read from the bucket's contents when the watch began, not heard put since: each
        # counts until one and a half heartbeats after it was put (a live peer puts again by then
        # and is heard live), so a dead predecessor of a restarted worker is no peer of it.
        self._unconfirmed: dict[str, float] = {}
        self._initial = True  # the watch still reads the bucket's contents
        # Adverts name the registered models only when a peer may not know them (registered.py).
        self._sets = KnownSets()
        self._shipping = Shipping()

    @property
    def ttl_s(self) -> float:
        # Three missed heartbeats and a worker is gone.
        return 3.0 * self.heartbeat_s

    async def start(self) -> None:
        """Open the bucket and watch it. Raises :class:`DuplicateWorkerId` when another live
        worker advertises under this id (:meth:`_check_id_free`)."""
        await self._bucket.open()
        self._opened_at = time.time()
        await self._check_id_free()
        await self._bucket.watch()

    async def reopen_if_lost(self, now: float | None = None) -> None:
        """Open the bucket again once our own advert has gone unheard for a TTL since it was last
        opened: a nats-server restart loses it, and every claim then waited out 1 s in vain."""
        now = time.time() if now is None else now
        heard_s = now - max(self._own_seen_at, self._opened_at)
        if not self._bucket.watching or heard_s <= self.ttl_s:
            return
        self._opened_at = now
        if await self._bucket.reopen():
            self._initial = True  # the new watcher reads the bucket's contents first
            log.info("workers' bucket reopened: our own advert unheard for %.1f s", heard_s)

    async def _check_id_free(self) -> None:
        """An advert under our id before we put one is either a dead process's (a restart under
        the same id: it expires with the TTL) or a live worker's. A live one puts again within a
        heartbeat: watched for one and a half, and refused if it does. Costs nothing when the key
        is absent (a new id, or an old one already expired)."""
        try:
            first = await self._bucket.kv.get(self.worker_id)
        except failures.NOT_FOUND:
            return
        except TRANSPORT_ERRORS as exc:
            log.debug("worker id check skipped: %r", exc)
            return
        deadline = time.monotonic() + 1.5 * self.heartbeat_s
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.1, self.heartbeat_s / 4))
            try:
                entry = await self._bucket.kv.get(self.worker_id)
            except failures.NOT_FOUND:
                return  # expired or withdrawn: its process is gone
            except TRANSPORT_ERRORS:
                return
            if entry.revision != first.revision and entry.value:
                raise DuplicateWorkerId(
                    f"worker id {self.worker_id!r} is in use by another live worker: give each worker its own id "
                    "(worker.id, JETBATCH_WORKER__ID), or none for <host>-<pid>"
                )

    async def watch(self) -> None:
        """Keep the view of the peers current; run it in the worker's task group."""
        assert self._bucket.watching, "start() first"
        while True:
            try:
                entry = await self._bucket.update(self.heartbeat_s * 5)
            except failures.TIMEOUTS:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a watch error must not kill the worker
                log.debug("kv watch error: %r", exc)
                await asyncio.sleep(self.heartbeat_s)
                continue
            if entry is None:  # end of the initial values
                self._initial = False
                continue
            if entry.key.startswith(CLAIM_PREFIX):
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._peers.pop(entry.key, None)
                self._seen_at.pop(entry.key, None)
                self._unconfirmed.pop(entry.key, None)
                self._sets.forget(entry.key)
                continue
            now = time.time()
            if entry.key not in self._peers and len(self._peers) >= MAX_PEERS:
                self._forget_unheard(now)
                if len(self._peers) >= MAX_PEERS:
                    self._refused += 1
                    if self._refused == 1 or self._refused % 1000 == 0:
                        log.warning("%d adverts of new workers ignored: %d kept already (MAX_PEERS)", self._refused, len(self._peers))
                    continue
            try:
                advert = _decoder.decode(entry.value)
            except msgspec.DecodeError:
                continue
            before = self._peers.get(entry.key)
            if entry.key != self.worker_id and (before is None or before.started_at != advert.started_at):
                self._shipping.newcomer()  # it knows nothing of our registered set yet
            self._peers[entry.key] = advert
            self._sets.heard(entry.key, advert)
            self._seen_at[entry.key] = now
            if self._initial:
                self._unconfirmed[entry.key] = _put_at(entry.created, now) + 1.5 * self.heartbeat_s
            else:
                self._unconfirmed.pop(entry.key, None)
            if entry.key == self.worker_id:
                self._own_seen_at = now
                # Only puts after our first (an older one is a dead process's, left to expire),
                # told apart by the process start they carry: a put of ours delayed by an
                # outage still carries ours.
                first, theirs = self._first_revision, self._peers[entry.key].started_at
                if first is not None and (entry.revision or 0) > first and theirs and self._own_started_at and theirs != self._own_started_at:
                    self._note_duplicate(now)
            if now - self._forgot_at > self.heartbeat_s:
                # Here only: a fresh view hears its own advert every heartbeat, so this runs
                # whenever forgetting can happen (not in peers(), several times a decision).
                self._forget_unheard(now)

    async def advertise(self, advert: SidecarReport, *, names: list[str] | None = None) -> None:
        """Put ``advert``, naming the registered models (``names``, a list the caller keeps: hashed
        once; by default its ``models``) only when a peer may not know them (registered.py)."""
        if self._bucket.kv is None:
            return
        now = time.time()
        data, shipped = self._shipping.encode(advert, advert.models if names is None else names, now, self.max_payload())
        self._own_started_at = advert.started_at
        try:
            revision = await self._bucket.kv.put(self.worker_id, data)
            self._shipping.sent(*shipped)
            if self._first_revision is None:
                self._first_revision = revision
        except TRANSPORT_ERRORS as exc:
            log.debug("advert failed: %r", exc)
            self.note_trouble()
        await self.reopen_if_lost(now)

    def _note_duplicate(self, now: float) -> None:
        """An advert under our id that we did not put: a second live worker shares the id (two
        started together, or a copied config). Both keep serving, but their placement swaps:
        said loudly, at most every :data:`DUPLICATE_LOG_EVERY_S`."""
        self.duplicate_adverts += 1
        if now - self._duplicate_logged_at >= DUPLICATE_LOG_EVERY_S:
            self._duplicate_logged_at = now
            log.error(
                "another live worker advertises under this worker's id %r (%d adverts so far): give each worker its own id; "
                "two workers sharing one swap models without end", self.worker_id, self.duplicate_adverts,
            )  # fmt: skip

    @staticmethod
    def _claim_key(model: str) -> str:
        return f"{CLAIM_PREFIX}{model}"

    async def claim(self, models: Iterable[str]) -> bool | None:
        """Atomically claim every model a placement change touches: the one to load and the
        ones to evict. Each claim is a key-value create, which exactly one of several workers
        wins; they are taken in name order and all given back if one is lost, so two changes
        that share a model cannot both go ahead. Two workers swapping models (A: m1 → m2, B: m2 →
        m1) both need m1 and m2: one stands back. True: all claimed; False: another worker holds
        one; None: the bucket did not answer (the caller decides what is safe without it). A
        claim expires with the bucket's TTL if its holder dies."""
        if self._bucket.kv is None:
            return True
        taken: list[str] = []
        for model in sorted(set(models)):
            try:
                await self._bucket.kv.create(self._claim_key(model), self.worker_id.encode())
                taken.append(model)
                continue
            except failures.CONFLICT:
                try:
                    entry = await self._bucket.kv.get(self._claim_key(model))
                    mine = entry.value == self.worker_id.encode()
                except TRANSPORT_ERRORS:
                    mine = False
                if mine:
                    taken.append(model)
                    continue
                await self.release(taken)
                return False
            except TRANSPORT_ERRORS as exc:
                log.debug("load claim for %s failed: %r", model, exc)
                self.note_trouble()
                await self.release(taken)
                return None
        return True

    async def release(self, models: Iterable[str]) -> None:
        if self._bucket.kv is None:
            return
        for model in models:
            try:
                await self._bucket.kv.delete(self._claim_key(model))
            except TRANSPORT_ERRORS:
                pass  # the TTL clears it

    def registered(self, worker: str) -> frozenset[str] | None:
        """A peer's registered models as its adverts last named them (None: not known now)."""
        advert = self._peers.get(worker)
        return None if advert is None else self._sets.of(worker, advert)

    def held_by_peers(self, now: float | None = None) -> set[str]:
        """Models a live peer has on its device or is loading (as last heard)."""
        held: set[str] = set()
        for adv in self.peers(now).values():
            held.update(adv.resident)
            if adv.loading:
                held.add(adv.loading)
        return held

    async def withdraw(self) -> None:
        """Remove this worker's advert (graceful stop) so peers react at once."""
        if self._bucket.kv is None:
            return
        try:
            await self._bucket.kv.delete(self.worker_id)
        except TRANSPORT_ERRORS:
            pass

    async def stop(self) -> None:
        await self._bucket.stop()

    def note_trouble(self, now: float | None = None) -> None:
        """JetStream just failed us (a fetch, a put): peers silent now are likely in the same
        trouble (a lost node, an election), not dead. Nobody is expired for ``peer_timeout_s``."""
        self._trouble_at = time.time() if now is None else now

    def view_fresh(self, now: float | None = None) -> bool:
        """Whether silence means something: our own advert came back through the watch within the
        TTL, and JetStream has not failed us for ``peer_timeout_s``. While it does not (a NATS
        node lost, a reconnect, an election), the last view is kept as it was: peers we cannot
        hear are not gone, and chasing their models would thrash placement."""
        now = time.time() if now is None else now
        return now - self._own_seen_at <= self.ttl_s and now - self._trouble_at > self.peer_timeout_s

    @property
    def heard(self) -> int:
        """How many adverts the view holds, live or not (this worker's own among them)."""
        return len(self._peers)

    def _forget_unheard(self, now: float) -> None:
        """Forget the adverts unheard past the timeout, while the view is fresh: the bucket drops
        an expired advert with no event to its watchers, so without this every worker id ever
        heard (each restarted process has a new one; a flood of keys, thousands) stayed, and
        every decision scanned it. One heard again is read again."""
        if not self.view_fresh(now):
            return  # peers we cannot hear are not gone (view_fresh)
        self._forgot_at = now
        timeout_s = max(self.ttl_s, self.peer_timeout_s)
        for wid in [w for w, at in self._seen_at.items() if now - at > timeout_s]:
            del self._seen_at[wid]
            self._peers.pop(wid, None)
            self._unconfirmed.pop(wid, None)
            self._sets.forget(wid)

    def peers(self, now: float | None = None) -> dict[str, SidecarReport]:
        """Live peers (not this worker): adverts heard within ``peer_timeout_s``, on our own clock.
        With a stale view (see :meth:`view_fresh`) every peer last heard is kept."""
        now = time.time() if now is None else now
        fresh = self.view_fresh(now)
        return {
            wid: adv
            for wid, adv in self._peers.items()
            if wid != self.worker_id
            and (not fresh or now - self._seen_at.get(wid, 0.0) <= max(self.ttl_s, self.peer_timeout_s))
            and self._unconfirmed.get(wid, math.inf) >= now
        }

    def next_expiry(self, now: float | None = None) -> float:
        """When the first live peer leaves :meth:`peers` unless it is heard again (wall clock;
        inf with no peer, or with a stale view, which keeps every peer)."""
        now = time.time() if now is None else now
        if not self.view_fresh(now):
            return math.inf
        timeout_s = max(self.ttl_s, self.peer_timeout_s)
        return min(
            (min(self._seen_at.get(w, 0.0) + timeout_s, self._unconfirmed.get(w, math.inf)) for w in self.peers(now)), default=math.inf
        )

    def not_ours(self, now: float | None = None, *, resident: Collection[str] = ()) -> dict[str, int]:
        """Per model, delivered-but-unacked messages the peers account for (their in-flight, and
        what they found unfetchable): not backlog for this worker to chase. What peers found
        unfetchable only for models not ``resident`` here: it spares a load for requests
        delivered elsewhere, but chasing it on the device costs one fetch, and two workers each
        counting the other's hold-back left a dead peer's requests to both for a recheck."""
        total: dict[str, int] = {}
        for adv in self.peers(now).values():
            for model in set(adv.in_flight) | set(adv.unfetchable):
                unfetchable = 0 if model in resident else adv.unfetchable.get(model, 0)
                total[model] = max(total.get(model, 0), adv.in_flight.get(model, 0) + unfetchable)
        return total

    def held_back(self, now: float | None = None) -> set[str]:
        """Models of which a live peer advertises requests it found unfetchable: held back (and
        out of our count of a model not on our device, :meth:`not_ours`) until its recheck,
        which no event announces."""
        return {m for adv in self.peers(now).values() for m, n in adv.unfetchable.items() if n > 0}

    def served_drain_rps(self, now: float | None = None) -> Mapping[str, float]:
        """Per model, the requests/s that other workers holding (or loading) it can drain."""
        total: dict[str, float] = {}
        for adv in self.peers(now).values():
            for model in adv.resident:
                total[model] = total.get(model, 0.0) + max(adv.drain_rps.get(model, 0.0), 1e-9)
            if adv.loading:
                total[adv.loading] = total.get(adv.loading, 0.0) + max(adv.drain_rps.get(adv.loading, 0.0), 1e-9)
        return total


def _put_at(created: object, now: float) -> float:
    """When an advert was put (the stream's timestamp, a datetime), on our clock as far as the
    two agree; never later than ``now`` (a server clock ahead of ours)."""
    timestamp = getattr(created, "timestamp", None)
    return min(float(timestamp()), now) if callable(timestamp) else now
