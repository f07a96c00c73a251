"""Tracing and metrics for the sidecars (OpenTelemetry).

A batch is one ``CONSUMER`` span named ``process <model>`` with a link to each request's producer
span (the OpenTelemetry messaging conventions for batch receive), child spans for model load,
unload and inference, and attributes for the batch's size, queue wait and scheduler decision.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import Observation
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

__all__ = ["ClassifierTelemetry", "LoadRecord", "WorkerTelemetry", "link_requests", "links_from_headers", "tracing_enabled"]


# Histogram buckets per quantity (seconds unless named otherwise).
COMPUTE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LOAD_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# The backlog gauge names at most this many models a worker does not register (the largest
# queues); the rest are summed under ``_other``: any producer can store requests for any model
# name, and each name would otherwise be a series for as long as its requests stay stored.
MAX_UNREGISTERED_BACKLOG_SERIES = 100
OTHER_MODEL_LABEL = "_other"


@dataclass
class LoadRecord:
    """Timing of one switch, kept until the batch that paid for it emits its spans."""

    model: str
    start_ns: int
    end_ns: int
    memory_bytes: int
    evicted: tuple[str, ...] = ()
    # (model, start_ns, end_ns) or (model, start_ns, end_ns, bytes freed) per model evicted first
    unloads: list[tuple[Any, ...]] = field(default_factory=list)


_INSTRUMENTATION = "jetbatch.sidecar"
_TRACEPARENT_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")  # W3C version 00, exactly
log = logging.getLogger(__name__)


def tracing_enabled() -> bool:
    """Whether an OpenTelemetry SDK tracer provider is installed (else spans are no-ops and
    extracting contexts for links would be wasted work on the hot path)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.NoOpTracerProvider, trace.ProxyTracerProvider))


def link_requests(span: Span, headers_list: Sequence[Mapping[str, str] | None]) -> None:
    """Link a batch span to each request's span, once the span is known to be recorded.

    Links given at creation cost the same whether or not the span is sampled (about 4 µs a
    request: reading the context and building the link); added after the sampling decision, an
    unsampled batch costs nothing. The samplers jetbatch documents (ratio, parent-based) do not
    look at links, which is all that adding them at creation would offer."""
    if span.is_recording():
        for link in links_from_headers(headers_list):
            span.add_link(link.context)


def links_from_headers(headers_list: Sequence[Mapping[str, str] | None]) -> list[Link]:
    """One link per request whose headers carry a valid W3C trace context."""
    if not tracing_enabled():
        return []
    links = []
    for headers in headers_list:
        if not headers:
            continue
        span_ctx = _w3c_context(headers)
        if span_ctx is None:
            # Not W3C trace context (another propagator, such as B3, configured on both sides).
            span_ctx = trace.get_current_span(propagate.extract(headers)).get_span_context()
        if span_ctx.is_valid:
            links.append(Link(span_ctx))
    return links


def _w3c_context(headers: Mapping[str, str]) -> trace.SpanContext | None:
    """The remote span context of a ``traceparent`` header, read directly: the worker's request
    parser already checked its form, and the propagator API (a context per request, its regular
    expressions again) cost about three times as much per link. None when there is no such header
    or it does not parse (the propagators then decide)."""
    value = headers.get("traceparent")
    match = _TRACEPARENT_00.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    state = headers.get("tracestate")
    return trace.SpanContext(
        int(match[1], 16),
        int(match[2], 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(match[3], 16)),
        trace_state=trace.TraceState.from_header([state]) if state else None,
    )


class _Gauges:
    """The process's observable gauges, created once, reading every registered worker's report.

    OpenTelemetry keeps the first instrument of a name and drops the callbacks of a second
    ``create_observable_gauge`` with that name, so per-worker gauges would report the first worker
    forever (and keep it alive). Workers are held weakly: a collected worker stops reporting.
    Points carry ``jetbatch.worker.id``, so workers sharing a process stay apart.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: list[tuple[str, Callable[[], Callable[[], Any] | None], Callable[[], Callable[[], bool] | None]]] = []
        self._stored: dict[str, Callable[[], Any]] = {}  # worker id -> weak ref to its queue view
        self._created = False

    def add(self, worker_id: str, report: Callable[[], Any], reports_queues: Callable[[], bool], queues: Any = None) -> None:
        with self._lock:
            self._reports.append((worker_id, _weak(report), _weak(reports_queues)))
            if queues is not None:
                self._stored[worker_id] = weakref.ref(queues)
            if self._created:
                return
            self._created = True
        meter = metrics.get_meter(_INSTRUMENTATION)
        # One meaning per metric (Prometheus naming): use and limit are two gauges, not a label.
        meter.create_observable_gauge(
            "jetbatch.queue.backlog", [self._backlog], unit="{request}",
            description="Requests waiting per model, stream-wide, for every model with requests stored (served here or not); reported by one worker of a deployment, so sum() by model is the backlog",
        )  # fmt: skip
        meter.create_observable_gauge("jetbatch.models.resident", [self._resident], unit="{model}", description="Models resident on the device")
        meter.create_observable_gauge("jetbatch.memory.used", [self._memory_used], unit="By", description="Device memory the resident models hold")
        meter.create_observable_gauge("jetbatch.memory.budget", [self._memory_budget], unit="By", description="Device memory budget (absent when unbounded)")

    def _current(self) -> list[tuple[str, Any, bool]]:
        """(worker id, StatusReport, whether it reports the queues) of each live worker; forgets
        collected ones."""
        out: list[tuple[str, Any, bool]] = []
        with self._lock:
            live = [(wid, ref, owns, ref(), owns()) for wid, ref, owns in self._reports]
            self._reports = [(wid, ref, owns) for wid, ref, owns, fn, _ in live if fn is not None]
            self._stored = {wid: ref for wid, ref in self._stored.items() if ref() is not None}
        for wid, _, _, fn, owns_fn in live:
            if fn is None:
                continue
            try:
                out.append((wid, fn(), bool(owns_fn()) if owns_fn is not None else True))
            except Exception:  # noqa: BLE001 - a failing report must not cost the other gauges
                log.debug("status report of %s failed during metric collection", wid, exc_info=True)
        return out

    def _backlog(self, _: Any) -> Iterable[Observation]:
        # Every worker counts every queue; only the one that reports them is observed, so the
        # series do not double when several workers serve one stream.
        out = []
        for wid, r, owns in self._current():
            if owns:
                counts = dict(r.backlog)
                # Models this worker does not serve: their queues are in its stream count too,
                # and a deployment's one reporter may serve none of the models that wait.
                for m, n in self._unregistered(wid, exclude=counts).items():
                    counts[m] = counts.get(m, 0) + n
                out.extend(Observation(n, {"jetbatch.model": m, "jetbatch.worker.id": wid}) for m, n in counts.items())
        return out

    def _unregistered(self, worker_id: str, *, exclude: Mapping[str, int]) -> dict[str, int]:
        """Requests stored per model that ``worker_id`` does not register, from its queue view's
        last count: the ``MAX_UNREGISTERED_BACKLOG_SERIES`` largest queues, the rest summed
        under ``_other``."""
        ref = self._stored.get(worker_id)
        queues = ref() if ref is not None else None
        stored = {m: n for m, n in dict(getattr(queues, "unregistered", None) or {}).items() if n > 0 and m not in exclude}
        if len(stored) <= MAX_UNREGISTERED_BACKLOG_SERIES:
            return stored
        ranked = sorted(stored.items(), key=lambda item: (-item[1], item[0]))
        named = dict(ranked[:MAX_UNREGISTERED_BACKLOG_SERIES])
        named[OTHER_MODEL_LABEL] = named.get(OTHER_MODEL_LABEL, 0) + sum(n for _, n in ranked[MAX_UNREGISTERED_BACKLOG_SERIES:])
        return named

    def _resident(self, _: Any) -> Iterable[Observation]:
        return [Observation(len(r.resident), {"jetbatch.worker.id": wid}) for wid, r, _ in self._current()]

    def _memory_used(self, _: Any) -> Iterable[Observation]:
        return [Observation(r.memory_bytes, {"jetbatch.worker.id": wid}) for wid, r, _ in self._current()]

    def _memory_budget(self, _: Any) -> Iterable[Observation]:
        return [Observation(r.memory_budget_bytes, {"jetbatch.worker.id": wid}) for wid, r, _ in self._current() if r.memory_budget_bytes is not None]


def _weak(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any] | None]:
    """A weak reference to a bound method (a plain function is held strongly)."""
    return weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)  # type: ignore[arg-type,return-value]


_GAUGES = _Gauges()


class TenantLabels:
    """The ``jetbatch.tenant`` label of a request: its tenant (``_`` for none) while fewer than
    ``limit`` tenants were named, then ``_other``: a bounded label set, whatever names arrive."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, tenant: str | None) -> str:
        name = tenant or "_"
        if name in self._named:
            return name
        if len(self._named) < self.limit:
            self._named.add(name)
            return name
        return "_other"


class WorkerTelemetry:
    """Spans and metrics of one worker. Cheap no-ops unless an OpenTelemetry SDK is installed."""

    def __init__(self, worker_id: str, subjects_prefix: str, *, metric_tenants: int = 32) -> None:
        self.worker_id = worker_id
        self.prefix = subjects_prefix
        self.tenant_label = TenantLabels(metric_tenants)
        self.tracer = trace.get_tracer(_INSTRUMENTATION)
        meter = metrics.get_meter(_INSTRUMENTATION)
        # Explicit bucket advice: the SDK's default boundaries (0, 5, 10, ... 10000) suit
        # milliseconds, so every latency in seconds would land in the first bucket.
        self.batch_size = meter.create_histogram(
            "jetbatch.batch.size", unit="{request}", description="Requests per batch", explicit_bucket_boundaries_advisory=BATCH_SIZE_BUCKETS
        )
        self.queue_wait = meter.create_histogram(
            "jetbatch.queue.wait", unit="s", description="Time a request waited in its queue", explicit_bucket_boundaries_advisory=WAIT_BUCKETS_S
        )
        self.load_duration = meter.create_histogram(
            "jetbatch.model.load.duration", unit="s", description="Model load time", explicit_bucket_boundaries_advisory=LOAD_BUCKETS_S
        )
        self.unload_duration = meter.create_histogram(
            "jetbatch.model.unload.duration", unit="s", description="Model unload time", explicit_bucket_boundaries_advisory=LOAD_BUCKETS_S
        )
        self.infer_duration = meter.create_histogram(
            "jetbatch.infer.duration", unit="s", description="Batch compute time", explicit_bucket_boundaries_advisory=COMPUTE_BUCKETS_S
        )
        self.requests = meter.create_counter("jetbatch.requests", unit="{request}", description="Requests answered, by model and status")
        self.tenant_requests = meter.create_counter(
            "jetbatch.tenant.requests", unit="{request}", description="Requests answered, by tenant (bounded: tenants.metric_tenants, then _other) and status"
        )
        self.tenant_service = meter.create_counter(
            "jetbatch.tenant.service.duration", unit="s", description="Device seconds of the batches that served each tenant's requests (split evenly within a batch)"
        )
        self.loads = meter.create_counter("jetbatch.model.loads", unit="{load}", description="Model loads")
        self.evictions = meter.create_counter("jetbatch.model.evictions", unit="{eviction}", description="Model evictions")
        self.switches = meter.create_counter("jetbatch.scheduler.switches", unit="{switch}", description="Model switches, by reason")

    def tenants_answered(self, answered: list[tuple[str | None, str]]) -> None:
        """Count a batch's answers by (tenant, status): one update per pair, not per request."""
        counts: dict[tuple[str, str], int] = {}
        for tenant, status in answered:
            key = (self.tenant_label(tenant), status)
            counts[key] = counts.get(key, 0) + 1
        for (tenant, status), n in counts.items():
            self.tenant_requests.add(n, {"jetbatch.tenant": tenant, "jetbatch.status": status})

    def tenants_computed(self, tenants: list[str | None], seconds: float) -> None:
        """A batch's device ``seconds``, split evenly between its computed requests' tenants."""
        share: dict[str, float] = {}
        for tenant in tenants:
            label = self.tenant_label(tenant)
            share[label] = share.get(label, 0.0) + seconds / len(tenants)
        for label, s in share.items():
            self.tenant_service.add(s, {"jetbatch.tenant": label})

    def register_gauges(self, report: Callable[[], Any], reports_queues: Callable[[], bool] = lambda: True, queues: Any = None) -> None:
        """Observe this worker's ``report()`` (a StatusReport: backlog, resident models, memory and
        budget) in the process's observable gauges, at each metric collection; its backlog only
        while ``reports_queues()`` (one worker of a deployment reports the stream's queues).
        ``queues`` (held weakly): an object whose ``unregistered`` maps each model this worker
        does not register to the requests stored for it (the worker's ``QueueView``), so the
        backlog gauge shows those queues too."""
        _GAUGES.add(self.worker_id, report, reports_queues, queues)

    def record_load(self, record: "LoadRecord", parent: Span) -> None:
        """Emit the ``model.unload`` and ``model.load`` spans of a switch under ``parent``, the
        batch span that paid for it (the load ran just before that batch began)."""
        ctx = trace.set_span_in_context(parent)
        for name, start_ns, end_ns, *rest in record.unloads:
            attrs: dict[str, Any] = {"jetbatch.model": name, "jetbatch.model.unload.seconds": (end_ns - start_ns) / 1e9}
            if rest:
                attrs["jetbatch.model.bytes"] = rest[0]
            span = self.tracer.start_span("model.unload", context=ctx, start_time=start_ns, attributes=attrs)
            span.end(end_time=end_ns)
        span = self.tracer.start_span(
            "model.load",
            context=ctx,
            start_time=record.start_ns,
            attributes={
                "jetbatch.model": record.model,
                "jetbatch.model.load.seconds": (record.end_ns - record.start_ns) / 1e9,
                "jetbatch.model.bytes": record.memory_bytes,
                "jetbatch.model.evicted": list(record.evicted),
            },
        )
        span.end(end_time=record.end_ns)

    @contextlib.contextmanager
    def batch_span(
        self,
        model: str,
        headers_list: Sequence[Mapping[str, str] | None],
        *,
        batch_id: str,
        waits_ms: Sequence[float],
        decision: str,
        loaded: bool,
        start_ns: int | None = None,
    ) -> Iterator[Span]:
        """The span of one batch, linked to every request in it. A batch that paid a load starts
        when the load started (``start_ns``), so the switch shows inside it."""
        attrs: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": f"{self.prefix}.model.{model}",
            "messaging.consumer.group.name": f"model-{model}",
            "messaging.batch.message_count": len(headers_list),
            "jetbatch.model": model,
            "jetbatch.batch.id": batch_id,
            "jetbatch.worker.id": self.worker_id,
            "jetbatch.scheduler.decision": decision,
            "jetbatch.model.loaded": loaded,
        }
        if waits_ms:
            attrs["jetbatch.queue.wait.min_ms"] = min(waits_ms)
            attrs["jetbatch.queue.wait.max_ms"] = max(waits_ms)
            attrs["jetbatch.queue.wait.mean_ms"] = sum(waits_ms) / len(waits_ms)
        # Messaging conventions (v1.37): "{operation name} {destination}".
        with self.tracer.start_as_current_span(
            f"process {self.prefix}.model.{model}", kind=SpanKind.CONSUMER, attributes=attrs, start_time=start_ns
        ) as span:
            link_requests(span, headers_list)
            yield span
        self.batch_size.record(len(headers_list), {"jetbatch.model": model})
        for w in waits_ms:
            self.queue_wait.record(w / 1000.0, {"jetbatch.model": model})

    @contextlib.contextmanager
    def child_span(self, name: str, **attributes: Any) -> Iterator[Span]:
        """A span under the current one (``infer`` under the batch span), current while open."""
        with self.tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def mark_error(self, span: Span, exc: BaseException) -> None:
        """Record ``exc`` on ``span`` (an ``exception`` event, ``error.type`` its class) and set
        its status to ERROR."""
        span.set_attribute("error.type", type(exc).__qualname__)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))

    def mark_status_error(self, span: Span, description: str, error_type: str) -> None:
        """ERROR status with ``error.type`` (an error code such as ``model_failed``)."""
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, description))

    @staticmethod
    def trace_id_hex(span: Span) -> str:
        """The span's trace id as 32 hex digits (the ``trace`` field of the ``Jetbatch-Batch`` reply header), or
        ``""`` when tracing is off."""
        ctx = span.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class ClassifierTelemetry:
    """The classifier's metrics (its spans are made where it routes)."""

    def __init__(self, *, metric_tenants: int = 32) -> None:
        self.tenant_label = TenantLabels(metric_tenants)
        meter = metrics.get_meter(_INSTRUMENTATION)
        self.requests = meter.create_counter(
            "jetbatch.classifier.requests", unit="{request}",
            description="Requests the classifier handled: routed (status ok, by model, direct when the producer named it) or answered with an error (status: the code)",
        )  # fmt: skip
        self.tenant_requests = meter.create_counter(
            "jetbatch.classifier.tenant.requests", unit="{request}",
            description="Requests by tenant and admission: admitted, demoted (beyond the tenant's fair share, to the batch line) or refused (a quota); tenants past tenants.metric_tenants counted as _other",
        )  # fmt: skip
        self.batch_size = meter.create_histogram(
            "jetbatch.classifier.batch.size", unit="{request}", description="Requests per classifier batch", explicit_bucket_boundaries_advisory=BATCH_SIZE_BUCKETS
        )
        self.route_duration = meter.create_histogram(
            "jetbatch.classifier.route.duration", unit="s", description="Time to classify one batch (the router's forward pass)",
            explicit_bucket_boundaries_advisory=COMPUTE_BUCKETS_S,
        )  # fmt: skip
