"""The classifier sidecar (the service): routes requests from ``<prefix>.in`` to ``<prefix>.model.<name>``.

It pulls ingress requests in batches (``max_batch_size`` / ``max_delay_s``, the worker's window),
decides each request's model with a router (a batched torch network, rules, or a callable), and
republishes each request to its model's queue with its payload and headers (except the
producer's ``Jetbatch-Tenant`` and any ``Nats-*`` header: see ``_prepare``). The republish carries
``Nats-Msg-Id`` = request id (for a request that came without one, an id derived from its place in
the ingress stream, the same on every redelivery), so a retry after a crash is deduplicated by
JetStream, and the ingress message is acked only after JetStream confirmed the republish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import AbstractSet, Any

import anyio
import anyio.lowlevel
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from jetbatch.sdk import __version__
from jetbatch.sdk.admission import Admission, follow_adverts
from jetbatch.sdk.connection import unreadable_messages
from jetbatch.sdk.errors import BadRequest, JetbatchError, Overloaded, PayloadTooLarge, UnknownModel
from jetbatch.sdk.protocol import (
    ErrorCode,
    Headers,
    Priority,
    ProtocolError,
    RequestMeta,
    SidecarReport,
    Subjects,
    dedupe_id,
    subject_matches,
    forwardable_headers,
    message_bytes,
    new_request_id,
    parse_request_headers,
)
from jetbatch.sdk.publishing import AckGroup, PubAcks, publish_with_retries
from jetbatch.sdk.registry import RegisteredModels

from ..errors import TRANSPORT_ERRORS, pull, unsubscribe_all
from ..config import Config, ConfigError
from ..policy import BatchWindow
from ..pulling import Puller
from ..replies import Answer, Replier, client_message, settle
from ..runtime import retry_startup
from ..status import serve_status
from ..streams import classifier_consumer_name, ensure_classifier_streams
from ..tenancy import ServiceFeed, TenantShares
from ..telemetry import ClassifierTelemetry, link_requests
from .routers import Item, Route, Router, make_router

__all__ = ["OTHER_MODEL_LABEL", "Classifier"]

log = logging.getLogger("jetbatch.classifier")
_tracer_name = "jetbatch.sidecar"
# The classifier's request count names a model only once a queue took a request for it; any
# other name is counted under this one. At most this many models are named.
OTHER_MODEL_LABEL = "_other"
_MAX_MODEL_LABELS = 4096
_REGISTRY_LOOKUP_S = 1.0  # a model's first lookup in the registry; then it is remembered
_REPUBLISH_ACK_TIMEOUT_S = 5.0  # then the careful path retries (same Nats-Msg-Id: no duplicates)
# How long an idle classifier waits for a request before it looks at its stop flag again.
_IDLE_WAIT_S = 0.25
# A wait's pull request stays open this long past the next window's close at the latest.
_OPEN_PAST_S = 0.001
# At a stop, how much longer than a request can stay open (an idle wait and a window) to wait for
# the last ones to end before handing back what they delivered: the server ends it at once when
# the classifier unsubscribes, but nats-py drops what it read and had not handed on yet.
_STOP_GRACE_S = 0.05


class Classifier:
    """One classifier replica. Replicas share the durable consumer and split the work.

    ``reply_nc``: a connection with the reply identity (``nats.reply_identity``) for answers.
    """

    def __init__(self, config: Config, nc: NATS, *, router: Router | None = None, reply_nc: NATS | None = None) -> None:
        if config.classifier is None:
            raise ConfigError("the config has no [classifier] section")
        self.config = config
        self.cfg = config.classifier
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects: Subjects = config.subjects
        self._pubacks = PubAcks(nc, streams=(self.subjects.models_stream,))
        self.router = router or make_router(self.cfg)
        self.id = self.cfg.id or f"classifier-{socket.gethostname()}-{os.getpid()}"
        self.http_address = ""  # where its endpoints listen (set by runtime.serve_sidecar), for the report
        self.stats = {"batches": 0, "requests": 0, "routed": 0, "errors": 0, "direct": 0}
        # Models a republish was stored for: the only model names the metrics name. A producer's
        # Jetbatch-Model is any token, and each new one made a series (an attack filled the 2 000
        # the OpenTelemetry SDK allows, after which legitimate traffic was counted in its overflow
        # series, and /metrics took 30-55 ms to render on the event loop).
        self._stored_models: set[str] = set()
        self._registry = RegisteredModels(self.js, self.subjects)
        self._puller: Puller | None = None
        self.replier = Replier(nc, self.subjects, config.replies, reply_nc=reply_nc)
        self.reply_policy = config.reply_policy
        self.window = BatchWindow(self.cfg.max_batch_size, self.cfg.max_delay_s)
        self._stopping = anyio.Event()
        self._ready = anyio.Event()
        self._started_at = time.time()
        self._tracer = trace.get_tracer(_tracer_name)
        self.metrics = ClassifierTelemetry(metric_tenants=config.tenants.metric_tenants)
        # The workers' adverts: a request its model's workers cannot reach before its deadline is
        # answered overloaded here instead of queued (docs/reliability.md, "Backpressure").
        self.admission = Admission()
        # Fair shares and quotas between tenants (tenancy.py, docs/tenancy.md), fed what the
        # workers served from the same adverts.
        self.shares = TenantShares(config.tenants)
        self._service_feed = ServiceFeed(self.shares)

    @property
    def ready(self) -> anyio.Event:
        return self._ready

    def problems(self) -> list[str]:
        """Readiness detail (/readyz): the router either loaded at start or the sidecar exited."""
        return []

    def model_ready(self, model: str) -> tuple[int, str]:
        """The classifier serves no model itself: ask the worker's endpoint."""
        return 404, f"model {model}: the classifier serves no models (ask a worker)"

    def stop(self) -> None:
        self._stopping.set()

    def report(self) -> SidecarReport:
        return SidecarReport(
            role="classifier", id=self.id, version=__version__, stats={**self.stats, **self.pull_counts(), "unreadable_messages": unreadable_messages(self.nc, self.replier.reply_nc)}, started_at=self._started_at,
            updated_at=time.time(),
            http=self.http_address,
        )  # fmt: skip

    def pull_counts(self) -> dict[str, int]:
        """The pull messages so far, as the worker reports them: pull requests sent
        (``pull_requests``), pull requests ended by a status message (``pull_ends``), and
        messages dropped from the pull inbox because JetStream did not send them
        (``forged_deliveries``)."""
        puller = self._puller
        if puller is None:
            return {"pull_requests": 0, "pull_ends": 0, "forged_deliveries": 0}
        return {"pull_requests": puller.pulls, "pull_ends": puller.ends, "forged_deliveries": puller.forged}

    async def _setup(self) -> Any:
        await ensure_classifier_streams(self.js, self.subjects, self.config.streams, self.config.replies)
        # The worker's pull (sidecar/pulling.py): nats-py's fetch made a task per message.
        self._puller = await Puller(self.nc, self.subjects.ingress_stream, classifier_consumer_name()).start()
        return self._puller

    async def run(self) -> None:
        psub = await retry_startup(self._setup, timeout_s=self.config.worker.startup_timeout_s, what=self.id)
        await anyio.to_thread.run_sync(self.router.load)
        status = await serve_status(self.nc, self.subjects, self.report, self.reply_policy, out=self.replier.out)
        adverts = await follow_adverts(self.nc, self.subjects, self.admission)
        served = await follow_adverts(self.nc, self.subjects, _Clocked(self._service_feed))  # type: ignore[arg-type]  # what follow_adverts calls: on_advert
        self._ready.set()
        # Pipelining: the next batch is fetched and classified while the previous one's
        # republishes wait for their PubAcks (at most two batches in flight).
        in_flight = anyio.Semaphore(2, fast_acquire=True)
        try:
            async with anyio.create_task_group() as tg:
                while not self._stopping.is_set():
                    msgs = await self._gather(psub)
                    if msgs:
                        await in_flight.acquire()
                        tg.start_soon(self._handle_and_release, msgs, in_flight)
                        # The batch is routed (up to its router's thread) before the next gather
                        # sends its pull request.
                        await anyio.lowlevel.checkpoint()
        finally:
            with anyio.CancelScope(shield=True):
                # Delivered after the last wait returned (its request stays open up to an idle wait
                # and a window; it ends sooner once it filled): back to the queue for the next
                # classifier, not after their ack wait.
                for msg in await psub.close(_IDLE_WAIT_S + self.window.max_delay_s + _OPEN_PAST_S + _STOP_GRACE_S):
                    await settle(msg, "nak")
                await unsubscribe_all(status, adverts, served)

    async def _handle_and_release(self, msgs: list[Msg], limiter: anyio.Semaphore) -> None:
        try:
            await self._handle(msgs)
        except Exception:  # noqa: BLE001 - a bug in one batch must not end the sidecar
            log.exception("classifying a batch of %d failed; it is redelivered", len(msgs))
            for m in msgs:
                await settle(m, "nak", delay_s=1.0)
        finally:
            limiter.release()

    async def _gather(self, psub: Any) -> list[Msg]:
        msgs: list[Msg] = []
        close_at: float | None = None
        while not self._stopping.is_set():
            now = time.time()
            wait_s = self.window.wait_s(len(msgs), close_at, now, idle_wait_s=_IDLE_WAIT_S)
            if msgs and wait_s <= 0.0005:
                break
            # The first wait returns with what is stored or else the first arrival (a wait for a
            # whole batch would hold a lone request until it filled). Its window opens then; one
            # fill takes the rest of the batch until it closes, on the puller's own clock (the
            # server's expiry of a waiting pull ends up to a millisecond late). Each wait's pull
            # request asks for the whole batch and stays open a window past its own end, as the
            # worker's do: the next wait (the fill, then the next batch's first wait, pipelined
            # while this batch is republished) sends none while it may still deliver, and under
            # load it ends filled, not by a status message (Puller.fetch(hold_open_s=)). It
            # cannot be withdrawn: a stop waits for it to end (see run).
            room = self.cfg.max_batch_size - len(msgs)
            wait_s = max(wait_s, 0.001)
            open_s = wait_s + self.window.max_delay_s + _OPEN_PAST_S
            pulled = await pull(psub, room, wait_s, fill=bool(msgs), hold_open_s=open_s)
            if pulled.closed:
                self._stopping.set()
                break
            if pulled.trouble is not None:
                log.warning("fetch failed: %r", pulled.trouble)
                await anyio.sleep(0.1)
                break
            got = pulled.msgs
            filled = bool(msgs)
            if not got:
                break
            if close_at is None:
                # The classifier's window runs from the first fetch (its requests have not waited
                # in a model queue yet).
                close_at = self.window.close_at(time.time(), time.time())
            msgs.extend(got)
            if filled or self.window.is_full(len(msgs)):
                break  # the fill ran to the window's close (or filled the batch)
        return msgs

    def _parse(self, msg: Msg) -> tuple[Item, RequestMeta]:
        headers = msg.headers or {}
        tenant = self.subjects.tenant_from_subject(msg.subject)
        meta = parse_request_headers(headers, policy=self.reply_policy, tenant=tenant, fallback_id=lambda: _fallback_id(msg))
        if tenant is None and msg.subject != self.subjects.ingress and meta.problem is None:
            # A tenant's ingress whose token names no tenant (``_`` stands for "no tenant"): never
            # served as untenanted.
            meta = msgspec.structs.replace(meta, problem=f"ingress subject {msg.subject[:80]!r} names no valid tenant")
        item = Item(headers=headers, data=msg.data, content_type=meta.content_type)
        return item, meta

    async def _handle(self, msgs: list[Msg]) -> None:
        now = time.time()
        parsed = [self._parse(m) for m in msgs]
        routes: list[Route | None] = [None] * len(msgs)
        excess: set[int] = set()  # indices moved to the batch line beyond their tenant's share
        to_classify: list[int] = []
        for i, (item, meta) in enumerate(parsed):
            if meta.problem is not None:
                routes[i] = Route(None, (ErrorCode.BAD_REQUEST, meta.problem))
            elif meta.deadline is not None and meta.deadline < now:
                routes[i] = Route(None, (ErrorCode.DEADLINE_EXCEEDED, f"deadline passed {now - meta.deadline:.3f}s before routing"))
            elif meta.model:
                # The producer named the model: no classification.
                self.stats["direct"] += 1
                routes[i] = Route(meta.model)
            else:
                to_classify.append(i)
        with self._tracer.start_as_current_span(
            f"process {self.subjects.ingress}",  # messaging conventions: "{operation} {destination}"
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": self.subjects.ingress,
                "messaging.consumer.group.name": classifier_consumer_name(),
                "messaging.batch.message_count": len(msgs),
                "jetbatch.classifier.classified": len(to_classify),
            },
        ) as span:
            link_requests(span, [m.headers for m in msgs])
            if to_classify:
                batch = [parsed[i][0] for i in to_classify]
                started = time.perf_counter()
                try:
                    if self.router.inline:
                        decided = self.router.route(batch)
                    else:
                        decided = await anyio.to_thread.run_sync(self.router.route, batch)
                    self.metrics.route_duration.record(time.perf_counter() - started)
                except Exception as exc:  # noqa: BLE001 - a router bug answers the batch, it does not kill the sidecar
                    log.error("router failed on a batch of %d: %r", len(batch), exc)
                    decided = [Route(None, (ErrorCode.INTERNAL, f"router failed: {client_message(exc)}"))] * len(batch)
                for i, route in zip(to_classify, decided):
                    routes[i] = route
            for i, route in enumerate(routes):
                meta = parsed[i][1]
                if route is not None and route.model is not None and meta.deadline is not None:
                    refused = self.admission.refusal(route.model, meta.deadline - now)
                    if refused is not None:
                        routes[i] = Route(None, (ErrorCode.OVERLOADED, refused))
                        continue
                if route is not None and route.model is not None:
                    routes[i], parsed[i], moved = self._share(route, parsed[i], now)
                    if moved:
                        excess.add(i)
            failed = await self._forward([(msg, meta, route) for msg, (_, meta), route in zip(msgs, parsed, routes) if route], excess={id(msgs[i]) for i in excess})
            if failed:
                await self._answer(failed)
        self.stats["batches"] += 1
        self.stats["requests"] += len(msgs)
        self.metrics.batch_size.record(len(msgs))

    def _share(self, route: Route, parsed: tuple[Item, RequestMeta], now: float) -> tuple[Route, tuple[Item, RequestMeta], bool]:
        """Its tenant's quotas and fair share (tenancy.py): refused ``Overloaded`` by a quota, or
        an interactive request beyond the tenant's share sent to the model's batch line."""
        item, meta = parsed
        waiting = self._service_feed.waiting(meta.tenant, now) if meta.tenant and self.config.tenants.waiting_quota(meta.tenant) else None
        verdict = self.shares.admit(meta.tenant, now, interactive=Priority(meta.priority) is Priority.INTERACTIVE, waiting=waiting)
        tenant = self.metrics.tenant_label(meta.tenant)
        if verdict.refused is not None:
            self.metrics.tenant_requests.add(1, {"jetbatch.tenant": tenant, "jetbatch.admission": "refused"})
            return Route(None, (ErrorCode.OVERLOADED, verdict.refused)), parsed, False
        self.metrics.tenant_requests.add(1, {"jetbatch.tenant": tenant, "jetbatch.admission": "demoted" if verdict.demoted else "admitted"})
        self._service_feed.admitted(meta.tenant)
        if verdict.demoted:
            return route, (item, msgspec.structs.replace(meta, priority=Priority.BATCH)), True
        return route, parsed, False

    async def _forward(self, routed: list[tuple[Msg, RequestMeta, Route]], excess: AbstractSet[int] = frozenset()) -> list[tuple[Msg, RequestMeta, Route]]:
        """Republish the routed requests and ack each once JetStream has it; return the others
        with their errors. The whole batch goes out back to back with its PubAcks awaited together
        (one round trip a batch); a request that first attempt did not place takes the careful
        path, retried under its ``Nats-Msg-Id`` with typed errors."""
        failed: list[tuple[Msg, RequestMeta, Route]] = []
        sent: list[tuple[Msg, RequestMeta, Route, str, dict[str, str], asyncio.Future[Any] | None]] = []
        pending = AckGroup()  # one wake-up once every PubAck of the batch came
        unknown = await self._registry.unregistered({route.model for _, _, route in routed if route.error is None and route.model is not None}, _REGISTRY_LOOKUP_S)
        for msg, meta, route in routed:
            if route.error is None and route.model in unknown:
                failed.append((msg, meta, Route(route.model, (ErrorCode.UNKNOWN_MODEL, f"no model named {route.model!r} is served"))))
                continue
            prepared = self._prepare(msg, meta, route, excess=id(msg) in excess)
            if isinstance(prepared, tuple) and isinstance(prepared[0], ErrorCode):
                failed.append((msg, meta, Route(route.model, prepared)))
                continue
            subject, headers = prepared
            try:
                fut: asyncio.Future[Any] | None = await self._pubacks.publish(subject, msg.data, headers, group=pending)
            except TRANSPORT_ERRORS:
                fut = None  # reconnecting with a full buffer, or closed: the careful path decides
            sent.append((msg, meta, route, subject, headers, fut))
        await pending.wait(_REPUBLISH_ACK_TIMEOUT_S)
        retry = []
        for msg, meta, route, subject, headers, fut in sent:
            if fut is not None and not fut.cancelled() and fut.exception() is None:
                await self._forwarded(msg, route.model)
            else:
                retry.append((msg, meta, route, subject, headers))
        errors = await asyncio.gather(*(self._republish(subject, msg, meta, headers) for msg, meta, _, subject, headers in retry))
        for (msg, meta, route, _, _), error in zip(retry, errors):
            if error is None:
                await self._forwarded(msg, route.model)
            else:
                failed.append((msg, meta, Route(route.model, error)))
        return failed

    def _prepare(self, msg: Msg, meta: RequestMeta, route: Route, *, excess: bool = False) -> tuple[str, dict[str, str]] | tuple[ErrorCode, str]:
        """The subject and headers a routed request is republished with, or why it cannot be."""
        if route.error is not None or route.model is None:
            return route.error or (ErrorCode.INTERNAL, "router returned neither a model nor an error")
        try:
            # The request's class chooses the line (validates the name too).
            subject = self.subjects.model(route.model, meta.priority)
        except ProtocolError as exc:
            return (ErrorCode.UNKNOWN_MODEL, f"router chose an invalid model name: {exc}")
        # Unchanged (reply-to, deadline, trace context), except: the tenant is the classifier's
        # word, from the subject the request arrived on, never the producer's; no Nats-* header of
        # the producer's steers the republish (Nats-Expected-*, Nats-Rollup, ...); and the request
        # id the classifier parsed (a fallback one when the producer sent none) is the dedupe key.
        headers = {k: v for k, v in forwardable_headers(msg.headers).items() if k not in (Headers.TENANT, Headers.EXCESS)}
        headers[Headers.MSG_ID] = dedupe_id(meta.tenant, meta.request_id)
        if meta.tenant is not None:
            headers[Headers.TENANT] = meta.tenant
        if Priority(meta.priority) is Priority.BATCH:
            headers[Headers.PRIORITY] = Priority.BATCH.value  # its line, also when moved there by its tenant's share
        if excess:
            headers[Headers.EXCESS] = "1"
        if message_bytes(headers, msg.data) > (self.nc.max_payload or 1 << 20):
            return (ErrorCode.BAD_REQUEST, "request is over the server's max payload once routed")
        return subject, headers

    async def _forwarded(self, msg: Msg, model: str | None) -> None:
        self.stats["routed"] += 1
        if model is not None and len(self._stored_models) < _MAX_MODEL_LABELS:
            self._stored_models.add(model)  # the models stream took it: a model the deployment has
        self.metrics.requests.add(1, {"jetbatch.model": self._model_label(model), "jetbatch.status": "ok"})
        await self._settle_forwarded(msg)

    async def _settle_forwarded(self, msg: Msg) -> None:
        await settle(msg, "ack")

    async def _answer(self, failed: list[tuple[Msg, RequestMeta, Route]]) -> None:
        answers = []
        for msg, meta, route in failed:
            assert route.error is not None
            code, message = route.error
            refused = Headers.REPLY_TO in (msg.headers or {}) and meta.reply_to is None and meta.reply_key is None
            if code is ErrorCode.UNKNOWN_MODEL or refused:
                # Kept for an operator before the caller hears of it.
                await self.replier.dead_letter(msg, message, "classifier")
            answers.append(Answer.failure(meta, code, message, model=route.model))
        await self.replier.deliver(answers)
        for (msg, meta, route), answer in zip(failed, answers):
            self.stats["errors"] += 1
            status = answer.error.value if answer.error is not None else "internal"
            self.metrics.requests.add(1, {"jetbatch.model": self._model_label(route.model), "jetbatch.status": status})
            await settle(msg, "term" if answer.error is ErrorCode.BAD_REQUEST else "ack")

    def _model_label(self, model: str | None) -> str:
        """The ``jetbatch.model`` of a request's count: its model once the models stream has taken
        a request for it, else ``_other`` (a name no queue took: unknown, or not yet seen)."""
        if not model:
            return ""
        return model if model in self._stored_models else OTHER_MODEL_LABEL

    async def _republish(self, subject: str, msg: Msg, meta: RequestMeta, headers: dict[str, str]) -> tuple[ErrorCode, str] | None:
        """The careful path: publish with retries under the same ``Nats-Msg-Id`` (dedupe makes a
        repeat of the bulk attempt safe); JetStream's refusals become typed errors."""
        model = self.subjects.model_from_subject(subject)

        async def no_stream() -> JetbatchError | None:
            try:
                info = await self.js.stream_info(self.subjects.models_stream)
            except TRANSPORT_ERRORS:
                return None  # JetStream unavailable: retry, dedupe makes it safe
            if any(subject_matches(pattern, subject) for pattern in info.config.subjects or []):
                return None  # the stream takes this model: no responder was an election, not "unknown"
            return UnknownModel(f"no model named {model!r} is served")

        try:
            await publish_with_retries(
                self.js, subject, msg.data, headers, deadline=time.monotonic() + 15.0, request_id=meta.request_id, no_stream=no_stream
            )
        except UnknownModel as exc:
            return (ErrorCode.UNKNOWN_MODEL, exc.message)
        except Overloaded:
            return (ErrorCode.OVERLOADED, f"queue for model {model} is full")
        except PayloadTooLarge:
            return (ErrorCode.BAD_REQUEST, "payload is over the model queue's max message size")
        except BadRequest as exc:
            return (ErrorCode.BAD_REQUEST, exc.message)
        except JetbatchError as exc:
            log.warning("republish of %s failed: %s", meta.request_id, exc.message)
            return (ErrorCode.INTERNAL, f"JetStream did not take the republish: {exc.message}")
        return None


class _Clocked:
    """The service feed as ``follow_adverts`` calls it, with the classifier's clock."""

    def __init__(self, feed: ServiceFeed) -> None:
        self.feed = feed

    def on_advert(self, key: str, data: bytes, deleted: bool) -> None:
        self.feed.on_advert(key, data, deleted, time.time())


def _fallback_id(msg: Msg) -> str:
    """An id for a request that came without a valid one: from its ingress stream sequence and
    publish time, so a redelivery after a crash republishes under the same id (and JetStream
    drops the repeat), where a random one would have the model run it twice."""
    try:
        meta = msg.metadata
        return f"in{int(meta.sequence.stream)}-{int(meta.timestamp.timestamp() * 1e6)}"
    except Exception:  # noqa: BLE001 - not a JetStream message (tests, a core publish)
        return new_request_id()
