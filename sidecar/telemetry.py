"""Tracing and metrics for the sidecars (OpenTelemetry).

A batch is one ``CONSUMER`` span named ``process <model>`` with a link to each request's producer
span (the OpenTelemetry messaging conventions for batch receive), child spans for model load,
unload and inference, and attributes for the batch's size, queue wait and scheduler decision.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import Observation
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

__all__ = ["LoadRecord", "WorkerTelemetry", "links_from_headers", "tracing_enabled"]


@dataclass
class LoadRecord:
    """Timing of one switch, kept until the batch that paid for it emits its spans."""

    model: str
    start_ns: int
    end_ns: int
    memory_bytes: int
    evicted: tuple[str, ...] = ()
    unloads: list[tuple[str, int, int]] = field(default_factory=list)  # (model, start_ns, end_ns)

_INSTRUMENTATION = "jetbatch.sidecar"


def tracing_enabled() -> bool:
    """Whether an OpenTelemetry SDK tracer provider is installed (else spans are no-ops and
    extracting contexts for links would be wasted work on the hot path)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.NoOpTracerProvider, trace.ProxyTracerProvider))


def links_from_headers(headers_list: Sequence[Mapping[str, str] | None]) -> list[Link]:
    """One link per request whose headers carry a valid W3C trace context."""
    if not tracing_enabled():
        return []
    links = []
    for headers in headers_list:
        if not headers:
            continue
        ctx = propagate.extract(headers)
        span_ctx = trace.get_current_span(ctx).get_span_context()
        if span_ctx.is_valid:
            links.append(Link(span_ctx))
    return links


class WorkerTelemetry:
    """Spans and metrics of one worker. Cheap no-ops unless an OpenTelemetry SDK is installed."""

    def __init__(self, worker_id: str, subjects_prefix: str) -> None:
        self.worker_id = worker_id
        self.prefix = subjects_prefix
        self.tracer = trace.get_tracer(_INSTRUMENTATION)
        meter = metrics.get_meter(_INSTRUMENTATION)
        self.batch_size = meter.create_histogram("jetbatch.batch.size", unit="{request}", description="Requests per batch")
        self.queue_wait = meter.create_histogram("jetbatch.queue.wait", unit="s", description="Time a request waited in its queue")
        self.load_duration = meter.create_histogram("jetbatch.model.load.duration", unit="s", description="Model load time")
        self.unload_duration = meter.create_histogram("jetbatch.model.unload.duration", unit="s", description="Model unload time")
        self.infer_duration = meter.create_histogram("jetbatch.infer.duration", unit="s", description="Batch compute time")
        self.requests = meter.create_counter("jetbatch.requests", unit="{request}", description="Requests answered, by model and status")
        self.loads = meter.create_counter("jetbatch.model.loads", unit="{load}", description="Model loads")
        self.evictions = meter.create_counter("jetbatch.model.evictions", unit="{eviction}", description="Model evictions")
        self.switches = meter.create_counter("jetbatch.scheduler.switches", unit="{switch}", description="Model switches, by reason")

    def register_gauges(self, report: Callable[[], Any]) -> None:
        """Observable gauges read from ``report()`` (a StatusReport) at each collection."""
        meter = metrics.get_meter(_INSTRUMENTATION)

        def backlog(_: Any) -> Iterable[Observation]:
            r = report()
            return [Observation(n, {"jetbatch.model": m}) for m, n in r.backlog.items()]

        def resident(_: Any) -> Iterable[Observation]:
            return [Observation(len(report().resident), {"jetbatch.worker.id": self.worker_id})]

        def memory(_: Any) -> Iterable[Observation]:
            r = report()
            out = [Observation(r.memory_bytes, {"jetbatch.memory": "used"})]
            if r.memory_budget_bytes is not None:
                out.append(Observation(r.memory_budget_bytes, {"jetbatch.memory": "budget"}))
            return out

        meter.create_observable_gauge("jetbatch.queue.backlog", [backlog], unit="{request}", description="Requests waiting per model")
        meter.create_observable_gauge("jetbatch.models.resident", [resident], unit="{model}", description="Models resident on the device")
        meter.create_observable_gauge("jetbatch.memory", [memory], unit="By", description="Device memory in use, and the budget")

    def record_load(self, record: "LoadRecord", parent: Span) -> None:
        """Emit the ``model.unload`` and ``model.load`` spans of a switch under ``parent``, the
        batch span that paid for it (the load ran just before that batch began)."""
        ctx = trace.set_span_in_context(parent)
        for name, start_ns, end_ns in record.unloads:
            span = self.tracer.start_span("model.unload", context=ctx, start_time=start_ns, attributes={"jetbatch.model": name})
            span.set_attribute("jetbatch.model.unload.seconds", (end_ns - start_ns) / 1e9)
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
        with self.tracer.start_as_current_span(
            f"process {model}", kind=SpanKind.CONSUMER, links=links_from_headers(headers_list), attributes=attrs,
            start_time=start_ns,
        ) as span:
            yield span
        self.batch_size.record(len(headers_list), {"jetbatch.model": model})
        for w in waits_ms:
            self.queue_wait.record(w / 1000.0, {"jetbatch.model": model})

    @contextlib.contextmanager
    def child_span(self, name: str, **attributes: Any) -> Iterator[Span]:
        with self.tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def mark_error(self, span: Span, exc: BaseException) -> None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))

    @staticmethod
    def trace_id_hex(span: Span) -> str:
        ctx = span.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else ""
