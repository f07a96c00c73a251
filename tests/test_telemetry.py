"""Tracing and metrics: every batch span links back to every request's producer span."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import anyio
import msgspec
import nats
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from jetbatch import sdk
from jetbatch.sdk.protocol import Headers, Subjects
from jetbatch.sidecar.classifier.service import OTHER_MODEL_LABEL
from jetbatch.sidecar.config import ClassifierConfig, StreamsConfig, TenantsConfig
from jetbatch.sidecar.otel import PrivateIdGenerator
from jetbatch.sidecar.streams import ensure_streams
from tests.helpers import make_config, running_classifier, running_worker, sleep_model, wait_until
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.anyio


class Switchable(SpanExporter):
    """Forwards to ``target`` only while set (the global provider outlives a test)."""

    def __init__(self) -> None:
        self.target: SpanExporter | None = None

    def export(self, spans: Any) -> SpanExportResult:
        return self.target.export(spans) if self.target else SpanExportResult.SUCCESS


class Otel(NamedTuple):
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    extra: Switchable


@pytest.fixture(scope="session")
def _otel_providers() -> Iterator[Otel]:
    # OpenTelemetry's global providers can be set once per process: set them here, once per
    # session; tests clear the span exporter (``otel``) and compare metrics against a baseline.
    spans = InMemorySpanExporter()
    extra = Switchable()
    # Ids from a private generator, as the sidecars' own provider does: the default draws from the
    # global random module, which Hypothesis watches in the tests that share this process.
    provider = TracerProvider(id_generator=PrivateIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(spans))
    provider.add_span_processor(SimpleSpanProcessor(extra))
    reader = InMemoryMetricReader()
    trace.set_tracer_provider(provider)
    # No exemplars: their reservoir samples with the global random module (from the worker threads
    # of other tests in this process, while Hypothesis watches that module's state).
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader], exemplar_filter=AlwaysOffExemplarFilter()))
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another test module already installed a global tracer provider")
    yield Otel(spans, reader, extra)


@pytest.fixture
def otel(_otel_providers: Otel) -> Otel:
    _otel_providers.spans.clear()
    _otel_providers.extra.target = None
    return _otel_providers


def _points(reader: InMemoryMetricReader, name: str, **attrs: Any) -> list[Any]:
    """Data points of metric ``name`` whose attributes include ``attrs`` (dots spelled ``__``)."""
    want = {k.replace("__", "."): v for k, v in attrs.items()}
    data = reader.get_metrics_data()
    points = []
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    points.extend(p for p in m.data.data_points if all(p.attributes.get(k) == v for k, v in want.items()))
    return points


def _total(reader: InMemoryMetricReader, name: str, **attrs: Any) -> float:
    """Sum of a counter, or count of a histogram, over the matching points (cumulative)."""
    return sum(p.value if hasattr(p, "value") else p.count for p in _points(reader, name, **attrs))


async def test_batch_span_links_every_request_and_pays_the_load(otel: Otel, nats_url: str, prefix: str) -> None:
    spans, reader, _ = otel
    ok_before = _total(reader, "jetbatch.requests", jetbatch__model="m1", jetbatch__status="ok")
    loads_before = _total(reader, "jetbatch.model.loads", jetbatch__model="m1")
    batches_before = _total(reader, "jetbatch.batch.size", jetbatch__model="m1")
    config = make_config(prefix, {"m1": sleep_model(max_batch_size=8, max_delay_ms=100, options={"load_cost_s": 0.05, "batch_cost_s": 0.0, "item_cost_s": 0.0})})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            results = await asyncio.gather(*(client.infer_result(f"r{i}".encode(), model="m1", timeout=20) for i in range(6)))
        backlog = _points(reader, "jetbatch.queue.backlog", jetbatch__model="m1", jetbatch__worker__id=worker.worker_id)
        resident = _points(reader, "jetbatch.models.resident", jetbatch__worker__id=worker.worker_id)
    assert len({r.batch.batch_id for r in results}) == 1  # one batch of 6
    finished = spans.get_finished_spans()
    producers = [s for s in finished if s.kind is SpanKind.PRODUCER and s.attributes.get("messaging.destination.name") == f"{prefix}.model.m1"]
    batches = [s for s in finished if s.name == f"process {prefix}.model.m1"]
    assert len(producers) == 6 and len(batches) == 1
    # Messaging conventions (v1.37): "{operation} {destination}", operation type send/process,
    # the server on the send span, and the send span under the request's CLIENT span.
    clients = {s.context.span_id: s for s in finished if s.kind is SpanKind.CLIENT and s.name == "infer m1"}
    for p in producers:
        assert p.name == f"send {prefix}.model.m1"
        assert p.attributes["messaging.operation.type"] == "send" and p.attributes["messaging.operation.name"] == "send"
        assert p.attributes["server.address"] == "127.0.0.1" and isinstance(p.attributes["server.port"], int)
        assert p.parent is not None and p.parent.span_id in clients
        assert p.end_time <= clients[p.parent.span_id].end_time  # the publish ends at the PubAck, the request at its answer
    assert len(clients) == 6
    batch = batches[0]
    assert batch.attributes["messaging.operation.type"] == "process" and "error.type" not in batch.attributes
    assert batch.kind is SpanKind.CONSUMER
    assert batch.attributes["messaging.system"] == "nats"
    assert batch.attributes["messaging.destination.name"] == f"{prefix}.model.m1"
    assert batch.attributes["messaging.batch.message_count"] == 6
    assert batch.attributes["jetbatch.model.loaded"] is True
    assert batch.attributes["jetbatch.scheduler.decision"]
    assert 0 <= batch.attributes["jetbatch.queue.wait.min_ms"] <= batch.attributes["jetbatch.queue.wait.mean_ms"] <= batch.attributes["jetbatch.queue.wait.max_ms"]
    # Exactly one link per request, each to that request's producer span.
    assert len(batch.links) == 6
    assert sorted((link.context.trace_id, link.context.span_id) for link in batch.links) == sorted(
        (p.context.trace_id, p.context.span_id) for p in producers
    )
    # The reply names the batch's trace, so a caller can jump from a result to its batch.
    assert {r.batch.trace_id for r in results} == {format(batch.context.trace_id, "032x")}
    loads = [s for s in finished if s.name == "model.load"]
    assert len(loads) == 1 and loads[0].parent.span_id == batch.context.span_id
    assert loads[0].attributes["jetbatch.model"] == "m1" and loads[0].attributes["jetbatch.model.load.seconds"] >= 0.05
    assert batch.start_time <= loads[0].start_time <= loads[0].end_time <= batch.end_time
    assert [s.name for s in finished if s.parent and s.parent.span_id == batch.context.span_id] == ["model.load", "infer"]
    # Metrics: 6 requests ok, one load, one batch; gauges read the live worker.
    assert _total(reader, "jetbatch.requests", jetbatch__model="m1", jetbatch__status="ok") - ok_before == 6
    assert _total(reader, "jetbatch.model.loads", jetbatch__model="m1") - loads_before == 1
    assert _total(reader, "jetbatch.batch.size", jetbatch__model="m1") - batches_before == 1
    assert [p.value for p in backlog] == [0] and [p.value for p in resident] == [1]
    latency = _points(reader, "jetbatch.client.request.duration", jetbatch__model="m1", jetbatch__status="ok")
    assert latency and latency[0].count >= 6


async def test_switch_spans_sit_under_the_batch_that_paid_it(otel: Otel, nats_url: str, prefix: str) -> None:
    spans, reader, _ = otel
    evictions_before = _total(reader, "jetbatch.model.evictions", jetbatch__model="a")
    switches_before = _total(reader, "jetbatch.scheduler.switches")
    unloads_before = _total(reader, "jetbatch.model.unload.duration", jetbatch__model="a")
    fast = {"load_cost_s": 0.02, "batch_cost_s": 0.0, "item_cost_s": 0.0}
    config = make_config(
        prefix,
        {"a": sleep_model(memory_bytes=600, options=fast), "b": sleep_model(memory_bytes=600, options=fast)},
        worker={"memory_budget_bytes": 1000},
    )
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"1", model="a", timeout=20)
            await client.infer(b"2", model="b", timeout=20)  # evicts a: one model fits the budget
        memory = {
            kind: [p.value for p in _points(reader, f"jetbatch.memory.{kind}", jetbatch__worker__id=worker.worker_id)] for kind in ("used", "budget")
        }
    finished = spans.get_finished_spans()
    batch_b = next(s for s in finished if s.name == f"process {prefix}.model.b")
    children = [s for s in finished if s.parent and s.parent.span_id == batch_b.context.span_id]
    assert [s.name for s in children] == ["model.unload", "model.load", "infer"]
    unload, load = children[0], children[1]
    assert unload.attributes["jetbatch.model"] == "a" and unload.attributes["jetbatch.model.bytes"] == 600
    assert unload.attributes["jetbatch.model.unload.seconds"] >= 0
    assert load.attributes["jetbatch.model"] == "b" and load.attributes["jetbatch.model.evicted"] == ("a",)
    assert unload.end_time <= load.start_time  # the switch: unload a, then load b, both before b's infer
    assert batch_b.attributes["jetbatch.model.loaded"] is True
    assert _total(reader, "jetbatch.model.evictions", jetbatch__model="a") - evictions_before == 1
    assert _total(reader, "jetbatch.scheduler.switches") - switches_before == 2  # load a, then switch to b
    assert _total(reader, "jetbatch.model.unload.duration", jetbatch__model="a") - unloads_before == 1
    assert memory == {"used": [600], "budget": [1000]}


async def test_error_reply_sets_span_status_and_records_the_exception(otel: Otel, nats_url: str, prefix: str) -> None:
    spans, reader, _ = otel
    failed_before = _total(reader, "jetbatch.requests", jetbatch__model="m1", jetbatch__status="model_failed")
    model = sleep_model(max_delay_ms=100, options={"load_cost_s": 0, "batch_cost_s": 0, "item_cost_s": 0, "fail_on": "poison"})
    config = make_config(prefix, {"m1": model})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            outcome = await asyncio.gather(client.infer(b"ok", model="m1", timeout=10), client.infer(b"poison", model="m1", timeout=10), return_exceptions=True)
    assert outcome[0] == b"ok" and isinstance(outcome[1], sdk.ModelFailed)
    failed = [s for s in spans.get_finished_spans() if s.name == f"process {prefix}.model.m1" and s.status.status_code is StatusCode.ERROR]
    assert len(failed) == 1
    assert any(e.name == "exception" and "poison" in str(e.attributes.get("exception.message")) for e in failed[0].events)
    assert any(e.name == "request.error" and e.attributes["jetbatch.error.code"] == "model_failed" for e in failed[0].events)
    assert failed[0].attributes["error.type"] == "model_failed"
    # The request's CLIENT span fails with error.type; its publish (the send span) did not fail.
    client_errors = [s for s in spans.get_finished_spans() if s.kind is SpanKind.CLIENT and s.status.status_code is StatusCode.ERROR]
    assert len(client_errors) == 1
    assert client_errors[0].attributes["jetbatch.status"] == "model_failed" and client_errors[0].attributes["error.type"] == "model_failed"
    assert not [s for s in spans.get_finished_spans() if s.kind is SpanKind.PRODUCER and s.status.status_code is StatusCode.ERROR]
    assert _total(reader, "jetbatch.requests", jetbatch__model="m1", jetbatch__status="model_failed") - failed_before == 1


def _setup_in_child(env: dict[str, str]) -> str:
    """Run ``setup_telemetry`` in a fresh interpreter (global providers are per process) and
    return what it printed: the provider installed, then one span from the console exporter."""
    code = (
        "from jetbatch.sidecar.otel import setup_telemetry\n"
        "from opentelemetry import trace\n"
        "shutdown = setup_telemetry('worker', worker_id='w-7')\n"
        "print(type(trace.get_tracer_provider()).__name__, flush=True)\n"
        "trace.get_tracer('t').start_span('hello').end()\n"
        "shutdown()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def test_setup_exports_nothing_by_default_and_names_the_sidecar() -> None:
    assert _setup_in_child({}).split()[0] == "ProxyTracerProvider"  # nothing installed: API no-ops
    printed = _setup_in_child({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "svc-x"})
    assert printed.split()[0] == "TracerProvider"
    span = json.loads(printed[printed.index("{"):])
    assert span["name"] == "hello"
    assert span["resource"]["attributes"] == {**span["resource"]["attributes"], "service.name": "svc-x", "service.instance.id": "w-7", "jetbatch.role": "worker"}


def test_sdk_traces_on_the_api_alone() -> None:
    """The producer SDK needs ``opentelemetry-api`` only: importing it loads no SDK module."""
    code = "import sys, sdk; print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
async def test_spans_reach_a_real_otlp_receiver_end_to_end(otel: Otel, nats_url: str, prefix: str, tmp_path: Path) -> None:
    """SDK (this process), classifier and worker (real processes) export over OTLP/HTTP to a
    receiver on loopback; a request's trace is reachable from its batch span's links."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    _, _, extra = otel
    cfg = tmp_path / "up.toml"
    cfg.write_text(
        f'[nats]\nprefix = "{prefix}"\n[models.m1]\nhandler = "identity"\nmax_delay_ms = 20\n'
        '[classifier]\nrouter = "rules"\ndefault_model = "m1"\n'
    )
    from jetbatch.sidecar.dev.deployment import Deployment

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
                    # Every request's producer span linked from an exported batch span (the worker
                    # exports every 200 ms), and the classifier heard from: no reliance on the
                    # flush at shutdown, which a loaded host can cut short.
                    spans = receiver.snapshot()
                    sent = {bytes(s.span_id) for _, s in spans if s.kind == s.SPAN_KIND_PRODUCER and s.name == f"send {prefix}.in"}
                    linked = {bytes(link.span_id) for svc, s in spans if svc == "jetbatch-worker" for link in s.links}
                    return len(sent) == 4 and sent <= linked and any(svc == "jetbatch-classifier" for svc, _ in spans)

                await wait_until(have_all, timeout_s=30, what="every request linked from the worker's exported batch spans")
            finally:
                await anyio.to_thread.run_sync(dep.stop)  # SIGTERM flushes the sidecars' exporters
        finally:
            extra.target = None
        # The SDK's own spans were exported synchronously by the SimpleSpanProcessor.
        got = receiver.snapshot()
    services = {svc for svc, _ in got}
    assert {"jetbatch-worker", "jetbatch-classifier"} <= services
    producer = {bytes(s.span_id): s for svc, s in got if s.kind == s.SPAN_KIND_PRODUCER and s.name == f"send {prefix}.in"}
    assert len(producer) == 4
    batch_spans = [s for svc, s in got if svc == "jetbatch-worker" and s.name == f"process {prefix}.model.m1"]
    linked = {bytes(link.span_id) for s in batch_spans for link in s.links}
    assert set(producer) <= linked  # every request's producer span is linked from its batch
    traces = {bytes(link.trace_id) for s in batch_spans for link in s.links}
    assert {bytes(s.trace_id) for s in producer.values()} <= traces
    classifier_spans = [s for svc, s in got if svc == "jetbatch-classifier"]
    assert {bytes(link.span_id) for s in classifier_spans for link in s.links} >= set(producer)
    assert {r.batch.trace_id for r in results} <= {bytes(s.trace_id).hex() for s in batch_spans}


def test_span_ids_leave_the_global_random_module_alone() -> None:
    """The sidecars' tracer provider draws ids from its own generator: an application's seeded
    `random` sequence (or Hypothesis watching it) is not disturbed by tracing."""
    import random

    random.seed(7)
    state = random.getstate()
    ids = PrivateIdGenerator()
    spans = {ids.generate_span_id() for _ in range(1000)}
    traces = {ids.generate_trace_id() for _ in range(1000)}
    assert random.getstate() == state
    assert len(spans) == 1000 and len(traces) == 1000 and 0 not in spans and 0 not in traces


_HEX = "0123456789abcdef"


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.tuples(st.sampled_from(["00", "00", "01", "ff"]) | st.text(_HEX, min_size=2, max_size=2), st.text(_HEX, min_size=32, max_size=32), st.text(_HEX, min_size=16, max_size=16),
                  st.text(_HEX, min_size=2, max_size=2)).map("-".join),
        st.text(_HEX + "-_+ xABF", max_size=60),
    ),
    st.one_of(st.none(), st.just("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"), st.text(max_size=30)),
)  # fmt: skip
def test_links_read_traceparent_exactly_as_the_propagator_does(_otel_providers: Otel, traceparent: str, tracestate: str | None) -> None:
    """The batch span's links parse ``traceparent`` directly (a third of the propagator's cost);
    whatever the header holds, the link is the propagator's span context or there is none."""
    from opentelemetry import propagate

    from jetbatch.sidecar.telemetry import links_from_headers

    headers = {"traceparent": traceparent} if tracestate is None else {"traceparent": traceparent, "tracestate": tracestate}
    expected = trace.get_current_span(propagate.extract(headers)).get_span_context()
    links = links_from_headers([headers])
    if expected.is_valid:
        assert len(links) == 1 and links[0].context == expected and links[0].context.trace_state == expected.trace_state
    else:
        assert links == []


def test_an_unsampled_batch_span_reads_no_request_context(_otel_providers: Otel) -> None:
    """Links are added once the batch span is known to be recorded: an unsampled batch (10%
    sampling drops nine in ten) does no per-request tracing work at all."""
    from jetbatch.sidecar.telemetry import link_requests

    class Untouchable(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            raise AssertionError("an unsampled span read the requests' headers")

    link_requests(trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT), Untouchable([{"traceparent": "x"}]))
    tracer = trace.get_tracer("test")
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with tracer.start_as_current_span("process batch") as span:
        link_requests(span, [{"traceparent": traceparent}, None, {}])
    assert [link.context.span_id for link in span.links] == [0x00F067AA0BA902B7]


async def test_one_worker_of_a_deployment_reports_the_backlog(otel: Otel, nats_url: str, prefix: str) -> None:
    """Every worker counts every queue; the gauge carries them from one worker (the lowest id it
    sees alive), so a sum over workers is the stream's backlog, not a multiple of it."""
    _, reader, _ = otel
    # One request a batch, 0.3 s each: six requests keep m1's queue non-empty for a while.
    models = {"m1": sleep_model(max_batch_size=1, options={"load_cost_s": 0.0, "batch_cost_s": 0.3, "item_cost_s": 0.0})}
    a = make_config(prefix, models, worker={"id": "w-a", "heartbeat_s": 0.2})
    b = make_config(prefix, models, worker={"id": "w-b", "heartbeat_s": 0.2})
    async with running_worker(a, nats_url) as wa, running_worker(b, nats_url) as wb:
        await wait_until(
            lambda: bool(wa.peers.cluster and "w-b" in wa.peers.cluster.peers() and wb.peers.cluster and "w-a" in wb.peers.cluster.peers()),
            timeout_s=20, what="the two workers see each other",
        )  # fmt: skip
        assert wa.peers.reports_queues() and not wb.peers.reports_queues()
        async with sdk.Client.connect(nats_url, prefix=prefix) as client, anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(functools.partial(client.infer, f"x{i}".encode(), model="m1", timeout=30))
            await wait_until(lambda: "m1" in wa.report().backlog and "m1" in wb.report().backlog, timeout_s=20, what="both count m1's queue")
            points = _points(reader, "jetbatch.queue.backlog", jetbatch__model="m1")
        reporters = {p.attributes["jetbatch.worker.id"] for p in points if p.attributes["jetbatch.worker.id"] in ("w-a", "w-b")}
        assert reporters == {"w-a"}
    # Resident models and memory are each worker's own: both report them.
    assert {p.attributes["jetbatch.worker.id"] for p in _points(reader, "jetbatch.memory.used")} >= {"w-a", "w-b"}


async def test_the_classifier_reports_what_it_routed(otel: Otel, nats_url: str, prefix: str) -> None:
    _, reader, _ = otel
    config = make_config(prefix, {"m1": sleep_model()}, classifier={"router": "rules", "default_model": "m1"})
    before = _total(reader, "jetbatch.classifier.requests", jetbatch__model="m1", jetbatch__status="ok")
    batches_before = _total(reader, "jetbatch.classifier.batch.size")
    async with running_worker(config, nats_url), running_classifier(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            for i in range(3):
                assert await client.infer(f"r{i}".encode(), timeout=20) == f"r{i}".encode()
    assert _total(reader, "jetbatch.classifier.requests", jetbatch__model="m1", jetbatch__status="ok") - before == 3
    assert _total(reader, "jetbatch.classifier.batch.size") - batches_before >= 1


async def test_the_classifier_names_only_models_a_queue_took(otel: Otel, nats_url: str, prefix: str) -> None:
    """A producer's ``Jetbatch-Model`` is any token: counted under its own name, each made a
    series, and an attack filled the 2 000 the SDK allows (then legitimate traffic went to the
    overflow series, and /metrics took 30-55 ms to render on the classifier's loop). A name no
    queue took is counted as ``_other``; a served model keeps its own series."""
    _, reader, _ = otel
    config = make_config(prefix, {"m1": sleep_model()}, classifier={"router": "rules", "default_model": "m1"})
    before = _total(reader, "jetbatch.classifier.requests", jetbatch__model=OTHER_MODEL_LABEL, jetbatch__status="unknown_model")
    async with running_worker(config, nats_url), running_classifier(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            for i in range(5):
                with pytest.raises(sdk.UnknownModel):
                    await client.infer(b"x", timeout=20, headers={Headers.MODEL: f"hostile-{uuid.uuid4().hex}"})
            assert await client.infer(b"ok", timeout=20) == b"ok"
    assert _total(reader, "jetbatch.classifier.requests", jetbatch__model=OTHER_MODEL_LABEL, jetbatch__status="unknown_model") - before == 5
    assert not [p for p in _points(reader, "jetbatch.classifier.requests") if p.attributes.get("jetbatch.model", "").startswith("hostile-")]
    assert _points(reader, "jetbatch.classifier.requests", jetbatch__model="m1", jetbatch__status="ok")


async def test_the_backlog_gauge_shows_queues_of_models_the_reporter_does_not_serve(otel: Otel, nats_url: str, prefix: str) -> None:
    """Found in a day of use: 450 requests waited for three models, and no ``/metrics`` showed
    them (``jetbatch status`` did): the deployment's one reporter served none of those models and
    the gauge read only its own. Its stream count has every queue; the gauge now carries them."""
    _, reader, _ = otel
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, subjects, StreamsConfig(), ["m1", "x1", "x2"])  # as a worker serving x1 and x2 left them
        for i in range(5):
            await js.publish(subjects.model("x1"), f"a{i}".encode())
        for i in range(3):
            await js.publish(subjects.model("x2", "batch"), f"b{i}".encode())
        config = make_config(prefix, {"m1": sleep_model()}, worker={"id": "w-alone", "orphan_grace_s": None})
        async with running_worker(config, nats_url) as worker:
            await wait_until(lambda: worker.queues.unregistered == {"x1": 5, "x2": 3}, timeout_s=20, what="the worker counts x1 and x2")
            points = _points(reader, "jetbatch.queue.backlog", jetbatch__worker__id="w-alone")
            assert {p.attributes["jetbatch.model"]: p.value for p in points if p.value} == {"x1": 5, "x2": 3}
    finally:
        await nc.close()


def test_the_backlog_gauge_bounds_the_models_it_names() -> None:
    """Any producer can store requests under any model name: past the cap, the smallest queues
    of unregistered models are summed under ``_other``, so the series stay bounded and a sum is
    still the backlog."""
    from types import SimpleNamespace

    from jetbatch.sidecar.telemetry import MAX_UNREGISTERED_BACKLOG_SERIES, _Gauges

    gauges = _Gauges()
    queues = SimpleNamespace(unregistered={f"u{i}": i + 1 for i in range(MAX_UNREGISTERED_BACKLOG_SERIES + 10)})
    gauges._stored["w"] = lambda: queues
    named = gauges._unregistered("w", exclude={"u0": 1})
    assert len(named) == MAX_UNREGISTERED_BACKLOG_SERIES + 1 and "u0" not in named
    assert named["_other"] == sum(range(2, 11)) and sum(named.values()) == sum(queues.unregistered.values()) - 1


async def test_requests_and_device_seconds_are_counted_by_tenant_with_a_bounded_label_set(otel: Otel, nats_url: str, prefix: str) -> None:
    """Through the classifier, each tenant's requests are counted at admission and answered, and
    the device seconds that served them; past ``tenants.metric_tenants`` names, ``_other``."""
    _, reader, _ = otel
    config = make_config(prefix, {"m1": sleep_model(max_batch_size=8, options={"load_cost_s": 0.0, "batch_cost_s": 0.01, "item_cost_s": 0.0})})
    config = msgspec.structs.replace(
        config,
        classifier=ClassifierConfig(router="rules", default_model="m1", max_delay_ms=5),
        tenants=TenantsConfig(metric_tenants=1),
    )
    # Unique tenant names per run: the metrics are process-wide and cumulative.
    first, second = f"t{uuid.uuid4().hex[:8]}", f"u{uuid.uuid4().hex[:8]}"
    other_before = _total(reader, "jetbatch.tenant.requests", jetbatch__tenant="_other", jetbatch__status="ok")
    async with running_worker(config, nats_url), running_classifier(config, nats_url):
        for tenant in (first, second):
            async with sdk.Client.connect(nats_url, prefix=prefix, tenant=tenant) as client:
                await asyncio.gather(*(client.infer(b"x", timeout=20) for _ in range(3)))
    assert _total(reader, "jetbatch.tenant.requests", jetbatch__tenant=first, jetbatch__status="ok") == 3
    assert _total(reader, "jetbatch.tenant.requests", jetbatch__tenant="_other", jetbatch__status="ok") - other_before == 3
    assert _total(reader, "jetbatch.tenant.requests", jetbatch__tenant=second) == 0  # never named: one label allowed
    assert _total(reader, "jetbatch.tenant.service.duration", jetbatch__tenant=first) >= 0.01  # at least one 10 ms batch
    assert _total(reader, "jetbatch.classifier.tenant.requests", jetbatch__tenant=first, jetbatch__admission="admitted") == 3
