"""The reply path shared by the worker and the classifier: answers, their durable copies, dead
letters, and settling each message (ack, term, nak) without ever raising into a serving loop.

Protocol 3 (the request has a ``Jetbatch-Reply-Key``): each answer is published **once**, to
``<prefix>.result.<tenant or _>.<key>.<request id>``. The results stream stores it and the
caller, subscribed to its key's answers, receives the same message live (with
``replies.atomic_batches``, a batch's answers go out as one atomic batch, one PubAck confirming
them all). Protocol 2 (a ``Jetbatch-Reply-To``
and no key): the stored copy is published to ``<prefix>.result.[<tenant>.]<request id>`` and the
live reply to the caller's reply subject right behind it.

Either way, the caller of this module acks a request only once the store's PubAck confirms its
answer (docs/reliability.md). A crash before the PubAck redelivers the request; a crash after it
leaves the answer where the caller (or the next worker) finds it by request id.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import (
    ContentType,
    ErrorCode,
    Headers,
    RequestMeta,
    Status,
    Subjects,
    encode_error,
    error_headers,
    forwardable_headers,
    message_bytes,
    unwritable_header_names,
)
from jetbatch.sdk.errors import JetbatchError
from jetbatch.sdk.publishing import ATOMIC_BATCH_MAX, AckGroup, BatchIgnored, PublishRefused, PubAcks, publish_with_retries

from .errors import TRANSPORT_ERRORS
from .config import RepliesConfig

__all__ = ["PUBLISH_CHUNK", "Answer", "Replier", "client_message"]

log = logging.getLogger("jetbatch.replies")

_STORE_TIMEOUT_S = 5.0
# Answers published back to back before the connection is given a chance to write them
# (``Replier.deliver``).
PUBLISH_CHUNK = 32
_SETTLE_ATTEMPTS = 3
# JetStream's "atomic publish is disabled" (a results stream made without allow_atomic).
_ATOMIC_DISABLED = 10174
_BATCH_HEADERS_BYTES = 128
_PATH_RE = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.\-+@~]+){2,}")


def client_message(exc: BaseException, limit: int = 300) -> str:
    """What a caller may see of a server-side exception: its type and first line, with file paths
    removed (interpreter stacks and server paths stay in the logs and spans)."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    text = f"{type(exc).__name__}: {_PATH_RE.sub('<path>', first)}" if first else type(exc).__name__
    return text[:limit]


@dataclass(slots=True)
class Answer:
    """One request's final answer: body and headers, and where it goes."""

    meta: RequestMeta
    body: bytes
    headers: dict[str, str]
    error: ErrorCode | None = None
    stored: bool = False
    sent: bool = False

    @classmethod
    def ok(cls, meta: RequestMeta, body: bytes, content_type: ContentType, extra: Mapping[str, str] | None = None) -> "Answer":
        headers = dict(extra or {})
        headers[Headers.STATUS] = Status.OK.value
        headers[Headers.REQUEST_ID] = meta.request_id
        headers[Headers.CONTENT_TYPE] = content_type.value
        return cls(meta, body, headers)

    @classmethod
    def failure(
        cls, meta: RequestMeta, code: ErrorCode, message: str, extra: Mapping[str, str] | None = None, *, model: str | None = None
    ) -> "Answer":
        headers = dict(extra or {})
        headers.update(error_headers(code, meta.request_id, model or headers.get(Headers.MODEL)))
        return cls(meta, encode_error(code, message[:1000], meta.request_id), headers, error=code)


@dataclass
class Replier:
    """Sends answers for one sidecar. ``reply_nc``, when the deployment gives the sidecar a reply
    identity, is the connection answers go out on (its permissions allow only reply subjects)."""

    nc: NATS
    subjects: Subjects
    config: RepliesConfig
    reply_nc: NATS | None = None
    _js: Any = field(init=False, default=None)
    _lookup_js: Any = field(init=False, default=None)
    _acks: PubAcks | None = field(init=False, default=None)
    _atomic: bool = field(init=False, default=True)  # the results stream takes atomic batches

    def __post_init__(self) -> None:
        self._js = (self.reply_nc or self.nc).jetstream()
        # Lookups go out on the main identity: a reply identity may only publish answers (a
        # direct get from it waited out a permission violation, and the request ran again).
        self._lookup_js = self.nc.jetstream()
        self._atomic = self.config.atomic_batches

    @property
    def out(self) -> NATS:
        return self.reply_nc or self.nc

    def fit(self, answer: Answer) -> Answer:
        """An answer the server would refuse (over ``max_payload``, headers counted) becomes a
        ``model_failed`` error: sending it would close the connection."""
        # Room for the atomic batch's headers (Nats-Batch-Id, -Sequence, -Commit), added on the way out.
        limit = (self.out.max_payload or 1024 * 1024) - _BATCH_HEADERS_BYTES
        if _rough_bytes(answer) <= limit or message_bytes(answer.headers, answer.body) <= limit:
            return answer
        size = message_bytes(answer.headers, answer.body)
        extra = {k: v for k, v in answer.headers.items() if k.startswith("Jetbatch-") and k not in (Headers.STATUS, Headers.ERROR_CODE)}
        return Answer.failure(answer.meta, ErrorCode.MODEL_FAILED, f"output of {size} bytes is over the server's max payload ({limit})", extra)

    def subject_of(self, meta: RequestMeta) -> str:
        """Where the answer of the request ``meta`` is stored: its caller's answer subject
        (protocol 3), else the request id's results subject (protocol 2)."""
        if meta.reply_key is not None:
            return self.subjects.answer(meta.request_id, meta.reply_key, meta.tenant)
        return self.subjects.result(meta.request_id, meta.tenant)

    async def deliver(self, answers: list[Answer]) -> None:
        """Store every answer durably (when enabled) and send each to its caller. Sets
        ``stored``/``sent`` on each; never raises.

        The answers go out in chunks of :data:`PUBLISH_CHUNK` (with ``atomic_batches``, one
        atomic batch), each chunk's stored copies first and its protocol-2 replies right behind
        them on the same connection, and only then are the PubAcks awaited: a caller gets its
        answer without waiting for the store's round trip, while the request is still acked
        only once its stored copy is confirmed (``safe``). An answer that arrives before a store
        that then fails is harmless: the request is redelivered, and the caller ignores a second
        answer."""
        answers[:] = [self.fit(a) for a in answers]
        stores: list[tuple[list[Answer], asyncio.Future[Any]]] = []
        pending = AckGroup()  # one wake-up once every PubAck of the batch came
        # In chunks, each handed to the socket before the next is published: the first callers
        # have their answers (and send their next requests) while the rest go out. A batch sent
        # whole kept a closed loop of callers in lockstep with the worker, one batch at a time
        # (docs/benchmarks.md before 2026-12-08, "Answers in chunks", in git). An atomic batch is one group, not split.
        size = ATOMIC_BATCH_MAX if self._atomic and self.config.durable else PUBLISH_CHUNK
        for i in range(0, len(answers), size):
            chunk = answers[i : i + size]
            if i:
                await asyncio.sleep(0)  # nats-py's flusher writes what is published so far
            if self.config.durable:
                stores += await self._store_start(chunk, pending)
            for a in chunk:
                if a.meta.reply_key is None or not self.config.durable:
                    await self._send(a)
        if not self.config.durable:
            # Without the results store an answer is safe once written out: a PING's round trip
            # says so. With it, the PubAcks say more, and nats-py writes while they are awaited
            # (in publish order, so a protocol-2 reply still goes out before its request's ack).
            try:
                await self.out.flush(timeout=5)
            except TRANSPORT_ERRORS as exc:
                log.warning("flush after replies failed: %r", exc)
        if stores:
            await self._store_finish(stores, pending)

    async def resend(self, answer: Answer) -> None:
        """Send an answer found in the results store to its caller again (a redelivered request
        whose earlier delivery was computed and stored, but not acked)."""
        await self._send(answer)

    async def _send(self, answer: Answer) -> None:
        """Publish ``answer`` live (core NATS) to its caller: to its answer subject (protocol 3;
        the results stream, if any, stores this copy too) or to its reply subject (protocol 2).
        Sets ``sent``; nothing happens for a request that named neither."""
        if answer.meta.reply_key is not None:
            subject = self.subject_of(answer.meta)
        elif answer.meta.reply_to is not None:
            subject = answer.meta.reply_to
        else:
            return
        try:
            await self.out.publish(subject, answer.body, headers=answer.headers)
            answer.sent = True
        except TRANSPORT_ERRORS as exc:
            # Reconnecting with a full buffer, or closed: the stored copy still answers.
            log.warning("reply to %s failed: %r", answer.meta.request_id, exc)

    def safe(self, answer: Answer) -> bool:
        """Whether the request may be acked: its answer is stored (or, without the results store,
        was handed to the connection)."""
        if self.config.durable:
            return answer.stored
        return answer.sent or (answer.meta.reply_to is None and answer.meta.reply_key is None)

    async def _store_start(self, answers: list[Answer], pending: AckGroup) -> list[tuple[list[Answer], asyncio.Future[Any]]]:
        """Publish each answer's stored copy; the PubAcks are awaited by :meth:`_store_finish`.
        ``pending`` counts the PubAcks awaited. Several answers go out as atomic batches (one
        PubAck each) while the stream allows it.
        A protocol-3 answer counts as sent once its copy is handed to the connection: that
        publish is its live delivery."""
        if self._acks is None:
            self._acks = PubAcks(self.out, streams=(self.subjects.results_stream,))
        groups: list[tuple[list[Answer], asyncio.Future[Any]]] = []
        size = ATOMIC_BATCH_MAX if self._atomic else 1
        for i in range(0, len(answers), size):
            group = answers[i : i + size]
            try:
                if len(group) == 1:
                    a = group[0]
                    fut = await self._acks.publish(self.subject_of(a.meta), a.body, a.headers, group=pending)
                else:
                    fut = await self._acks.publish_atomic([(self.subject_of(a.meta), a.body, a.headers) for a in group], group=pending)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the requests for redelivery
                log.warning("storing %d answers (the first of %s) failed: %r", len(group), group[0].meta.request_id, exc)
                continue
            for a in group:
                a.sent = a.sent or a.meta.reply_key is not None
            groups.append((group, fut))
        return groups

    async def _store_finish(self, groups: list[tuple[list[Answer], asyncio.Future[Any]]], pending: AckGroup) -> None:
        """Await the PubAcks ``pending`` counts (the futures of ``groups``), then store again what
        they did not confirm."""
        started = time.monotonic()
        await pending.wait(min(_STORE_TIMEOUT_S, self.config.store_timeout_s / 2))
        unanswered: list[Answer] = []
        for group, fut in groups:
            if fut.cancelled():
                # No PubAck yet: the server is down or restarting. The answer went out live, so it
                # is stored again (same content) rather than left for a redelivery that computes
                # it anew, maybe past its deadline, contradicting the reply already sent.
                unanswered.extend(group)
                continue
            exc = fut.exception()
            if exc is None:
                for a in group:
                    a.stored = True
            elif len(group) > 1 and isinstance(exc, PublishRefused):
                # The batch as a whole was refused (too many batches in flight, no stream
                # answering during an election) or not stored as one: each answer is stored
                # alone. A stream or server without atomic batches: one by one from now on.
                if (isinstance(exc, BatchIgnored) or exc.err_code == _ATOMIC_DISABLED) and self._atomic:
                    self._atomic = False
                    log.info("the results stream takes no atomic batches (%s): answers are stored one by one", exc)
                unanswered.extend(group)
            elif isinstance(exc, PublishRefused) and exc.err_code is None:
                unanswered.extend(group)
            else:
                log.warning("the results stream refused the answer of %s: %r", group[0].meta.request_id, exc)
        if unanswered:
            # No stream answered: a leader election or a restart. Retried within
            # replies.store_timeout_s, so an outage of that long delays these acks instead of
            # redelivering (and recomputing) every request it caught, which other workers would
            # also count as backlog.
            deadline = started + self.config.store_timeout_s
            await asyncio.gather(*(self._store_again(a, deadline) for a in unanswered))

    async def _store_again(self, answer: Answer, deadline: float) -> None:
        subject = self.subject_of(answer.meta)
        try:
            await publish_with_retries(self._js, subject, answer.body, answer.headers, deadline=deadline, request_id=answer.meta.request_id)
            answer.stored = True
        except JetbatchError as exc:
            log.warning("storing the answer of %s failed: %s", answer.meta.request_id, exc.message)
            return
        if answer.meta.reply_key is not None:
            answer.sent = True  # that publish reached the caller's subscription too
            return
        # Whatever lost the first store's PubAck (a node gone with our connection) may have lost
        # the live reply sent right behind it; a caller whose own connection never broke would
        # then wait for it until its timeout (the failover bench saw that). Send it again: a
        # second answer is dropped by the caller.
        await self._send(answer)

    async def stored_answer(self, meta: RequestMeta) -> Answer | None:
        """The answer stored for this request id by an earlier delivery, if any."""
        if not self.config.durable:
            return None
        try:
            raw = await self._lookup_js.get_msg(self.subjects.results_stream, subject=self.subject_of(meta), direct=True)
        except TRANSPORT_ERRORS:
            return None
        # Without the server's Nats-* headers (the stream's, a batch's): sent again they would
        # steer the server (a Nats-Batch-Id opens a batch that never commits).
        headers = forwardable_headers(raw.headers)
        code = headers.get(Headers.ERROR_CODE)
        answer = Answer(meta, raw.data or b"", headers, error=ErrorCode(code) if code in ErrorCode._value2member_map_ else None)
        answer.stored = True
        return answer

    async def dead_letter(self, msg: Msg, reason: str, stage: str) -> bool:
        """Copy ``msg`` (payload and headers) to ``<prefix>.dlq.<stage>`` with its reason, original
        subject and delivery count. A copy too large for the server keeps its headers only."""
        original = dict(msg.headers or {})
        # No Nats-* header of the producer's: the server would act on it (Nats-Expected-Stream
        # refuses the copy, and the request would be gone), and without Nats-Msg-Id the DLQ keeps
        # every entry.
        headers = forwardable_headers(original)
        unwritable = unwritable_header_names(headers)
        if unwritable:
            # nats-py would refuse the whole copy, and the dead letter would be lost.
            for name in unwritable:
                del headers[name]
            reason = f"{reason} ({len(unwritable)} header(s) not copied: names NATS cannot carry)"
        headers.update(
            {
                Headers.DLQ_REASON: reason[:1000],
                Headers.DLQ_STAGE: stage,
                Headers.DLQ_SUBJECT: msg.subject[:255],
                Headers.DLQ_DELIVERIES: str(_deliveries(msg)),
                Headers.REQUEST_ID: original.get(Headers.MSG_ID, "")[:64],
            }
        )
        data = msg.data
        limit = self.nc.max_payload or 1024 * 1024
        if message_bytes(headers, data) > limit:
            data = b""
            headers[Headers.DLQ_REASON] = (reason[:900] + " (payload dropped: too large to copy)")
            if message_bytes(headers, data) > limit:
                headers = {k: v[:256] for k, v in headers.items()}
        js = self.nc.jetstream()
        try:
            await js.publish(self.subjects.dead_letter(stage), data, headers=headers, timeout=5)
            return True
        except TRANSPORT_ERRORS as exc:
            log.warning("dead-lettering %s failed: %r", original.get(Headers.MSG_ID), exc)
            return False


def _rough_bytes(answer: Answer) -> int:
    """At least what the answer takes against ``max_payload``, from lengths alone (a character is
    at most 4 bytes in UTF-8, a header line adds 4): the exact count (``message_bytes``) strips and
    encodes every value, and is needed only near the limit."""
    headers = answer.headers
    try:
        chars = len(headers) + sum(map(len, headers)) + sum(map(len, headers.values()))
    except TypeError:  # a value that is not a string: the exact count converts it
        return sys.maxsize
    return len(answer.body) + 12 + 4 * chars


async def settle(msg: Msg, action: str, *, delay_s: float | None = None) -> bool:
    """Ack, term or nak ``msg``; retried briefly, never raises. False when it could not be done
    (the message is then redelivered after its ack wait: safe, since answers are stored first)."""
    for attempt in range(_SETTLE_ATTEMPTS):
        try:
            if action == "ack":
                await msg.ack()
            elif action == "term":
                await msg.term()
            else:
                await msg.nak(delay=delay_s)
            return True
        except failures.ALREADY_ACKED:
            return True
        except TRANSPORT_ERRORS as exc:
            if attempt == _SETTLE_ATTEMPTS - 1:
                log.warning("%s of a message failed: %r", action, exc)
                return False
            await asyncio.sleep(0.05 * (attempt + 1))
    return False


def _deliveries(msg: Msg) -> int:
    try:
        return int(msg.metadata.num_delivered)
    except Exception:  # noqa: BLE001 - not a JetStream message
        return 1
