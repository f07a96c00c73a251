"""Producer-side tracing and metrics, on the OpenTelemetry API only.

Everything here is a no-op unless the application installs an OpenTelemetry SDK: the SDK package
depends on ``opentelemetry-api`` alone.
"""

from __future__ import annotations

from typing import Any, MutableMapping

from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

__all__ = ["end_producer_span", "end_send_span", "record_error", "start_producer_span", "start_send_span", "tracing"]

_INSTRUMENTATION = "jetbatch.sdk"
# A proxy that binds to the real tracer once an SDK provider is installed, even if that happens
# after this import. Asking the provider for a tracer per request would cost ~8 µs each (the SDK
# builds a Tracer and an InstrumentationScope every time), a third of the producer span's cost.
_tracer = trace.get_tracer(_INSTRUMENTATION)
try:  # the API's stand-in until an SDK provider is set; private, so fall back to "always record"
    from opentelemetry.metrics._internal import _ProxyMeterProvider as _PROXY_METER_PROVIDER
except ImportError:  # pragma: no cover - a future API without it
    _PROXY_METER_PROVIDER = type(None)
_meter = metrics.get_meter(_INSTRUMENTATION)
_latency = _meter.create_histogram(
    "jetbatch.client.request.duration",
    unit="s",
    description="End-to-end latency seen by the producer",
    # Seconds: the SDK's default boundaries (0, 5, 10, ...) would put every answer in one bucket.
    explicit_bucket_boundaries_advisory=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)


def tracing() -> bool:
    """Whether the application installed a tracer provider. Without one every span is a no-op,
    but building and propagating it still costs ~40 µs a request: the SDK skips it all."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def _measuring() -> bool:
    return not isinstance(metrics.get_meter_provider(), _PROXY_METER_PROVIDER)


def start_producer_span(
    subject: str, request_id: str, model: str | None, headers: MutableMapping[str, str], body_size: int
) -> Span | None:
    """Start the CLIENT span of one request, ``infer <model>`` (``infer`` when the classifier
    chooses), which lasts until its answer; :func:`start_send_span` opens the PRODUCER span of the
    publish under it. None unless an OpenTelemetry tracer provider is installed."""
    if not tracing():
        return None
    return _tracer.start_span(
        f"infer {model}" if model else "infer",
        kind=SpanKind.CLIENT,
        attributes={"jetbatch.model": model or "", "jetbatch.request.id": request_id, "messaging.message.body.size": body_size},
    )


def start_send_span(
    parent: Span | None, subject: str, request_id: str, headers: MutableMapping[str, str], body_size: int, server: tuple[str, int] | None
) -> Span | None:
    """The PRODUCER span of the publish, ``send <subject>`` per the OpenTelemetry messaging
    conventions (v1.37: ``messaging.operation.type=send``), ended at the JetStream PubAck. Its W3C
    context (``traceparent``, ``tracestate``) goes into ``headers``, so consumers link to it."""
    if parent is None:
        return None
    attributes: dict[str, Any] = {
        "messaging.system": "nats",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": subject,
        "messaging.message.id": request_id,
        "messaging.message.body.size": body_size,
    }
    if server is not None:
        attributes["server.address"], attributes["server.port"] = server
    span = _tracer.start_span(f"send {subject}", context=trace.set_span_in_context(parent), kind=SpanKind.PRODUCER, attributes=attributes)
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return span


def end_send_span(span: Span | None, error_type: str | None = None) -> None:
    if span is None:
        return
    if error_type is not None:
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def record_error(span: Span, exc: BaseException, error_type: str) -> None:
    """Mark the request's span failed: ``error.type`` (the error code, e.g. ``deadline_exceeded``,
    as the conventions ask for a low-cardinality class), an ``exception`` event, ERROR status."""
    span.set_attribute("error.type", error_type)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc)))


def end_producer_span(span: Span | None, model: str | None, status: str, latency_s: float) -> None:
    """End the request's span with its outcome (``ok`` or an error code) and record its
    end-to-end latency (seconds, publish to reply) in ``jetbatch.client.request.duration``."""
    if span is not None:
        span.set_attribute("jetbatch.status", status)
        span.end()
    if not _measuring():
        return
    attrs: dict[str, Any] = {"jetbatch.model": model or "", "jetbatch.status": status}
    if status != "ok":
        attrs["error.type"] = status
    _latency.record(latency_s, attributes=attrs)
