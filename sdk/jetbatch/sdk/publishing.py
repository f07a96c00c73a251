"""Publishing into JetStream, shared by the SDK (producers) and the sidecars (the classifier's
republish, the results store).

Two paths. :class:`PubAcks` is the fast one: messages go out back to back and their PubAcks come
back on one subscription, each resolving a future. nats-py's ``js.publish`` is a request per
message and its ``publish_async`` wraps each publish in ``asyncio.wait_for``: on Python 3.11 a
task per message, which the profiles of docs/benchmarks.md showed as a third of the cost of
storing an answer. :func:`publish_with_retries` is the careful one, for whatever the fast attempt
did not place: every retry goes out under the same ``Nats-Msg-Id``, so JetStream's dedupe window
makes it safe, and JetStream's answers become typed errors: a full stream is :class:`Overloaded`,
a message too big is :class:`PayloadTooLarge`; "no stream answered" is asked of ``no_stream``
(which knows whether that means an unknown model, a missing stream, or JetStream being briefly
unavailable).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from . import failures
from .errors import BadRequest, ConnectionFailed, JetbatchError, Overloaded, PayloadTooLarge, RequestTimeout
from .protocol import JS_MSG_TOO_BIG, JS_STREAM_FULL

__all__ = ["ATOMIC_BATCH_MAX", "BatchIgnored", "PubAcks", "PublishRefused", "publish_with_retries", "settled"]

# The server's limit on the messages of one atomic batch (nats-server 2.12+, ADR-50).
ATOMIC_BATCH_MAX = 1000

# The longest pause between two attempts: a leader election or a server restart lasts seconds,
# and the caller's deadline, not a count of attempts, bounds how long we keep trying.
_MAX_BACKOFF_S = 1.0


async def publish_with_retries(
    js: Any,
    subject: str,
    data: bytes,
    headers: dict[str, str],
    *,
    deadline: float,
    request_id: str = "",
    no_stream: Callable[[], Awaitable[JetbatchError | None]] | None = None,
) -> Any:
    """Publish until JetStream acknowledges (the PubAck is returned) or ``deadline`` (monotonic
    seconds) passes; raises a typed :class:`JetbatchError` otherwise. Transient failures (no
    stream answered during an election, no PubAck, a reconnect) are retried with a backoff capped
    at one second until the deadline."""
    last: Exception | None = None
    attempt = -1
    while True:
        attempt += 1
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            return await js.publish(subject, data, timeout=min(remaining, 5.0), headers=headers)
        except failures.TOO_LARGE as exc:
            raise PayloadTooLarge(f"payload of {len(data)} bytes is over the server's max_payload", request_id=request_id) from exc
        except failures.NO_STREAM as exc:
            definite = await no_stream() if no_stream is not None else None
            if definite is not None:
                raise definite from exc
            last = exc  # JetStream did not answer (a leader election, a restart): retry
            await asyncio.sleep(min(0.1 * 2 ** min(attempt, 4), _MAX_BACKOFF_S, max(deadline - time.monotonic(), 0)))
        except failures.API_ERRORS as exc:
            if exc.err_code in JS_STREAM_FULL:
                raise Overloaded(f"queue {subject} is full: {exc.description}", request_id=request_id) from exc
            if exc.err_code in JS_MSG_TOO_BIG:
                raise PayloadTooLarge(f"payload of {len(data)} bytes is over the stream's max message size", request_id=request_id) from exc
            raise JetbatchError(f"JetStream refused the request: {exc.description}", request_id=request_id) from exc
        except failures.CLOSED as exc:
            raise ConnectionFailed("connection to NATS is closed", request_id=request_id) from exc
        except failures.BAD_HEADER as exc:
            raise BadRequest(f"invalid header name: {exc}", request_id=request_id) from exc
        except failures.SLOW as exc:
            last = exc  # reconnecting, or no PubAck: retry, dedupe makes it safe
            await asyncio.sleep(min(0.05 * 2 ** min(attempt, 5), _MAX_BACKOFF_S, max(deadline - time.monotonic(), 0)))
        except failures.TRANSPORT_ERRORS as exc:
            last = exc
            await asyncio.sleep(min(0.05 * 2 ** min(attempt, 5), _MAX_BACKOFF_S, max(deadline - time.monotonic(), 0)))
    raise RequestTimeout(f"JetStream did not acknowledge the request ({last!r})" if last else "JetStream did not acknowledge the request in time", request_id=request_id)


class PublishRefused(Exception):
    """JetStream did not store a message: its PubAck carried an error, or no stream answered.
    ``err_code`` is the JetStream API error code when there was one."""

    def __init__(self, detail: str, err_code: int | None = None) -> None:
        super().__init__(detail)
        self.err_code = err_code


class BatchIgnored(PublishRefused):
    """The server stored an atomic batch's messages one by one (it does not know atomic
    batches): only the last was confirmed."""


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

    async def publish_atomic(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> asyncio.Future[dict[str, Any]]:
        """Send 2 to :data:`ATOMIC_BATCH_MAX` messages as one atomic batch (a stream with
        ``allow_atomic``, nats-server 2.12+): the stream stores all of them or none, and one
        PubAck, on the last, answers for the batch. The future resolves to that PubAck, checked
        to cover every message (a server that ignores batch headers stores each alone and
        answers the last only: :class:`BatchIgnored`, and the caller stores them one by one),
        or fails with :class:`PublishRefused`. The messages' headers are copied, not changed.
        Subscribers of the subjects receive each message as it is sent, like any publish."""
        if not 2 <= len(messages) <= ATOMIC_BATCH_MAX:
            raise ValueError(f"an atomic batch holds 2 to {ATOMIC_BATCH_MAX} messages, not {len(messages)}")
        batch_id = uuid.uuid4().hex[:16]
        last = len(messages) - 1
        for i, (subject, body, headers) in enumerate(messages[:last]):
            marked = {**headers, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i + 1)}
            await self._nc.publish(subject, body, headers=marked)
        subject, body, headers = messages[last]
        marked = {**headers, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(last + 1), "Nats-Batch-Commit": "1"}
        fut = await self.publish(subject, body, marked)
        checked: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

        def check(done: asyncio.Future[dict[str, Any]]) -> None:
            if checked.done():
                return
            if done.cancelled():
                checked.cancel()
            elif done.exception() is not None:
                checked.set_exception(done.exception())  # type: ignore[arg-type]
            elif done.result().get("batch") != batch_id or done.result().get("count") != len(messages):
                checked.set_exception(BatchIgnored(f"the stream did not store the batch atomically ({done.result()})"))
            else:
                checked.set_result(done.result())

        fut.add_done_callback(check)
        # Giving up on the batch gives up on its PubAck.
        checked.add_done_callback(lambda c: fut.cancel() if c.cancelled() else None)
        return checked

    async def close(self) -> None:
        """Stop listening for PubAcks; futures still waiting are cancelled."""
        for fut in list(self._waiting.values()):
            fut.cancel()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except failures.TRANSPORT_ERRORS:
                pass  # the connection is closing or closed: the subscription goes with it

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
