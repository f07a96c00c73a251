"""Tracing and metrics for the sidecars (OpenTelemetry).

A batch is one ``CONSUMER`` span named ``process <model>`` with a link to each request's producer
span (the OpenTelemetry messaging conventions for batch receive), child spans for model load,
unload and inference, and attributes for the batch's size, queue wait and scheduler decision.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

__all__ = ["WorkerTelemetry", "links_from_headers", "tracing_enabled"]

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
    ) -> Iterator[Span]:
        """The span of one batch, linked to every request in it."""
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
            f"process {model}", kind=SpanKind.CONSUMER, links=links_from_headers(headers_list), attributes=attrs
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
