"""The producer client: publish requests to JetStream, await typed answers on one subscription
to the client's own answer subjects (protocol 3, docs/protocol.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Generator, Iterable, Mapping, Sequence

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from . import failures
from . import telemetry as _telemetry
from .admission import Admission, follow_adverts
from .errors import (
    BadRequest,
    ClientClosed,
    JetbatchError,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    StreamNotFound,
    UnknownModel,
    error_for_code,
)
from .connection import connect_nats, guard_read_loop
from .publishing import PubAcks, PublishRefused, publish_with_retries
from .registry import RegisteredModels
from .timeouts import Timeouts
from .validation import check_timeout, user_headers
from .protocol import (
    DEFAULT_PREFIX,
    BatchInfo,
    ContentType,
    Headers,
    Priority,
    dedupe_id,
    ProtocolError,
    Status,
    Subjects,
    batch_info_from_headers,
    deadline_header,
    decode_error,
    decode_payload,
    encode_payload,
    message_bytes,
    new_request_id,
    validate_tenant,
    validate_token,
)

__all__ = ["Client", "Result"]

_LAST_LOOK_S = 0.5  # bound of a results-store lookup made on the caller's time (_look_up)
_PUBACK_WAIT_S = 5.0  # then the careful path retries (as nats-py's js.publish times out)



@dataclass(frozen=True)
class Result:
    """A successful reply: the decoded output and how the request was batched."""

    request_id: str
    output: Any
    batch: BatchInfo
    latency_s: float


_NO_BATCH = BatchInfo(batch_id="", batch_size=0, queue_wait_ms=0.0, model_loaded=False, model="")


class Client:
    """An asyncio client for jetbatch.

    Use ``async with Client.connect("nats://host:4222") as client:`` then
    ``await client.infer(payload, model="m1")``. One subscription, to the client's own answer
    subjects, serves every request: each request registers a future under its request id before
    it is published.
    """

    def __init__(
        self, nc: NATS, *, prefix: str = DEFAULT_PREFIX, owns_connection: bool = False, tenant: str | None = None,
        admission: bool = True,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._subjects = Subjects(prefix)
        self._tenant = validate_tenant(tenant) if tenant is not None else None
        self._owns_connection = owns_connection
        self._pending: dict[str, asyncio.Future[Any]] = {}
        # This client's key among its tenant's answers: workers publish each answer once, to
        # <prefix>.result.<tenant or _>.<key>.<request id>, where the results stream stores it
        # and this client's one subscription receives it.
        self._key = new_request_id()
        self._sub: Any = None
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reconnects_seen = 0
        self._acks = PubAcks(nc, streams=(self._subjects.ingress_stream, self._subjects.models_stream))
        self._timeouts = Timeouts()  # the reply and PubAck waits, on shared timers
        self._address_of: Any = None
        self._address: tuple[str, int] | None = None
        # What the workers' adverts say of each model's queue: a request its workers cannot reach
        # within its time is refused before it is sent (a tenant's go through the classifier,
        # which applies the same rule).
        self._admission = Admission() if admission and tenant is None else None
        self._adverts_sub: Any = None
        self._registry = RegisteredModels(self._js, self._subjects)

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        url: str | Sequence[str] | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        connect_timeout_s: float = 2.0,
        tenant: str | None = None,
        admission: bool = True,
        **nats_options: Any,
    ) -> "_Connecting":
        """Connect to NATS. Await it, or use it as ``async with``.

        ``url`` defaults to ``$NATS_URL`` or ``nats://127.0.0.1:4222``. ``connect_timeout_s``
        bounds the whole connect, TLS negotiation included. ``tenant`` (in a multi-tenant
        deployment, see docs/security.md) sends every request through ``<prefix>.in.<tenant>``
        and receives its answers under ``<prefix>.result.<tenant>.`` and JetStream's replies under
        ``_INBOX.<tenant>.`` (unless ``inbox_prefix`` says otherwise). ``admission`` (without a
        tenant): refuse a request for a named model with :class:`Overloaded` before sending it
        when the workers' adverts say its queue cannot be served within its timeout
        (docs/reliability.md, "Backpressure"); off, only a full stream refuses.
        Extra keyword arguments go to ``nats.connect`` (``user``/``password``, ``token``,
        ``nkeys_seed``, ``user_credentials``, ``tls``, ...). Raises :class:`ConnectionFailed` if
        no server answers.
        """
        return _Connecting(
            cls._open(url, prefix=prefix, connect_timeout_s=connect_timeout_s, tenant=tenant, admission=admission, **nats_options)
        )

    @classmethod
    async def _open(
        cls,
        url: str | Sequence[str] | None,
        *,
        prefix: str,
        connect_timeout_s: float,
        tenant: str | None = None,
        admission: bool = True,
        **nats_options: Any,
    ) -> "Client":
        if tenant is not None:
            try:
                validate_tenant(tenant)
            except ProtocolError as exc:
                raise BadRequest(str(exc)) from None
            nats_options.setdefault("inbox_prefix", f"_INBOX.{tenant}")
        nc = await connect_nats(url, connect_timeout_s=connect_timeout_s, **nats_options)
        client = cls(nc, prefix=prefix, owns_connection=True, tenant=tenant, admission=admission)
        await client._start()
        return client

    @classmethod
    async def from_connection(
        cls, nc: NATS, *, prefix: str = DEFAULT_PREFIX, tenant: str | None = None, admission: bool = True
    ) -> "Client":
        """Wrap an existing nats-py connection (it stays open when the client closes).

        The connection is hardened as the SDK's own are: a message nats-py cannot read (a
        subject, reply subject or status line that is not UTF-8, which anyone who may publish
        to your answer subject could send) is dropped instead of ending its read loop."""
        guard_read_loop(nc)
        client = cls(nc, prefix=prefix, owns_connection=False, tenant=tenant, admission=admission)
        await client._start()
        return client

    async def _start(self) -> None:
        self._sub = await self._nc.subscribe(self._subjects.answers(self._key, self._tenant), cb=self._on_reply)
        self._reconnects_seen = self._nc.stats.get("reconnects", 0)
        if self._admission is not None:
            self._adverts_sub = await follow_adverts(self._nc, self._subjects, self._admission)
        self._spawn(self._watch_reconnects())

    async def close(self) -> None:
        """Fail pending requests with ConnectionFailed and close the connection if we opened it."""
        if self._closed:
            return
        self._closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClientClosed("client closed"))
                # A caller cancelled meanwhile never reads it: marked read here, so asyncio does
                # not log "exception was never retrieved" once for every such request.
                fut.exception()
        self._pending.clear()
        for task in list(self._tasks):
            task.cancel()
        await self._acks.close()
        for sub in (self._sub, self._adverts_sub):
            try:
                if sub is not None:
                    await sub.unsubscribe()
            except failures.TRANSPORT_ERRORS:
                pass
        if self._owns_connection:
            try:
                await self._nc.drain()
            except failures.TRANSPORT_ERRORS:
                await self._nc.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def subjects(self) -> Subjects:
        return self._subjects

    @property
    def nats(self) -> NATS:
        """The underlying nats-py connection."""
        return self._nc

    # --- requests ----------------------------------------------------------------------------

    async def infer(
        self,
        payload: Any,
        *,
        model: str | None = None,
        timeout: float = 30.0,
        content_type: ContentType | str | None = None,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> Any:
        """Submit one request and return its decoded output, or raise a typed :class:`JetbatchError`.

        ``model=None`` sends it to the classifier (``<prefix>.in``); a model name sends it straight
        to that model's queue. ``timeout`` (seconds) bounds the whole call (a call that times out
        raises within 5 ms after it) and is also sent as the request's deadline, so the worker
        does not compute a request nobody waits for.
        ``priority``: ``"interactive"`` (the default) or ``"batch"`` for work nobody waits on
        (bulk jobs): a worker takes a model's interactive requests first and visits a model
        with interactive work waiting sooner; batch requests keep the same bounded wait.
        """
        # No batch metadata: reading the Jetbatch-Batch header was a tenth of the SDK's own
        # time a request, for a value infer() drops.
        result = await self._call(payload, model, timeout, content_type, request_id, headers, priority, with_batch=False)
        return result.output

    async def infer_result(
        self,
        payload: Any,
        *,
        model: str | None = None,
        timeout: float = 30.0,
        content_type: ContentType | str | None = None,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> Result:
        """Like :meth:`infer`, but return a :class:`Result` with the batch metadata."""
        return await self._call(payload, model, timeout, content_type, request_id, headers, priority, with_batch=True)

    async def _call(
        self,
        payload: Any,
        model: str | None,
        timeout: float,
        content_type: ContentType | str | None,
        request_id: str | None,
        headers: Mapping[str, str] | None,
        priority: Priority | str,
        *,
        with_batch: bool,
    ) -> Result:
        if self._closed:
            raise ClientClosed("client is closed")
        started = time.monotonic()
        rid = request_id or new_request_id()
        subject, data, hdrs, timeout = self._outgoing(payload, rid, model, timeout, content_type, request_id is not None, headers, priority)

        if rid in self._pending:
            raise BadRequest(f"request id {rid!r} is already in flight", request_id=rid)
        if self._admission is not None and model is not None:
            refused = self._admission.refusal(model, timeout - (time.monotonic() - started))
            if refused is not None:
                raise Overloaded(refused, request_id=rid)
        if model is not None and self._tenant is None and await self._registry.check(model, timeout - (time.monotonic() - started)) is False:
            raise UnknownModel(f"no model named {model!r} is served", request_id=rid)
        if request_id is not None:
            # A caller's own id is usually a retry: its answer may be stored already. JetStream
            # forgets the ids of finished requests when the server restarts, so the PubAck alone
            # would not say "duplicate" and the request would be computed again.
            stored = await self._look_up(rid, anywhere=True)
            if stored is not None:
                return self._to_result(stored, rid, time.monotonic() - started, with_batch)
            if rid in self._pending:  # another call with this id started during the look-up
                raise BadRequest(f"request id {rid!r} is already in flight", request_id=rid)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[rid] = fut
        span = _telemetry.start_producer_span(subject, rid, model, hdrs, len(data))
        status = "error"
        try:
            duplicate = await self._send(span, subject, data, hdrs, rid, model, deadline=started + timeout, fresh=request_id is None)
            if duplicate:
                # JetStream already holds (or held) this request id: a retry of a request that is
                # running or finished, maybe sent by another process (under another key). Its
                # answer is in the results store, now or soon.
                self._spawn(self._poll_stored_result(rid, anywhere=True))
            try:
                msg = await self._timeouts.within(fut, timeout - (time.monotonic() - started))
            except TimeoutError:
                # One look in the results store before giving up: the live reply can miss us where
                # the stored answer does not (this id already answered through another path, a
                # reply lost in a reconnect the client did not notice).
                msg = await self._look_up(rid, anywhere=True)
                if msg is None:
                    taken = " (JetStream took it for a retry of a request it already holds under this id: none is stored yet)" if duplicate else ""
                    raise RequestTimeout(f"no reply within {timeout:.3g}s{taken}", request_id=rid) from None
            result = self._to_result(msg, rid, time.monotonic() - started, with_batch)
            status = "ok"
            return result
        except JetbatchError as exc:
            if exc.code:
                status = exc.code
            if span is not None:
                _telemetry.record_error(span, exc, exc.code or type(exc).__name__)
            raise
        except asyncio.CancelledError:
            status = "cancelled"
            # The caller's task was cancelled: tell the workers, so they neither compute it nor
            # load a model for it. Its deadline would tell them too, but only when it comes.
            # Sent also while the publish was in flight: it may have been stored.
            self._spawn(self._send_cancel(rid))
            raise
        finally:
            self._pending.pop(rid, None)
            if not fut.done():
                fut.cancel()
            _telemetry.end_producer_span(span, model, status, time.monotonic() - started)

    def _outgoing(
        self, payload: Any, rid: str, model: str | None, timeout: float, content_type: ContentType | str | None,
        own_id: bool, headers: Mapping[str, str] | None, priority: Priority | str = Priority.INTERACTIVE,
    ) -> tuple[str, bytes, dict[str, str], float]:
        """The request as it goes out: its subject, body, headers and checked timeout. Everything
        the caller gave is checked here (typed ``BadRequest``), before anything is sent."""
        try:
            if own_id:
                validate_token(rid, "request id")  # it becomes the last token of the answer subject
            timeout = check_timeout(timeout)
            try:
                priority = Priority(priority)
            except ValueError:
                raise ProtocolError(f"priority must be one of {', '.join(p.value for p in Priority)}, got {priority!r}") from None
            if self._tenant is not None:
                subject = self._subjects.tenant_ingress(self._tenant)
            else:
                subject = self._subjects.ingress if model is None else self._subjects.model(model, priority)
            if model is not None:
                validate_token(model, "model name")
            data, ctype = encode_payload(payload, content_type)
            hdrs = user_headers(headers)
        except ProtocolError as exc:
            raise BadRequest(str(exc), request_id=rid) from exc

        hdrs[Headers.MSG_ID] = dedupe_id(self._tenant, rid)  # a tenant's ids are its own
        hdrs[Headers.REPLY_KEY] = self._key
        hdrs[Headers.CONTENT_TYPE] = ctype.value
        hdrs.setdefault(Headers.DEADLINE, deadline_header(timeout))
        if priority is Priority.BATCH:
            hdrs[Headers.PRIORITY] = priority.value  # the classifier routes it to the model's batch line
        if model is not None and self._tenant is not None:
            hdrs[Headers.MODEL] = model  # to the classifier's ingress; a model's own subject says it already
        size = message_bytes(hdrs, data)
        if size > self._nc.max_payload:
            # The server counts headers too and closes a connection that sends more: refuse here.
            raise PayloadTooLarge(
                f"request of {size} bytes (payload {len(data)} + headers {size - len(data)}) is over the "
                f"server's max_payload ({self._nc.max_payload} bytes)",
                request_id=rid,
            )
        return subject, data, hdrs, timeout

    async def _send(
        self, span: Any, subject: str, data: bytes, hdrs: dict[str, str], rid: str, model: str | None, *, deadline: float, fresh: bool = False
    ) -> bool:
        """Publish under a send span; True when JetStream already had this request id."""
        send = _telemetry.start_send_span(span, subject, rid, hdrs, len(data), self._server_address() if span is not None else None)
        try:
            duplicate = await self._publish(subject, data, hdrs, rid, model, deadline=deadline, fresh=fresh)
        except JetbatchError as exc:
            _telemetry.end_send_span(send, exc.code or type(exc).__name__)
            raise
        except BaseException as exc:
            _telemetry.end_send_span(send, type(exc).__qualname__)
            raise
        _telemetry.end_send_span(send)
        return duplicate

    async def infer_many(
        self,
        payloads: Iterable[Any],
        *,
        model: str | None = None,
        timeout: float = 30.0,
        content_type: ContentType | str | None = None,
        max_in_flight: int = 1024,
        return_exceptions: bool = False,
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> list[Any]:
        """Submit many requests concurrently and return their outputs in order.

        With ``return_exceptions=True`` a failed request yields its exception in place of its output
        instead of raising the first error.
        """
        gate = asyncio.Semaphore(max_in_flight)

        async def one(p: Any) -> Any:
            async with gate:
                return await self.infer(p, model=model, timeout=timeout, content_type=content_type, priority=priority)

        return await asyncio.gather(*(one(p) for p in payloads), return_exceptions=return_exceptions)

    # --- internals ---------------------------------------------------------------------------

    def _server_address(self) -> tuple[str, int] | None:
        """The server this client is connected to (``server.address``/``server.port`` on spans);
        read again only after a reconnect changed the URL (parsing it costs ~20 µs a request)."""
        url = getattr(self._nc, "connected_url", None)
        if url is None or url.hostname is None:
            return None
        if self._address_of is not url:
            self._address_of, self._address = url, (url.hostname, url.port or 4222)
        return self._address

    async def _publish(
        self, subject: str, data: bytes, hdrs: dict[str, str], rid: str, model: str | None, *, deadline: float, fresh: bool = False
    ) -> bool:
        """Publish with retries under the same Nats-Msg-Id; returns whether JetStream reported the
        request id as a duplicate (a retry of a request it already holds or held). ``fresh``: the
        SDK made the id for this call, so a duplicate on the first publish is another's request."""
        first = await self._publish_once(subject, data, hdrs, deadline)
        if first is not None:
            if first.get("duplicate") and fresh:
                # Nobody else should know an id made here: its answer would be another request's,
                # and waiting for it ends only in RequestTimeout.
                raise BadRequest(
                    f"request id {rid!r} is taken: JetStream already holds another request under it (it was not stored); "
                    "send again under a new id",
                    request_id=rid,
                )
            return bool(first.get("duplicate"))
        # Refused, unanswered or not sent: the careful path retries under the same Nats-Msg-Id
        # (dedupe makes a repeat safe) and turns JetStream's answer into a typed error.
        ack = await publish_with_retries(
            self._js, subject, data, hdrs, deadline=deadline, request_id=rid,
            no_stream=lambda: self._no_stream_error(subject, model, rid),
        )  # fmt: skip
        # A retry after a lost PubAck is also a "duplicate" of our own first attempt: its reply
        # still comes to our subscription, and the results store has it once computed.
        return bool(ack.duplicate)

    async def _publish_once(self, subject: str, data: bytes, hdrs: dict[str, str], deadline: float) -> dict[str, Any] | None:
        """One publish whose PubAck comes back on the client's PubAck subscription (no task per
        request, unlike ``js.publish``); None when it was not stored for any reason."""
        try:
            fut = await self._acks.publish(subject, data, hdrs)
        except failures.TRANSPORT_ERRORS:
            return None
        try:
            return await self._timeouts.within(fut, min(deadline - time.monotonic(), _PUBACK_WAIT_S))
        except (PublishRefused, TimeoutError):
            return None  # refused, or no PubAck in time

    async def _no_stream_error(self, subject: str, model: str | None, rid: str) -> JetbatchError | None:
        """Why no stream took the message published to ``subject``.

        JetStream is asked which stream captures ``subject`` (``$JS.API.STREAM.NAMES`` with a
        subject filter: the one lookup a producer's permissions need, and it tells nothing of
        other tenants' requests; stream info would list a stream's subjects). A stream does: it
        was briefly unavailable (a leader election, a restart), None, the caller retries until
        its deadline. None does: for a model subject, ``UnknownModel`` when the models stream
        exists (nobody serves that model), else ``StreamNotFound``; for the ingress,
        ``StreamNotFound``. None as well when JetStream did not answer.
        """
        on_model_subject = self._subjects.model_from_subject(subject) is not None
        try:
            await self._js.find_stream_name_by_subject(subject)
            return None  # a stream takes this subject: it was unavailable, not missing
        except failures.NOT_FOUND:
            pass
        except failures.TRANSPORT_ERRORS:
            return None
        if on_model_subject:
            try:
                await self._js.find_stream_name_by_subject(self._subjects.models_wildcard)
                return UnknownModel(f"no model named {model!r} is served", request_id=rid)
            except failures.NOT_FOUND:
                pass
            except failures.TRANSPORT_ERRORS:
                return None
        return StreamNotFound(f"no JetStream stream captures {subject}: start a jetbatch sidecar on this server first", request_id=rid)

    def _on_reply_sync(self, msg: Msg) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        self._resolve(rid, msg)

    def _resolve(self, rid: str, msg: Any) -> None:
        fut = self._pending.get(rid)
        # A second answer (a redelivery after a worker crash, the stored copy after the live reply)
        # finds the future done: drop it. Answers for ids we never sent are dropped too.
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def _on_reply(self, msg: Msg) -> None:
        self._on_reply_sync(msg)

    # --- the results store: answers that a disconnect or a retry made us miss ------------------

    async def _send_cancel(self, rid: str) -> None:
        """Best effort (core NATS): a lost cancel leaves the request to its deadline."""
        try:
            await self._nc.publish(self._subjects.cancel(self._tenant), rid.encode())
        except failures.TRANSPORT_ERRORS:
            pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stored_answer(self, rid: str, *, anywhere: bool = False) -> Any | None:
        """The request's answer from the results stream, or None: not stored (yet), no results
        stream, or JetStream busy (the live answer may still come). Under this client's key,
        or with ``anywhere`` under any key of its tenant (the id sent first by another process:
        a direct get of the last message on ``<prefix>.result.<tenant or _>.*.<id>``), then
        where a worker of protocol 2 stored it (``<prefix>.result.[<tenant>.]<id>``)."""
        if anywhere:
            subjects = [self._subjects.answer_anywhere(rid, self._tenant), self._subjects.result(rid, self._tenant)]
        else:
            subjects = [self._subjects.answer(rid, self._key, self._tenant)]
        for subject in subjects:
            try:
                raw = await self._js.get_msg(self._subjects.results_stream, subject=subject, direct=True)
            except failures.NOT_FOUND + (ProtocolError,):
                continue
            except failures.TRANSPORT_ERRORS:
                return None
            if raw.data is None:
                raw.data = b""
            return raw
        return None

    async def _look_up(self, rid: str, *, anywhere: bool = False) -> Any | None:
        """:meth:`_stored_answer` within ``_LAST_LOOK_S`` (a lookup on the caller's own time)."""
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that lands
        # as the lookup finishes, and a cancelled caller must stay cancelled.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_LAST_LOOK_S):
                return await self._stored_answer(rid, anywhere=anywhere)
        return None

    async def _fetch_stored_result(self, rid: str, *, anywhere: bool = False) -> bool:
        """Look the request's answer up in the results stream; resolve its future if found."""
        raw = await self._stored_answer(rid, anywhere=anywhere)
        if raw is None:
            return False
        self._resolve(rid, raw)
        return True

    async def _poll_stored_result(self, rid: str, *, anywhere: bool = False) -> None:
        delay_s = 0.05
        while rid in self._pending and not self._pending[rid].done():
            if await self._fetch_stored_result(rid, anywhere=anywhere):
                return
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 1.0)

    async def _watch_reconnects(self) -> None:
        """After a reconnect, the live replies sent while we were away are gone: look for the
        stored answer of every request still waiting, until it is found or its live reply comes
        (a backoff up to a second). One look is not enough: right after a node is lost the results
        stream may be electing its leader and not answer, and an answer stored and sent while we
        reconnected then reached nobody (the failover bench saw one wait out its whole timeout)."""
        while not self._closed:
            await asyncio.sleep(0.1)
            reconnects = self._nc.stats.get("reconnects", 0)
            if reconnects != self._reconnects_seen and self._nc.is_connected:
                self._reconnects_seen = reconnects
                for rid in list(self._pending):
                    self._spawn(self._poll_stored_result(rid))

    def _to_result(self, msg: Any, rid: str, latency_s: float, with_batch: bool = True) -> Result:
        headers = msg.headers or {}
        status = headers.get(Headers.STATUS, Status.OK.value)
        if status == Status.ERROR.value:
            body = decode_error(msg.data)
            raise error_for_code(body.code, body.message, request_id=rid)
        if status != Status.OK.value:
            # Not an answer this protocol knows: its body cannot be read as an output either.
            raise JetbatchError(f"reply with an unknown {Headers.STATUS} {status[:32]!r}", request_id=rid)
        try:
            output = decode_payload(msg.data, headers.get(Headers.CONTENT_TYPE))
        except ProtocolError as exc:
            raise JetbatchError(f"undecodable reply: {exc}", request_id=rid) from exc
        except Exception as exc:  # noqa: BLE001 - a reply is hostile input too: typed, whatever failed
            raise JetbatchError(f"undecodable reply: {type(exc).__name__}", request_id=rid) from None
        batch = batch_info_from_headers(headers) if with_batch else _NO_BATCH
        return Result(request_id=rid, output=output, batch=batch, latency_s=latency_s)


class _Connecting:
    """Awaitable and async context manager returned by :meth:`Client.connect`."""

    def __init__(self, opening: Awaitable[Client]) -> None:
        self._opening = opening
        self._client: Client | None = None

    def __await__(self) -> Generator[Any, None, Client]:
        return self._opening.__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._opening
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()

