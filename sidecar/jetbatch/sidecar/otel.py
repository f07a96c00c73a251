"""OpenTelemetry SDK setup for the sidecars, from the standard ``OTEL_*`` environment variables.

- ``OTEL_SERVICE_NAME`` (default ``jetbatch-<role>``), ``OTEL_RESOURCE_ATTRIBUTES``;
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
  ``..._METRICS_ENDPOINT``: export over OTLP HTTP/protobuf; nothing is exported by default;
- ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: comma-separated ``otlp`` (default when an
  endpoint is set), ``console``, ``prometheus`` (metrics only) or ``none``;
  ``OTEL_METRIC_EXPORT_INTERVAL`` (ms, default 5000);
- the sidecar's HTTP ``/metrics`` endpoint (on unless ``[http]`` turns it off) installs the
  OpenTelemetry Prometheus reader whatever ``OTEL_METRICS_EXPORTER`` says;
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: read by the SDK itself;
- ``--trace-console``: print spans to stdout for local debugging.

Resource attributes name the sidecar role (``jetbatch.role``) and the worker id
(``service.instance.id``). Credentials never reach spans: only subjects, ids and sizes do.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from typing import Callable

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

from .config import ConfigError

__all__ = ["PrivateIdGenerator", "setup_telemetry"]

log = logging.getLogger(__name__)


class PrivateIdGenerator(RandomIdGenerator):
    """Random trace and span ids from a private generator: the SDK's default draws from the
    global ``random`` module, which belongs to the application (a sidecar embedded in a process,
    a test run by Hypothesis, a seeded simulation would see its sequence disturbed)."""

    def __init__(self) -> None:
        self._rng = random.Random()

    def generate_span_id(self) -> int:
        span_id = self._rng.getrandbits(64)
        while span_id == trace.INVALID_SPAN_ID:
            span_id = self._rng.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = self._rng.getrandbits(128)
        while trace_id == trace.INVALID_TRACE_ID:
            trace_id = self._rng.getrandbits(128)
        return trace_id


_KNOWN_EXPORTERS = frozenset({"otlp", "console", "prometheus", "none"})


def _exporter_choices(kind: str) -> set[str]:
    """The exporters asked for ``traces``/``metrics``: a subset of ``otlp``/``console``, empty for
    none. ``OTEL_<KIND>_EXPORTER`` is a comma-separated list (the spec's form); without it, OTLP
    when an endpoint is set, else nothing."""
    explicit = os.environ.get(f"OTEL_{kind.upper()}_EXPORTER", "").strip().lower()
    if explicit:
        names = {n.strip() for n in explicit.split(",") if n.strip()}
        for unknown in sorted(names - _KNOWN_EXPORTERS):
            # zipkin, prometheus...: not bundled. Say so once at start-up instead of exporting nothing silently.
            log.warning("OTEL_%s_EXPORTER=%s: exporter not supported by jetbatch (otlp, console, prometheus, none); ignored", kind.upper(), unknown)
        return names & ({"otlp", "console", "prometheus"} if kind == "metrics" else {"otlp", "console"})
    endpoint = os.environ.get(f"OTEL_EXPORTER_OTLP_{kind.upper()}_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return {"otlp"} if endpoint else set()


def _check_protocol() -> None:
    """Only OTLP over HTTP/protobuf is bundled (gRPC would add grpcio to every sidecar image).
    Another protocol asked for is refused at start, in one line: exporting HTTP to a gRPC port
    (4317) would fail on every export, with a warning every few seconds and no spans."""
    for var in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"):
        value = os.environ.get(var, "").strip().lower()
        if value and value != "http/protobuf":
            raise ConfigError(
                f"environment {var}={value}: jetbatch exports OTLP over http/protobuf only; set it to http/protobuf "
                "(or unset it) and point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's HTTP port (4318 by default)"
            )


def _metric_interval_ms() -> float:
    """Metric export period: ``OTEL_METRIC_EXPORT_INTERVAL`` (ms) when set, else 5 s (the SDK's
    own default, 60 s, is too slow to watch a backlog gauge move)."""
    raw = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
    try:
        return float(raw) if raw else 5000.0
    except ValueError:
        log.warning("OTEL_METRIC_EXPORT_INTERVAL=%r is not a number of milliseconds; using 5000", raw)
        return 5000.0


def setup_telemetry(role: str, *, console: bool = False, worker_id: str | None = None, prometheus: bool = False) -> Callable[[], None]:
    """Install global tracer and meter providers for a sidecar ``role`` (``worker``,
    ``classifier``); ``console`` adds a stdout span exporter (``--trace-console``); ``worker_id``
    becomes ``service.instance.id``; ``prometheus`` installs the Prometheus reader that the HTTP
    ``/metrics`` endpoint renders. Returns a function that flushes and shuts the providers down
    (call it on exit: spans still batched would be lost). Installs nothing, so that the API stays
    a no-op on the hot path, when nothing is to be exported."""
    traces = _exporter_choices("traces")
    if console:
        traces.add("console")
    metric_exporters = _exporter_choices("metrics")
    if prometheus:
        metric_exporters.add("prometheus")
    if not traces and not metric_exporters:
        return lambda: None
    if "otlp" in traces or "otlp" in metric_exporters:
        _check_protocol()
    resource = Resource.create(
        {
            "service.name": os.environ.get("OTEL_SERVICE_NAME", f"jetbatch-{role}"),
            "service.instance.id": worker_id or f"{socket.gethostname()}-{os.getpid()}",
            "jetbatch.role": role,
        }
    )
    shutdowns: list[Callable[[], object]] = []
    if traces:
        provider = TracerProvider(resource=resource, id_generator=PrivateIdGenerator())  # sampler from OTEL_TRACES_SAMPLER(_ARG)
        if "console" in traces:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        if "otlp" in traces:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # Batched off the event loop's thread; endpoint, headers and timeout from OTEL_EXPORTER_OTLP_*.
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        shutdowns.append(provider.shutdown)
    if metric_exporters:
        readers: list[MetricReader] = []
        interval_ms = _metric_interval_ms()
        if "console" in metric_exporters:
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=interval_ms))
        if "otlp" in metric_exporters:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=interval_ms))
        if "prometheus" in metric_exporters:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            # Registers a collector with prometheus_client's registry; scraped through /metrics.
            # Without the otel_scope_* labels: every series here has one scope (jetbatch), and
            # three constant labels on each only cost the scraper.
            try:
                readers.append(PrometheusMetricReader(scope_info_enabled=False))
            except TypeError:  # an exporter from before the option: the labels stay
                readers.append(PrometheusMetricReader())
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
