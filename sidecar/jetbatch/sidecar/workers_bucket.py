"""The workers' key-value bucket (adverts and load claims): opened, watched, and opened again.

It is memory state, soft and re-advertised every heartbeat, so a lone nats-server's restart loses
it; :meth:`WorkersBucket.reopen` makes it again (a peer may have made it first) and watches it
afresh. A replaced watcher is stopped only by the reader, between two reads: a watcher stopped
under a waiting read cancels that read, which ended the worker's watch loop.
"""

from __future__ import annotations

from typing import Any

from nats.js import JetStreamContext
from nats.js.api import StorageType

from jetbatch.sdk import failures

from .errors import TRANSPORT_ERRORS
from .buckets import ensure_key_value

__all__ = ["WorkersBucket"]


class WorkersBucket:
    """The bucket ``name`` (entries living ``ttl_s``) and its one watcher."""

    def __init__(self, js: JetStreamContext, name: str, *, ttl_s: float, replicas: int) -> None:
        self._js, self._name, self._ttl_s, self._replicas = js, name, ttl_s, replicas
        self.kv: Any = None
        self._watcher: Any = None
        self._retired: list[Any] = []  # replaced watchers, stopped by the reader between reads

    async def open(self) -> None:
        self.kv = await ensure_key_value(
            self._js,
            self._name,
            description="jetbatch workers: residency and drain rates",
            ttl_s=self._ttl_s,
            storage=StorageType.MEMORY,  # soft state, re-advertised every heartbeat
            replicas=self._replicas,
        )

    async def watch(self) -> None:
        """Start the watcher (after :meth:`open`)."""
        self._watcher = await self.kv.watchall()

    @property
    def watching(self) -> bool:
        return self._watcher is not None

    async def reopen(self) -> bool:
        """Open the bucket again, made again if it is gone, and watch it afresh. False if
        JetStream did not answer (the caller tries again later)."""
        try:
            await self.open()
            watcher = await self.kv.watchall()
        except TRANSPORT_ERRORS + failures.API_ERRORS:
            return False
        self._retired.append(self._watcher)
        self._watcher = watcher
        return True

    async def update(self, timeout_s: float) -> Any:
        """The watcher's next entry (None: the end of the bucket's contents at the watch's start)."""
        while self._retired:
            await _stop(self._retired.pop())
        return await self._watcher.updates(timeout=timeout_s)

    async def stop(self) -> None:
        for watcher in (*self._retired, self._watcher):
            await _stop(watcher)
        self._retired.clear()


async def _stop(watcher: Any) -> None:
    if watcher is not None:
        try:
            await watcher.stop()
        except Exception:  # noqa: BLE001 - a watcher whose bucket or connection is gone
            pass
