"""Coordination between workers through a JetStream key-value bucket.

Every worker puts a :class:`WorkerAdvert` (what it holds, what it is loading, how fast it drains
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
import time
from dataclasses import dataclass
from typing import Mapping

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType

from sdk.protocol import Subjects

__all__ = ["ClusterView", "WorkerAdvert", "effective_backlog"]

log = logging.getLogger("jetbatch.cluster")


class WorkerAdvert(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker tells the others (JSON in the bucket, key = worker id)."""

    id: str
    models: list[str]  # models it can serve
    resident: list[str]  # loaded now
    loading: str | None = None  # being loaded now: counts as served
    drain_rps: dict[str, float] = {}  # requests/s it can drain per resident model
    load_cost_s: dict[str, float] = {}
    memory_used_bytes: int = 0
    memory_budget_bytes: int | None = None
    updated_at: float = 0.0  # Unix seconds


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkerAdvert)


def effective_backlog(
    backlog: int, served_drain_rps: float, horizon_s: float, *, resident_here: bool
) -> int:
    """Backlog left for this worker to justify a load: what the other replicas would not drain
    within ``horizon_s`` (our load time). A model resident here keeps its full backlog: we share
    its queue with the other replicas and serving it costs us no load."""
    if resident_here or served_drain_rps <= 0:
        return backlog
    return max(0, int(backlog - served_drain_rps * horizon_s))


@dataclass
class ClusterView:
    """This worker's advert loop and its live view of the others."""

    js: JetStreamContext
    subjects: Subjects
    worker_id: str
    heartbeat_s: float = 1.0
    replicas: int = 1

    def __post_init__(self) -> None:
        self._peers: dict[str, WorkerAdvert] = {}
        self._kv: object | None = None
        self._watcher: object | None = None

    @property
    def ttl_s(self) -> float:
        # Three missed heartbeats and a worker is gone.
        return 3.0 * self.heartbeat_s

    async def start(self) -> None:
        bucket = self.subjects.kv_bucket
        try:
            self._kv = await self.js.key_value(bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            try:
                self._kv = await self.js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket,
                        description="jetbatch workers: residency and drain rates",
                        history=1,
                        ttl=self.ttl_s,
                        storage=StorageType.MEMORY,  # soft state, re-advertised every heartbeat
                        replicas=self.replicas,
                    )
                )
            except nats.js.errors.BadRequestError:
                self._kv = await self.js.key_value(bucket)  # created concurrently by a peer
        self._watcher = await self._kv.watchall()  # type: ignore[attr-defined]

    async def watch(self) -> None:
        """Keep the view of the peers current; run it in the worker's task group."""
        assert self._watcher is not None, "start() first"
        while True:
            try:
                entry = await self._watcher.updates(timeout=self.heartbeat_s * 5)  # type: ignore[attr-defined]
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a watch error must not kill the worker
                log.debug("kv watch error: %r", exc)
                await asyncio.sleep(self.heartbeat_s)
                continue
            if entry is None:  # end of the initial values
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._peers.pop(entry.key, None)
                continue
            try:
                self._peers[entry.key] = _decoder.decode(entry.value)
            except msgspec.DecodeError:
                continue

    async def advertise(self, advert: WorkerAdvert) -> None:
        if self._kv is None:
            return
        try:
            await self._kv.put(self.worker_id, _encoder.encode(advert))  # type: ignore[attr-defined]
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            log.debug("advert failed: %r", exc)

    async def withdraw(self) -> None:
        """Remove this worker's advert (graceful stop) so peers react at once."""
        if self._kv is None:
            return
        try:
            await self._kv.delete(self.worker_id)  # type: ignore[attr-defined]
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            pass

    async def stop(self) -> None:
        if self._watcher is not None:
            try:
                await self._watcher.stop()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001
                pass

    def peers(self, now: float | None = None) -> dict[str, WorkerAdvert]:
        """Live peers (not this worker), dropping adverts older than the TTL."""
        now = time.time() if now is None else now
        return {
            wid: adv
            for wid, adv in self._peers.items()
            if wid != self.worker_id and now - adv.updated_at <= self.ttl_s
        }

    def served_drain_rps(self, now: float | None = None) -> Mapping[str, float]:
        """Per model, the requests/s that other workers holding (or loading) it can drain."""
        total: dict[str, float] = {}
        for adv in self.peers(now).values():
            for model in adv.resident:
                total[model] = total.get(model, 0.0) + max(adv.drain_rps.get(model, 0.0), 1e-9)
            if adv.loading:
                total[adv.loading] = total.get(adv.loading, 0.0) + max(adv.drain_rps.get(adv.loading, 0.0), 1e-9)
        return total

    def holders(self, now: float | None = None) -> dict[str, list[str]]:
        """Model → worker ids holding it (this worker included when it advertised itself)."""
        out: dict[str, list[str]] = {}
        for wid, adv in self._peers.items():
            if (time.time() if now is None else now) - adv.updated_at > self.ttl_s:
                continue
            for model in adv.resident:
                out.setdefault(model, []).append(wid)
        return out
