"""Tracing and metrics: every batch span links back to every request's producer span."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import sdk
from tests.helpers import make_config, running_worker, sleep_model, wait_until
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.anyio


class Switchable(SpanExporter):
    """Forwards to ``target`` only while set (the global provider outlives a test)."""

    def __init__(self) -> None:
        self.target: SpanExporter | None = None

    def export(self, spans: Any) -> SpanExportResult:
        return self.target.export(spans) if self.target else SpanExportResult.SUCCESS


@pytest.fixture(scope="module")
def otel() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader, Switchable]]:
    # OpenTelemetry's global providers can be set once per process: set them here, once.
    spans = InMemorySpanExporter()
    extra = Switchable()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    provider.add_span_processor(SimpleSpanProcessor(extra))
    reader = InMemoryMetricReader()
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another test already installed a global tracer provider")
    yield spans, reader, extra


def _metric_points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    points = []
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    points.extend(m.data.data_points)
    return points


async def test_batch_span_links_every_request_and_pays_the_load(otel: Any, nats_url: str, prefix: str) -> None:
    spans, reader, _ = otel
    spans.clear()
    config = make_config(prefix, {"m1": sleep_model(max_batch_size=8, max_delay_ms=100, options={"load_s": 0.05, "batch_s": 0.0, "item_s": 0.0})})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            results = await asyncio.gather(*(client.infer_result(f"r{i}".encode(), model="m1", timeout=20) for i in range(6)))
    assert len({r.batch.batch_id for r in results}) == 1  # one batch of 6
    finished = spans.get_finished_spans()
    producers = [s for s in finished if s.kind is SpanKind.PRODUCER and s.attributes.get("messaging.destination.name") == f"{prefix}.model.m1"]
    batches = [s for s in finished if s.name == "process m1"]
    assert len(producers) == 6 and len(batches) == 1
    batch = batches[0]
    assert batch.kind is SpanKind.CONSUMER
    assert batch.attributes["messaging.batch.message_count"] == 6
    assert batch.attributes["jetbatch.model.loaded"] is True
    assert {link.context.span_id for link in batch.links} == {p.context.span_id for p in producers}
    assert {link.context.trace_id for link in batch.links} == {p.context.trace_id for p in producers}
    # The reply names the batch's trace, so a caller can jump from a result to its batch.
    assert {r.batch.trace_id for r in results} == {format(batch.context.trace_id, "032x")}
    loads = [s for s in finished if s.name == "model.load"]
    assert len(loads) == 1 and loads[0].parent.span_id == batch.context.span_id
    assert loads[0].attributes["jetbatch.model"] == "m1"
    assert [s.name for s in finished if s.parent and s.parent.span_id == batch.context.span_id] == ["model.load", "infer"]
    # Metrics: 6 requests ok, one load, one batch of six.
    ok = [p for p in _metric_points(reader, "jetbatch.requests") if p.attributes.get("jetbatch.model") == "m1" and p.attributes.get("jetbatch.status") == "ok"]
    assert sum(p.value for p in ok) >= 6
    sizes = [p for p in _metric_points(reader, "jetbatch.batch.size") if p.attributes.get("jetbatch.model") == "m1"]
    assert sizes and sizes[0].count >= 1 and sizes[0].max >= 6
    backlog = _metric_points(reader, "jetbatch.queue.backlog")
    assert any(p.attributes.get("jetbatch.model") == "m1" for p in backlog)


async def test_error_reply_sets_span_status_and_records_the_exception(otel: Any, nats_url: str, prefix: str) -> None:
    spans, _, _ = otel
    spans.clear()
    model = sleep_model(max_delay_ms=100, options={"load_s": 0, "batch_s": 0, "item_s": 0, "fail_on": "poison"})
    config = make_config(prefix, {"m1": model})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            outcome = await asyncio.gather(client.infer(b"ok", model="m1", timeout=10), client.infer(b"poison", model="m1", timeout=10), return_exceptions=True)
    assert outcome[0] == b"ok" and isinstance(outcome[1], sdk.ModelFailed)
    failed = [s for s in spans.get_finished_spans() if s.name == "process m1" and s.status.status_code is StatusCode.ERROR]
    assert len(failed) == 1
    assert any(e.name == "exception" and "poison" in str(e.attributes.get("exception.message")) for e in failed[0].events)
    assert any(e.name == "request.error" and e.attributes["jetbatch.error.code"] == "model_failed" for e in failed[0].events)
    producer_errors = [s for s in spans.get_finished_spans() if s.kind is SpanKind.PRODUCER and s.status.status_code is StatusCode.ERROR]
    assert len(producer_errors) == 1


@pytest.mark.slow
async def test_spans_reach_a_real_otlp_receiver_end_to_end(otel: Any, nats_url: str, prefix: str, tmp_path: Path) -> None:
    """SDK (this process), classifier and worker (real processes) export over OTLP/HTTP to a
    receiver on loopback; a request's trace is reachable from its batch span's links."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    _, _, extra = otel
    cfg = tmp_path / "up.toml"
    cfg.write_text(
        f'[nats]\nprefix = "{prefix}"\n[models.m1]\nhandler = "identity"\nmax_delay_ms = 20\n'
        '[classifier]\nrouter = "rules"\ndefault_model = "m1"\n'
    )
    from sidecar.up import Deployment

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "200"}
        extra.target = OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")
        try:
            # Deployment blocks while it waits for readiness: start and stop it off the event loop.
            dep = await anyio.to_thread.run_sync(lambda: Deployment(cfg, nats_url=nats_url, extra_env=env).start())
            try:
                async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                    results = await asyncio.gather(*(client.infer_result({"i": i}, timeout=30) for i in range(4)))

                def have_all() -> bool:
                    services = {svc for svc, _ in receiver.snapshot()}
                    return {"jetbatch-worker", "jetbatch-classifier"} <= services

                await wait_until(have_all, timeout_s=30, what="spans from the worker and the classifier")
            finally:
                await anyio.to_thread.run_sync(dep.stop)  # SIGTERM flushes the sidecars' exporters
        finally:
            extra.target = None
        # The SDK's own spans were exported synchronously by the SimpleSpanProcessor.
        got = receiver.snapshot()
    services = {svc for svc, _ in got}
    assert {"jetbatch-worker", "jetbatch-classifier"} <= services
    producer = {bytes(s.span_id): s for svc, s in got if s.kind == s.SPAN_KIND_PRODUCER and s.name.startswith(f"{prefix}.in")}
    assert len(producer) == 4
    batch_spans = [s for svc, s in got if svc == "jetbatch-worker" and s.name == "process m1"]
    linked = {bytes(link.span_id) for s in batch_spans for link in s.links}
    assert set(producer) <= linked  # every request's producer span is linked from its batch
    traces = {bytes(link.trace_id) for s in batch_spans for link in s.links}
    assert {bytes(s.trace_id) for s in producer.values()} <= traces
    classifier_spans = [s for svc, s in got if svc == "jetbatch-classifier"]
    assert {bytes(link.span_id) for s in classifier_spans for link in s.links} >= set(producer)
    assert {r.batch.trace_id for r in results} <= {bytes(s.trace_id).hex() for s in batch_spans}
