"""The classifier sidecar: routes requests from ``<prefix>.in`` to ``<prefix>.model.<name>``.

It pulls ingress requests in batches (``max_batch_size`` / ``max_delay_ms``, the worker's window),
decides each request's model with a router (a batched torch network, rules, or a callable), and
republishes each request unchanged (payload and every header) to its model's queue. The
republish carries ``Nats-Msg-Id`` = request id, so a retry after a crash is deduplicated by
JetStream, and the ingress message is acked only after JetStream confirmed the republish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from jetbatch import __version__
from jetbatch.sdk.protocol import (
    JS_MSG_TOO_BIG,
    JS_STREAM_FULL,
    ContentType,
    ErrorCode,
    Headers,
    ProtocolError,
    RequestMeta,
    SidecarReport,
    Subjects,
    decode_payload,
    message_bytes,
    parse_request_headers,
)

from .config import ClassifierConfig, Config, ConfigError, load_config
from .handlers import import_object, read_module
from .status import serve_status
from .streams import classifier_consumer_name, ensure_classifier_streams
from .policy import BatchWindow
from .replies import Answer, Replier, client_message, settle
from .telemetry import links_from_headers

__all__ = [
    "CallableRouter",
    "Classifier",
    "Route",
    "Router",
    "RulesRouter",
    "TorchRouter",
    "add_arguments",
    "make_router",
    "run",
]

log = logging.getLogger("jetbatch.classifier")
_tracer_name = "jetbatch.sidecar"


_FILE_FORMATS = ("export", "state_dict", "torchscript")


@dataclass(frozen=True)
class Route:
    """A router's verdict for one request: a model name, or an error for the caller."""

    model: str | None
    error: tuple[ErrorCode, str] | None = None


@dataclass
class Item:
    """One ingress request as a router sees it."""

    headers: Mapping[str, str]
    data: bytes
    content_type: str | None

    def payload(self) -> Any:
        """The decoded payload (raises ProtocolError when undecodable)."""
        return decode_payload(self.data, self.content_type)


class Router:
    """Decides the model of every request of a batch at once."""

    def route(self, items: Sequence[Item]) -> list[Route]:
        raise NotImplementedError

    def load(self) -> None:
        """Prepare (load weights); called once, in a worker thread."""


class TorchRouter(Router):
    """A classification network run on the whole batch in one forward pass.

    Inputs must be tensors of one shape; the argmax class (as a string index, or the network's
    label) maps to a model through ``labels``; below ``confidence_threshold`` the softmax top
    probability sends the request to ``fallback_model``.
    """

    def __init__(self, cfg: ClassifierConfig) -> None:
        if not cfg.path and cfg.handler in _FILE_FORMATS:
            raise ConfigError(f"classifier.path: required for the torch router with handler {cfg.handler!r}")
        if not cfg.labels:
            raise ConfigError("classifier.labels: the torch router needs a label -> model map")
        self.cfg = cfg
        self.module: Any = None

    def load(self) -> None:
        if self.cfg.handler in _FILE_FORMATS:
            module = read_module(
                self.cfg.handler, self.cfg.path or "", module_class=self.cfg.module_class, module_kwargs=dict(self.cfg.module_kwargs)
            )
            self.module = module.to(self.cfg.device) if self.cfg.device != "cpu" else module
        else:
            factory = import_object(self.cfg.handler, what="classifier.handler")
            self.module = factory(self.cfg) if isinstance(factory, type) else factory
            if hasattr(self.module, "eval"):
                self.module.eval()

    def route(self, items: Sequence[Item]) -> list[Route]:
        import torch

        routes: list[Route | None] = [None] * len(items)
        tensors, index = [], []
        for i, item in enumerate(items):
            try:
                value = item.payload()
                tensor = value.to_torch() if hasattr(value, "to_torch") else None
                if tensor is None:
                    raise ProtocolError(f"the torch router needs a tensor ({ContentType.TENSOR.value})")
                tensors.append(tensor.to(torch.float32))
                index.append(i)
            except ProtocolError as exc:
                routes[i] = Route(None, (ErrorCode.BAD_REQUEST, str(exc)))
        if tensors:
            try:
                batch = torch.stack(tensors).to(self.cfg.device)
            except RuntimeError as exc:
                for i in index:
                    routes[i] = Route(None, (ErrorCode.BAD_REQUEST, f"inputs of different shapes in one batch: {exc}"))
                return [r or Route(None, (ErrorCode.INTERNAL, "unrouted")) for r in routes]
            with torch.inference_mode():
                logits = self.module(batch)
            probs = torch.softmax(logits.float(), dim=-1)
            top_p, top_i = probs.max(dim=-1)
            for i, p, k in zip(index, top_p.tolist(), top_i.tolist()):
                if p < self.cfg.confidence_threshold and self.cfg.fallback_model:
                    routes[i] = Route(self.cfg.fallback_model)
                    continue
                model = self.cfg.labels.get(str(k))
                routes[i] = Route(model) if model else Route(None, (ErrorCode.UNKNOWN_MODEL, f"class {k} maps to no model"))
        return [r or Route(None, (ErrorCode.INTERNAL, "unrouted")) for r in routes]


class RulesRouter(Router):
    """First matching rule wins: ``{header = "X", equals = "v", model = "m"}`` or
    ``{field = "a.b", equals = v, model = "m"}`` (a field of a JSON/msgpack map payload)."""

    def __init__(self, cfg: ClassifierConfig) -> None:
        for n, rule in enumerate(cfg.rules):
            if "model" not in rule or ("header" not in rule and "field" not in rule) or "equals" not in rule:
                raise ConfigError(f"classifier.rules[{n}]: needs model, equals, and header or field")
        self.rules = cfg.rules
        self.default = cfg.default_model

    def route(self, items: Sequence[Item]) -> list[Route]:
        out = []
        for item in items:
            try:
                out.append(self._one(item))
            except ProtocolError as exc:
                out.append(Route(None, (ErrorCode.BAD_REQUEST, str(exc))))
        return out

    def _one(self, item: Item) -> Route:
        payload: Any = None
        decoded = False
        for rule in self.rules:
            if "header" in rule:
                if item.headers.get(rule["header"]) == rule["equals"]:
                    return Route(rule["model"])
                continue
            if not decoded:
                payload, decoded = item.payload(), True
            value: Any = payload
            for part in str(rule["field"]).split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value == rule["equals"]:
                return Route(rule["model"])
        if self.default:
            return Route(self.default)
        return Route(None, (ErrorCode.UNKNOWN_MODEL, "no routing rule matched and no default_model is set"))


class CallableRouter(Router):
    """``package.module:function``, called as ``function(payloads, headers) -> list[model]`` on
    the whole batch (payloads decoded; an undecodable one is passed as None)."""

    def __init__(self, cfg: ClassifierConfig) -> None:
        if not cfg.callable:
            raise ConfigError("classifier.callable: required for the callable router")
        self.fn: Callable[..., Sequence[str | None]] = import_object(cfg.callable, what="classifier.callable")

    def route(self, items: Sequence[Item]) -> list[Route]:
        payloads: list[Any] = []
        bad: dict[int, str] = {}
        for i, item in enumerate(items):
            try:
                payloads.append(item.payload())
            except ProtocolError as exc:
                payloads.append(None)
                bad[i] = str(exc)
        models = list(self.fn(payloads, [dict(item.headers) for item in items]))
        if len(models) != len(items):
            raise RuntimeError(f"router callable returned {len(models)} models for {len(items)} requests")
        out = []
        for i, model in enumerate(models):
            if i in bad:
                out.append(Route(None, (ErrorCode.BAD_REQUEST, bad[i])))
            elif not model:
                out.append(Route(None, (ErrorCode.UNKNOWN_MODEL, "the router gave no model")))
            else:
                out.append(Route(str(model)))
        return out


def make_router(cfg: ClassifierConfig) -> Router:
    kinds: dict[str, type[Router]] = {"torch": TorchRouter, "rules": RulesRouter, "callable": CallableRouter}
    return kinds[cfg.router](cfg)


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
        self.router = router or make_router(self.cfg)
        self.id = f"classifier-{socket.gethostname()}-{os.getpid()}"
        self.stats = {"batches": 0, "requests": 0, "routed": 0, "errors": 0, "direct": 0}
        self.replier = Replier(nc, self.subjects, config.replies, reply_nc=reply_nc)
        self.reply_policy = config.reply_policy
        self.window = BatchWindow(self.cfg.max_batch_size, self.cfg.max_delay_ms / 1000.0)
        self._stopping = anyio.Event()
        self._ready = anyio.Event()
        self._started_at = time.time()
        self._tracer = trace.get_tracer(_tracer_name)

    @property
    def ready(self) -> anyio.Event:
        return self._ready

    def stop(self) -> None:
        self._stopping.set()

    def report(self) -> SidecarReport:
        return SidecarReport(
            role="classifier", id=self.id, version=__version__, stats=dict(self.stats), started_at=self._started_at, updated_at=time.time()
        )

    async def _setup(self) -> Any:
        await ensure_classifier_streams(self.js, self.subjects, self.config.streams, self.config.replies)
        return await self.js.pull_subscribe_bind(durable=classifier_consumer_name(), stream=self.subjects.ingress_stream)

    async def run(self) -> None:
        from .worker import retry_startup

        psub = await retry_startup(self._setup, timeout_s=self.config.worker.startup_timeout_s, what=self.id)
        await anyio.to_thread.run_sync(self.router.load)
        status = await serve_status(self.nc, self.subjects, self.report)
        self._ready.set()
        # Pipelining: the next batch is fetched and classified while the previous one's
        # republishes wait for their PubAcks (at most two batches in flight).
        in_flight = anyio.Semaphore(2)
        try:
            async with anyio.create_task_group() as tg:
                while not self._stopping.is_set():
                    msgs = await self._gather(psub)
                    if msgs:
                        await in_flight.acquire()
                        tg.start_soon(self._handle_and_release, msgs, in_flight)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await status.unsubscribe()
                    await psub.unsubscribe()
                except (nats.errors.Error, ValueError):
                    pass

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
            wait_s = self.window.wait_s(len(msgs), close_at, now, idle_wait_s=0.25)
            if msgs and wait_s <= 0.0005:
                break
            try:
                got = await psub.fetch(batch=self.cfg.max_batch_size - len(msgs), timeout=max(wait_s, 0.001))
            except (nats.errors.TimeoutError, TimeoutError):
                break
            except nats.errors.ConnectionClosedError:
                self._stopping.set()
                break
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("fetch failed: %r", exc)
                await anyio.sleep(0.1)
                break
            if close_at is None:
                # The classifier's window runs from the first fetch (its requests have not waited
                # in a model queue yet).
                close_at = self.window.close_at(time.time(), time.time())
            msgs.extend(got)
            if self.window.is_full(len(msgs)):
                break
        return msgs

    def _parse(self, msg: Msg) -> tuple[Item, RequestMeta]:
        headers = msg.headers or {}
        tenant = self.subjects.tenant_from_subject(msg.subject)
        meta = parse_request_headers(headers, policy=self.reply_policy, tenant=tenant, fallback_id=uuid.uuid4().hex)
        item = Item(headers=headers, data=msg.data, content_type=meta.content_type)
        return item, meta

    async def _handle(self, msgs: list[Msg]) -> None:
        now = time.time()
        parsed = [self._parse(m) for m in msgs]
        routes: list[Route | None] = [None] * len(msgs)
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
            f"{self.subjects.ingress} process",
            kind=SpanKind.CONSUMER,
            links=links_from_headers([m.headers for m in msgs]),
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "process",
                "messaging.destination.name": self.subjects.ingress,
                "messaging.batch.message_count": len(msgs),
                "jetbatch.classifier.classified": len(to_classify),
            },
        ):
            if to_classify:
                batch = [parsed[i][0] for i in to_classify]
                try:
                    decided = await anyio.to_thread.run_sync(self.router.route, batch)
                except Exception as exc:  # noqa: BLE001 - a router bug answers the batch, it does not kill the sidecar
                    log.error("router failed on a batch of %d: %r", len(batch), exc)
                    decided = [Route(None, (ErrorCode.INTERNAL, f"router failed: {client_message(exc)}"))] * len(batch)
                for i, route in zip(to_classify, decided):
                    routes[i] = route
            # Republish the whole batch concurrently: one PubAck round trip per batch, not per request.
            outcomes = await asyncio.gather(
                *(self._forward(msg, item, meta, route) for msg, (item, meta), route in zip(msgs, parsed, routes) if route)
            )
            failed = [o for o in outcomes if o is not None]
            if failed:
                await self._answer(failed)
        self.stats["batches"] += 1
        self.stats["requests"] += len(msgs)

    async def _forward(self, msg: Msg, item: Item, meta: RequestMeta, route: Route) -> tuple[Msg, RequestMeta, Route] | None:
        """Republish a routed request (then ack it); return it with its error otherwise."""
        error = route.error
        if error is None and route.model is not None:
            try:
                subject = self.subjects.model(route.model)  # validates the name
            except ProtocolError as exc:
                error = (ErrorCode.UNKNOWN_MODEL, f"router chose an invalid model name: {exc}")
            else:
                error = await self._republish(subject, msg, meta)
                if error is None:
                    self.stats["routed"] += 1
                    await self._settle_forwarded(msg)
                    return None
        assert error is not None
        return msg, meta, Route(route.model, error)

    async def _settle_forwarded(self, msg: Msg) -> None:
        await settle(msg, "ack")

    async def _answer(self, failed: list[tuple[Msg, RequestMeta, Route]]) -> None:
        answers = []
        for msg, meta, route in failed:
            assert route.error is not None
            code, message = route.error
            refused = Headers.REPLY_TO in (msg.headers or {}) and meta.reply_to is None
            if code is ErrorCode.UNKNOWN_MODEL or refused:
                # Kept for an operator before the caller hears of it.
                await self.replier.dead_letter(msg, message, "classifier")
            answers.append(Answer.failure(meta, code, message, model=route.model))
        await self.replier.deliver(answers)
        for (msg, meta, route), answer in zip(failed, answers):
            self.stats["errors"] += 1
            await settle(msg, "term" if answer.error is ErrorCode.BAD_REQUEST else "ack")

    async def _republish(self, subject: str, msg: Msg, meta: RequestMeta) -> tuple[ErrorCode, str] | None:
        # Unchanged (request id, reply-to, deadline, trace context), except the tenant: the
        # classifier's word, from the subject the request arrived on, never the producer's.
        headers = {k: v for k, v in (msg.headers or {}).items() if k != Headers.TENANT}
        if meta.tenant is not None:
            headers[Headers.TENANT] = meta.tenant
        if message_bytes(headers, msg.data) > (self.nc.max_payload or 1 << 20):
            return (ErrorCode.BAD_REQUEST, "request is over the server's max payload once routed")
        model = self.subjects.model_from_subject(subject)
        for attempt in range(5):
            try:
                await self.js.publish(subject, msg.data, headers=headers, timeout=5)
                return None
            except (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError):
                try:
                    await self.js.stream_info(self.subjects.models_stream)
                except (nats.js.errors.Error, nats.errors.Error, asyncio.TimeoutError):
                    await anyio.sleep(0.1 * 2**attempt)  # JetStream unavailable: retry, dedupe makes it safe
                    continue
                return (ErrorCode.UNKNOWN_MODEL, f"no model named {model!r} is served")
            except nats.js.errors.APIError as exc:
                if exc.err_code in JS_STREAM_FULL:
                    return (ErrorCode.OVERLOADED, f"queue for model {model} is full")
                if exc.err_code in JS_MSG_TOO_BIG:
                    return (ErrorCode.BAD_REQUEST, "payload is over the model queue's max message size")
                return (ErrorCode.INTERNAL, f"JetStream refused the republish: {exc.description}")
            except nats.errors.BadHeaderError as exc:
                return (ErrorCode.BAD_REQUEST, f"invalid header name: {exc}")
            except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.OutboundBufferLimitError):
                await anyio.sleep(0.1 * 2**attempt)
            except nats.errors.Error as exc:
                log.warning("republish of %s failed: %r", meta.request_id, exc)
                await anyio.sleep(0.1 * 2**attempt)
        return (ErrorCode.INTERNAL, "JetStream did not acknowledge the republish")


# --- CLI ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, help="TOML config with a [classifier] section")
    parser.add_argument("--nats-url", default=None, help="NATS server URL(s) (default: $NATS_URL)")
    parser.add_argument("--log-level", default=os.environ.get("JETBATCH_LOG_LEVEL", "WARNING"))
    parser.add_argument("--trace-console", action="store_true", help="print spans to stdout (debugging)")


def run(args: argparse.Namespace) -> int:
    from .cli import _setup_telemetry

    config = load_config(args.config)
    if config.classifier is None:
        raise ConfigError(f"{args.config}: no [classifier] section")
    url = args.nats_url or config.nats.url
    if not url:
        raise ConfigError("no NATS server: pass --nats-url or set NATS_URL or nats.url")
    shutdown = _setup_telemetry("classifier", args)
    try:
        return anyio.run(_main, config, url)
    finally:
        shutdown()


async def _main(config: Config, url: str) -> int:
    from .runtime import serve_sidecar

    return await serve_sidecar(config, url, name="jetbatch-classifier", make=lambda nc, rnc: Classifier(config, nc, reply_nc=rnc))
