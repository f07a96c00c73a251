"""Control inputs that producers may publish, read where a flood costs only the flooder.

A worker's main connection carries its pulls, acks and PubAcks: if nats-server ever finds it a
slow consumer, it cuts it, and every tenant's requests wait. Core NATS subjects any producer may
publish to and a worker subscribes to (the cancel notices, ``docs/security.md``) are therefore
read on a connection of their own, :class:`ControlConnection`, read at a bounded rate
(:class:`RateBound`, all its messages together): a flood past that rate stays in the server's
buffer for that connection, and past the server's limit (``max_pending``, ``write_deadline``)
the server cuts that connection alone, which reconnects. What a flood then costs is the other
control inputs of its time (advisory: a dropped cancel notice means a request is computed) and
the bounded share of the event loop the reads take, never the data path.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetbatch.sdk import failures

from ..config import NatsConfig
from ..errors import TRANSPORT_ERRORS
from ..transport import connect_beside
from .counters import Counters

__all__ = ["ControlConnection", "RateBound", "RatesByKey"]

# The read loop pauses at least this long when its budget is spent: fewer, longer pauses than
# one per message, and each refills this many seconds of budget.
_PAUSE_S = 0.01
# A message costs one unit, and one more for every this many bytes (a big one costs its copies).
_BYTES_A_UNIT = 4096
# The read loop lets the event loop turn after this many messages even with budget left: about a
# millisecond of Python, the most a flood stalls the other tasks at once (a full budget, 1 000
# notices read at a flood's start, stalled the data path 10-15 ms).
_SLICE_MSGS = 50


class RateBound:
    """A token bucket: ``per_s`` units a second, at most ``burst`` saved up (``clock`` in s)."""

    def __init__(
        self,
        per_s: float,
        burst: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_s <= 0:
            raise ValueError(f"per_s must be > 0, got {per_s}")
        self.per_s = per_s
        self.burst = per_s if burst is None else burst
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        return self._tokens

    def take(self, units: float = 1.0) -> bool:
        """Spend ``units`` if they are there now (True), else spend nothing (False)."""
        if self._refill() < units:
            return False
        self._tokens -= units
        return True

    def wait_s(self, units: float = 1.0) -> float:
        """Spend ``units``; how long to wait before the next use so the rate holds (0: none)."""
        self._tokens = self._refill() - units
        return 0.0 if self._tokens >= 0 else max(_PAUSE_S, -self._tokens / self.per_s)


class RatesByKey:
    """One :class:`RateBound` per key (a tenant), for at most ``max_keys`` keys (the least
    recently used goes first: on a server without permissions any token is a tenant)."""

    def __init__(
        self,
        per_s: float,
        *,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_s = per_s
        self.max_keys = max_keys
        self._clock = clock
        self._bounds: OrderedDict[str, RateBound] = OrderedDict()

    def take(self, key: str) -> bool:
        bound = self._bounds.get(key)
        if bound is None:
            bound = self._bounds[key] = RateBound(self.per_s, clock=self._clock)
            while len(self._bounds) > self.max_keys:
                self._bounds.popitem(last=False)
        else:
            self._bounds.move_to_end(key)
        return bound.take()


class ControlConnection:
    """A connection of its own for control inputs, opened beside ``nc`` (the same servers, the
    credentials of ``nats``) and read at most ``read_per_s`` messages a second (a message of
    more than 4 KiB counts once more per 4 KiB). Counts, into ``counters``: ``<what>_dropped``
    for each message its subscriptions' pending limit dropped, ``<what>_connection_cuts`` for each
    time it was cut and reconnected (the server dropped what it held for it), after which it calls
    ``on_reconnected``."""

    def __init__(
        self,
        nc: NATS,
        nats: NatsConfig,
        *,
        read_per_s: float,
        counters: Counters,
        what: str,
        name: str,
        on_reconnected: Callable[[], None] = lambda: None,
    ) -> None:
        self._main = nc
        self._reconnected = on_reconnected
        self._nats = nats
        self._read = RateBound(read_per_s, read_per_s * _PAUSE_S * 10)
        self._counters = counters
        counters.add(f"{what}_connection_cuts", 0)  # shown in the status from the start
        self._what = what
        self._name = name
        self.nc: NATS | None = None

    async def open(self) -> None:
        """Connect (once: a retried startup calls it again)."""
        if self.nc is not None:
            return
        servers = [u.geturl() for u in self._main.servers] or None
        self.nc = await connect_beside(
            self._nats,
            servers,
            name=self._name,
            error_cb=self._on_error,
            reconnected_cb=self._on_reconnected,
        )
        _bound_reads(self.nc, self._read)

    async def subscribe(
        self, subject: str, cb: Callable[[Msg], Awaitable[None]], *, pending_msgs: int
    ) -> Any:
        assert self.nc is not None, "open() first"
        return await self.nc.subscribe(subject, cb=cb, pending_msgs_limit=pending_msgs)

    async def close(self) -> None:
        nc, self.nc = self.nc, None
        if nc is not None:
            try:
                await nc.close()
            except TRANSPORT_ERRORS:
                pass

    async def _on_error(self, exc: Exception) -> None:
        # nats-py reports each message a full subscription dropped; the rest (a reconnect's
        # failed tries) is seen as a cut when it reconnects.
        if isinstance(exc, failures.DROPPED):
            self._counters.add(f"{self._what}_dropped")

    async def _on_reconnected(self) -> None:
        self._counters.add(f"{self._what}_connection_cuts")
        self._reconnected()


def _bound_reads(nc: NATS, bound: RateBound) -> None:
    """Have ``nc``'s read loop pause when ``bound`` is spent. nats-py awaits ``_process_msg``
    for each message before it parses the next and reads the socket again, so a pause there
    leaves the rest with the kernel and the server (TCP's own backpressure), for this
    connection only."""
    process = nc._process_msg
    read = 0  # messages since the loop last turned

    async def bounded(
        sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        nonlocal read
        units = (
            1
            + (len(subject) + len(reply) + len(data) + (len(headers) if headers else 0))
            // _BYTES_A_UNIT
        )
        pause_s = bound.wait_s(units)
        read += 1
        if pause_s or read >= _SLICE_MSGS:
            read = 0
            await asyncio.sleep(pause_s)
        await process(sid, subject, reply, data, headers)

    # The guard's count of unreadable messages (sdk.connection.unreadable_messages) stays readable.
    bounded._jetbatch_guard = getattr(process, "_jetbatch_guard", None)  # type: ignore[attr-defined]
    nc._process_msg = bounded  # type: ignore[method-assign]
