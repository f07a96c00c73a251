"""OpenTelemetry SDK setup for the sidecars, from the standard ``OTEL_*`` environment variables.

- ``OTEL_SERVICE_NAME`` (default ``jetbatch-<role>``), ``OTEL_RESOURCE_ATTRIBUTES``;
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
  ``..._METRICS_ENDPOINT``: export over OTLP HTTP/protobuf; nothing is exported by default;
- ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: ``otlp`` (default when an endpoint is
  set), ``console``, or ``none``;
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: read by the SDK itself;
- ``--trace-console``: print spans to stdout for local debugging.

Resource attributes name the sidecar role (``jetbatch.role``) and the worker id
(``service.instance.id``). Credentials never reach spans: only subjects, ids and sizes do.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

__all__ = ["setup_telemetry"]


def _exporter_choice(kind: str) -> str:
    """``otlp``, ``console`` or ``none`` for ``traces``/``metrics``, from the environment."""
    explicit = os.environ.get(f"OTEL_{kind.upper()}_EXPORTER", "").strip().lower()
    if explicit:
        return explicit.split(",")[0]
    endpoint = os.environ.get(f"OTEL_EXPORTER_OTLP_{kind.upper()}_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return "otlp" if endpoint else "none"


def setup_telemetry(role: str, *, console: bool = False, worker_id: str | None = None) -> Callable[[], None]:
    """Install tracer and meter providers for a sidecar; returns a function that flushes and
    shuts them down (call it on exit). Does nothing when nothing is to be exported."""
    traces = "console" if console else _exporter_choice("traces")
    metrics_kind = _exporter_choice("metrics")
    if traces == "none" and metrics_kind == "none":
        return lambda: None
    resource = Resource.create(
        {
            "service.name": os.environ.get("OTEL_SERVICE_NAME", f"jetbatch-{role}"),
            "service.instance.id": worker_id or f"{socket.gethostname()}-{os.getpid()}",
            "jetbatch.role": role,
        }
    )
    shutdowns: list[Callable[[], object]] = []
    if traces != "none":
        provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
        if traces == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif traces == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        shutdowns.append(provider.shutdown)
    if metrics_kind != "none":
        readers: list[MetricReader] = []
        if metrics_kind == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif metrics_kind == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=5000))
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(meter_provider)
        shutdowns.append(meter_provider.shutdown)

    def shutdown() -> None:
        for fn in shutdowns:
            try:
                fn()
            except Exception:  # noqa: BLE001 - an exporter failing at exit must not mask the exit status
                pass

    return shutdown
