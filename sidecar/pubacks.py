"""JetStream publishes acknowledged in bulk: many messages out, their PubAcks back on one
subscription, each resolving a future.

nats-py's ``js.publish`` is a request per message and its ``publish_async`` wraps every publish in
``asyncio.wait_for``: on Python 3.11 each is a task, and in the profile of docs/benchmarks.md they
were a third of the cost of storing an answer. The sidecars publish per batch (the results store,
the classifier's republish), so they send a batch's messages back to back here and wait once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

__all__ = ["PubAcks", "PublishRefused", "settled"]


class PublishRefused(Exception):
    """JetStream did not store a message: its PubAck carried an error, or no stream answered.
    ``err_code`` is the JetStream API error code when there was one."""

    def __init__(self, detail: str, err_code: int | None = None) -> None:
        super().__init__(detail)
        self.err_code = err_code


class PubAcks:
    """Publish to JetStream on ``nc`` and collect the PubAcks. A future the caller gives up on
    (cancels) is forgotten here too; a PubAck that arrives later is dropped."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = f"{nc.new_inbox()}."
        self._sub: Any = None
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._next = 0

    async def publish(self, subject: str, body: bytes, headers: dict[str, str]) -> asyncio.Future[dict[str, Any]]:
        """Send one message; the future resolves to its PubAck (a dict) or fails with
        :class:`PublishRefused`. Raises what ``nc.publish`` raises (closed, buffer full, ...)."""
        if self._sub is None:
            self._sub = await self._nc.subscribe(f"{self._prefix}*", cb=self._on_ack)
        self._next += 1
        token = str(self._next)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[token] = fut
        fut.add_done_callback(lambda _: self._waiting.pop(token, None))
        try:
            await self._nc.publish(subject, body, reply=self._prefix + token, headers=headers)
        except BaseException:
            fut.cancel()
            raise
        return fut

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._waiting.get(msg.subject[len(self._prefix) :])
        if fut is None or fut.done():
            return
        try:
            ack = msgspec.json.decode(msg.data) if msg.data else None
        except msgspec.DecodeError:
            ack = None
        if isinstance(ack, dict) and "error" not in ack and "stream" in ack:
            fut.set_result(ack)
            return
        # No stream (a 503 status with an empty body), or an API error such as a full stream.
        error = ack.get("error") if isinstance(ack, dict) else None
        if isinstance(error, dict):
            code = error.get("err_code")
            fut.set_exception(PublishRefused(str(error.get("description", error))[:300], code if isinstance(code, int) else None))
        else:
            status = (msg.headers or {}).get("Status", "")
            fut.set_exception(PublishRefused(f"no stream answered (status {status or 'unknown'})"))


async def settled(futures: list[asyncio.Future[Any]], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for every future; cancel those still pending."""
    if not futures:
        return
    _, pending = await asyncio.wait(futures, timeout=timeout_s)
    for fut in pending:
        fut.cancel()
