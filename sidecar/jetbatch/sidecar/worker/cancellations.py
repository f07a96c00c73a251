"""Requests whose callers gave up before their deadline.

A caller whose task is cancelled (the SDK does this on ``asyncio.CancelledError``) publishes the
request id to ``<prefix>.cancel`` or, for a tenant, ``<prefix>.cancel.<tenant>`` (core NATS, best
effort). Every worker keeps the ids it heard for a while, keyed by the tenant of the subject the
notice came on: a tenant's cancel reaches only its own requests (the server's permissions tie the
subject to the tenant, the classifier stamps the request's tenant; ``docs/security.md``), and a
notice on the plain subject only requests that came with no tenant.

What a cancel changes: a model is not loaded for a queue whose every caller is gone (cancelled,
or past its deadline by the time the load would end: ``Driver.callers_gone``), and the request is
answered ``cancelled`` (stored, acked) instead of computed (``BatchRunner``), its queue's reap
included. It stays in the backlog count until then: a request taken out of the count would
never be fetched and answered, and would stay in the stream. A cancel that arrives after the batch
formed changes nothing: the answer is computed and stored once, as for any request.

Hostile input: the body is one request id (a subject token, at most 64 characters); anything
else is ignored. The notices are read on a connection of their own, never the one that carries
the worker's pulls and acks, at most ``read_per_s`` a second (worker/control.py): a flood costs
the notices of its time, not the data path. Each tenant's notices enter the table at most
``per_tenant_per_s`` a second, the rest dropped and counted (``cancels_dropped``), so one
tenant's flood cannot push the others' notices out. The table is bounded (``max_entries``,
oldest first out) and forgets an id after ``ttl_s``. A notice dropped or forgotten only means its
request is computed, as if never cancelled.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from jetbatch.sdk.protocol import Subjects
from nats.aio.msg import Msg

from ..config import NatsConfig
from ..errors import unsubscribe_all
from .control import ControlConnection, RatesByKey
from .counters import Counters

__all__ = ["Cancellations", "RequestKey", "request_key"]

log = logging.getLogger("jetbatch.worker")

RequestKey = tuple[str, str]  # (tenant, or "" for none; request id)
_ID_RE = re.compile(rb"\A[A-Za-z0-9_-]{1,64}\Z")
# What the notices may cost a worker: reads a second, all tenants together, and notices a second
# that one tenant gets into the table. A caller cancels a request once, so a tenant's rate is its
# rate of requests given up; beyond it, its requests are computed.
READ_PER_S = 10_000.0
PER_TENANT_PER_S = 2_000.0
# A few batches of notices wait for the callback; beyond, nats-py drops them (counted).
_PENDING_MSGS = 4_096


def request_key(tenant: str | None, request_id: str) -> RequestKey:
    return (tenant or "", request_id)


class Cancellations:
    """The cancel notices this worker heard, for ``ttl_s`` each (at most ``max_entries``)."""

    def __init__(
        self,
        nc: Any,
        subjects: Subjects,
        *,
        on_cancel: Callable[[RequestKey], None] = lambda key: None,
        max_entries: int = 100_000,
        ttl_s: float = 900.0,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.time,
        nats: NatsConfig | None = None,
        read_per_s: float = READ_PER_S,
        per_tenant_per_s: float = PER_TENANT_PER_S,
    ) -> None:
        self._subjects = subjects
        self._on_cancel = on_cancel
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._counters = Counters() if counters is None else counters
        self._counters.add("cancels_dropped", 0)  # shown in the status from the start
        self._expires: OrderedDict[RequestKey, float] = OrderedDict()
        self._rates = RatesByKey(per_tenant_per_s, clock=clock)
        # ``nc`` only tells where to connect: the notices never share its connection.
        self._control = None if nc is None else ControlConnection(
            nc, nats or NatsConfig(), read_per_s=read_per_s, counters=self._counters, what="cancels", name="jetbatch-worker-control",
        )  # fmt: skip
        self._subs: list[Any] = []

    @property
    def connection(self) -> Any:
        """The connection the notices are read on (None before :meth:`start`)."""
        return None if self._control is None else self._control.nc

    async def start(self) -> None:
        """Connect and subscribe (once: a retried startup calls it again)."""
        if not self._subs and self._control is not None:
            await self._control.open()
            for subject in (self._subjects.cancel(), self._subjects.cancel_wildcard):
                self._subs.append(await self._control.subscribe(subject, self._on_msg, pending_msgs=_PENDING_MSGS))

    async def stop(self) -> None:
        await unsubscribe_all(*self._subs)
        self._subs = []
        if self._control is not None:
            await self._control.close()

    async def _on_msg(self, msg: Msg) -> None:
        self.note(msg.subject, msg.data)

    def note(self, subject: str, data: bytes) -> bool:
        """One notice (the subscription's callback, callable from tests); False when ignored or
        dropped (past its tenant's rate)."""
        ok, tenant = self._subjects.tenant_from_cancel(subject)
        if not ok or not isinstance(data, (bytes, bytearray)) or not _ID_RE.match(data):
            return False
        if not self._rates.take(tenant or ""):
            self._counters.add("cancels_dropped")
            return False
        key = request_key(tenant, data.decode())
        now = self._clock()
        self._forget_expired(now)
        self._expires.pop(key, None)
        self._expires[key] = now + self.ttl_s
        while len(self._expires) > self.max_entries:
            self._expires.popitem(last=False)
        self._counters.add("cancels_heard")
        self._on_cancel(key)
        return True

    def cancelled(self, tenant: str | None, request_id: str) -> bool:
        """Whether the caller of ``request_id`` (of ``tenant``) said it gave up."""
        if not self._expires:
            return False  # asked for every arrival and every request: mostly nothing was heard
        expires = self._expires.get(request_key(tenant, request_id))
        return expires is not None and expires > self._clock()

    def __len__(self) -> int:
        return len(self._expires)

    def _forget_expired(self, now: float) -> None:
        # One ttl for all: insertion order is expiry order.
        while self._expires:
            key, expires = next(iter(self._expires.items()))
            if expires > now:
                break
            del self._expires[key]
