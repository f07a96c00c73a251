"""Producer-side tracing and metrics, on the OpenTelemetry API only.

Everything here is a no-op unless the application installs an OpenTelemetry SDK: the SDK package
depends on ``opentelemetry-api`` alone.
"""

from __future__ import annotations

from typing import Any, MutableMapping

from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

__all__ = ["end_producer_span", "record_error", "start_producer_span"]

_INSTRUMENTATION = "jetbatch.sdk"
# A proxy that binds to the real tracer once an SDK provider is installed, even if that happens
# after this import. Asking the provider for a tracer per request would cost ~8 µs each (the SDK
# builds a Tracer and an InstrumentationScope every time), a third of the producer span's cost.
_tracer = trace.get_tracer(_INSTRUMENTATION)
_meter = metrics.get_meter(_INSTRUMENTATION)
_latency = _meter.create_histogram(
    "jetbatch.client.request.duration",
    unit="s",
    description="End-to-end latency seen by the producer",
    # Seconds: the SDK's default boundaries (0, 5, 10, ...) would put every answer in one bucket.
    explicit_bucket_boundaries_advisory=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)


def start_producer_span(
    subject: str, request_id: str, model: str | None, headers: MutableMapping[str, str], body_size: int
) -> Span:
    """Start the PRODUCER span of one request and inject its W3C context (``traceparent``,
    ``tracestate``) into ``headers``, which become the NATS message headers. ``body_size`` is in
    bytes. A no-op span (and no header) unless an OpenTelemetry SDK is installed."""
    span = _tracer.start_span(
        f"{subject} publish",
        kind=SpanKind.PRODUCER,
        attributes={
            "messaging.system": "nats",
            "messaging.operation.type": "publish",
            "messaging.destination.name": subject,
            "messaging.message.id": request_id,
            "messaging.message.body.size": body_size,
            "jetbatch.model": model or "",
        },
    )
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return span


def record_error(span: Span, exc: BaseException) -> None:
    """Mark the producer span failed: an ``exception`` event and ERROR status."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc)))


def end_producer_span(span: Span | None, model: str | None, status: str, latency_s: float) -> None:
    """End the producer span with the request's outcome (``ok`` or an error code) and record its
    end-to-end latency (seconds, publish to reply) in ``jetbatch.client.request.duration``."""
    if span is not None:
        span.set_attribute("jetbatch.status", status)
        span.end()
    attrs: dict[str, Any] = {"jetbatch.model": model or "", "jetbatch.status": status}
    _latency.record(latency_s, attributes=attrs)
