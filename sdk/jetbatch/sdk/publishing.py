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
import os
import time
import uuid
from typing import Any, Awaitable, Callable, Collection

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from . import failures
from .errors import BadRequest, ConnectionFailed, JetbatchError, Overloaded, PayloadTooLarge, RequestTimeout
from .protocol import JS_MSG_TOO_BIG, JS_STREAM_FULL

__all__ = ["ATOMIC_BATCH_MAX", "AckGroup", "BatchIgnored", "PubAcks", "PublishRefused", "publish_with_retries"]

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
        except failures.SLOW + failures.UNREADABLE_REPLY as exc:
            # Reconnecting, no PubAck, or a reply nats-py could not read as one (anyone who may
            # publish to the request's inbox could send it first): retry, dedupe makes it safe.
            last = exc
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


class AckGroup:
    """Futures awaited together, with one wake-up for the whole group: a batch's PubAcks.

    A future that :class:`PubAcks` resolves for a group carries no callback: the PubAck's
    arrival counts it here directly. ``asyncio.wait`` (or ``gather``) puts a callback on every
    future, and each resolved future then schedules it on the event loop: one callback a
    message, on the worker's hot path (docs/benchmarks.md, "One wake-up a batch"). Any other
    future is tracked with :meth:`add`. A future counted for PubAcks ends with its PubAck, the
    wait's end or :meth:`PubAcks.close`: one cancelled by anything else leaves the wait to its
    timeout (give up on the wait, not on its futures)."""

    __slots__ = ("_futures", "_left", "_wake")

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[Any]] = []
        self._left = 0  # futures not yet resolved
        self._wake: asyncio.Future[None] | None = None

    def add(self, fut: asyncio.Future[Any]) -> None:
        """Wait for ``fut`` too (a future this group's PubAcks do not resolve)."""
        self._futures.append(fut)
        if not fut.done():
            self._left += 1
            fut.add_done_callback(self._resolved_cb)

    async def wait(self, timeout_s: float) -> None:
        """Until every future is done, or ``timeout_s`` passed: those still pending are then
        cancelled (as they are when the wait itself is cancelled)."""
        try:
            if self._left:
                loop = asyncio.get_running_loop()
                self._wake = loop.create_future()
                timer = loop.call_later(timeout_s, _wake_up, self._wake)
                try:
                    await self._wake
                finally:
                    timer.cancel()
                    self._wake = None
        finally:
            for fut in self._futures:
                if not fut.done():
                    fut.cancel()

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._futures.append(fut)
        self._left += 1

    def _resolved(self) -> None:
        self._left -= 1
        if self._left <= 0 and self._wake is not None:
            _wake_up(self._wake)

    def _resolved_cb(self, _: asyncio.Future[Any]) -> None:
        self._resolved()


def _wake_up(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)


# A publish's bookkeeping until its PubAck: the future, the group counting it, and for an atomic
# batch's commit the batch id and size its PubAck must confirm.
_Entry = tuple["asyncio.Future[dict[str, Any]]", "AckGroup | None", "tuple[str, int] | None"]

# Futures given up on (cancelled, timed out) keep their entry until the next sweep: sweeping at
# twice the size left after the last one keeps it amortised O(1) a publish.
_SWEEP_MIN = 1024

# A PubAck's token is random (64 bits), drawn from a buffer of random bytes refilled every few
# hundred publishes (one system call, not one a publish). A counter told anyone who saw one
# publish's reply subject (every answer carries it) the next ones: whoever may publish to the
# inbox could confirm them first, and an answer never stored counted as stored.
_TOKEN_BYTES = 8
_TOKEN_POOL = _TOKEN_BYTES * 512


class PubAcks:
    """Publish to JetStream on ``nc`` and collect the PubAcks. A future the caller gives up on
    (cancels) is forgotten here too; a PubAck that arrives later is dropped. ``streams``: the
    streams the publishes are meant for; a PubAck naming another is a refusal (the message went
    somewhere else, or the PubAck is not JetStream's)."""

    def __init__(self, nc: NATS, streams: Collection[str] | None = None) -> None:
        self._nc = nc
        self._streams = frozenset(streams) if streams is not None else None
        self._prefix = f"{nc.new_inbox()}."
        self._sub: Any = None
        self._waiting: dict[str, _Entry] = {}
        self._random = b""
        self._random_at = 0
        self._sweep_at = _SWEEP_MIN
        self.sent = 0  # messages published with a PubAck asked for

    async def publish(
        self, subject: str, body: bytes, headers: dict[str, str], *, group: AckGroup | None = None
    ) -> asyncio.Future[dict[str, Any]]:
        """Send one message; the future resolves to its PubAck (a dict) or fails with
        :class:`PublishRefused`; with ``group``, the group counts it (:meth:`AckGroup.wait`).
        Raises what ``nc.publish`` raises (closed, buffer full, ...)."""
        return await self._publish(subject, body, headers, group, None)

    async def publish_atomic(
        self, messages: list[tuple[str, bytes, dict[str, str]]], *, group: AckGroup | None = None
    ) -> asyncio.Future[dict[str, Any]]:
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
        return await self._publish(subject, body, marked, group, (batch_id, len(messages)))

    async def _publish(
        self, subject: str, body: bytes, headers: dict[str, str], group: AckGroup | None, expect: tuple[str, int] | None
    ) -> asyncio.Future[dict[str, Any]]:
        if self._sub is None:
            self._sub = await self._nc.subscribe(f"{self._prefix}*", cb=self._on_ack)
        if len(self._waiting) >= self._sweep_at:
            self._waiting = {t: e for t, e in self._waiting.items() if not e[0].done()}
            self._sweep_at = max(_SWEEP_MIN, 2 * len(self._waiting))
        token = self._token()
        self.sent += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (fut, None, expect)  # before the publish: its PubAck may come at once
        try:
            await self._nc.publish(subject, body, reply=self._prefix + token, headers=headers)
        except BaseException:
            fut.cancel()
            self._waiting.pop(token, None)
            raise
        if group is not None:
            if fut.done():
                group.add(fut)  # answered while the publish was written out
            else:
                self._waiting[token] = (fut, group, expect)
                group._track(fut)
        return fut

    def _token(self) -> str:
        at = self._random_at
        if at >= len(self._random):
            self._random, at = os.urandom(_TOKEN_POOL), 0
        self._random_at = at + _TOKEN_BYTES
        token = self._random[at : at + _TOKEN_BYTES].hex()
        return token if token not in self._waiting else self._token()

    async def close(self) -> None:
        """Stop listening for PubAcks; futures still waiting are cancelled."""
        waiting, self._waiting = self._waiting, {}
        for fut, group, _ in waiting.values():
            if not fut.done():
                fut.cancel()
                if group is not None:
                    group._resolved()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except failures.TRANSPORT_ERRORS:
                pass  # the connection is closing or closed: the subscription goes with it

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if entry is None:
            return
        fut, group, expect = entry
        if fut.done():
            return  # given up on (an AckGroup's wait ended, the caller cancelled)
        outcome = _outcome(msg)
        if self._streams is not None and isinstance(outcome, dict) and outcome["stream"] not in self._streams:
            outcome = PublishRefused(f"a PubAck from stream {str(outcome['stream'])[:64]!r}, not {'/'.join(sorted(self._streams))}")
        if expect is not None and isinstance(outcome, dict) and (outcome.get("batch"), outcome.get("count")) != expect:
            outcome = BatchIgnored(f"the stream did not store the batch atomically ({outcome})")
        if isinstance(outcome, dict):
            fut.set_result(outcome)
        else:
            fut.set_exception(outcome)
        if group is not None:
            group._resolved()


def _outcome(msg: Msg) -> dict[str, Any] | PublishRefused:
    """A PubAck's message: the ack (a dict naming its stream and the sequence it stored the
    message at), or why nothing was stored. Never raises: a body that is not a PubAck (nested
    past the decoder's depth, a stream that is not a name) is a refusal, and the caller's careful
    path publishes again under the same id."""
    try:
        ack = msgspec.json.decode(msg.data) if msg.data else None
    except (msgspec.DecodeError, RecursionError):
        # RecursionError: a JSON body nested past msgspec's depth raised it out of the PubAck
        # subscription, leaving the future to its caller's timeout (5 s a batch).
        ack = None
    if isinstance(ack, dict) and "error" not in ack and isinstance(ack.get("stream"), str) and type(ack.get("seq")) is int:
        return ack
    # No stream (a 503 status with an empty body), or an API error such as a full stream.
    error = ack.get("error") if isinstance(ack, dict) else None
    if isinstance(error, dict):
        code = error.get("err_code")
        return PublishRefused(str(error.get("description", error))[:300], code if isinstance(code, int) else None)
    status = (msg.headers or {}).get("Status", "")
    return PublishRefused(f"no stream answered (status {status or 'unknown'})")
