"""Throughput with tracing on (100% sampling, OTLP/HTTP export to a receiver on loopback) against
tracing off, same workload (SDK → worker, identity handler), alternating in one run. Each round
runs in a fresh process, because OpenTelemetry's global providers can be set only once. Run:

    python -m bench.overhead.tracing [--requests 3000] [--rounds 3] [--sample-ratio 1.0] [--side both|worker]
    python -m bench.overhead.tracing --producer-span [--requests 20000]

``--sample-ratio`` below 1 samples that share of traces (``parentbased_traceidratio`` in the SDK and
the worker) to show what sampling buys back.

``--side worker`` toggles tracing in the worker process only: the producer always creates and
propagates its spans (a tracer provider whose spans go nowhere), so every batch span has its
links either way, and what changes is the worker's own tracing (batch span, links, infer span,
export). Besides throughput it reports the worker process's CPU time per request (from
``/proc``), the worker-bound throughput ratio that a shared, noisy machine blurs least.

``--producer-span`` measures the SDK's per-request span work alone: the CPU time of the
``infer``/``send`` spans, the context injection and the latency histogram, with no provider
installed (``none``), with a provider whose spans go nowhere (``silent``), and with a batch span
processor exporting OTLP/HTTP in its thread (``export``: process CPU, the exporter thread's
included); ``bare`` is one span without attributes started and ended, the OpenTelemetry SDK's floor.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parents[2]


def install_tracing(endpoint: str | None, sample_ratio: float = 1.0) -> object:
    """A global tracer provider exporting every span (parent-based always-on), or the
    ``sample_ratio`` share of traces."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    trace.set_tracer_provider(provider)
    return provider


def install_silent_tracing() -> object:
    """A tracer provider that samples and propagates every span and exports none."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    trace.set_tracer_provider(provider)
    return provider


async def one_round_processes(
    n: int, tracing: bool, endpoint: str | None, sample_ratio: float = 1.0, side: str = "both"
) -> tuple[float, float]:
    """The worker in its own process (as deployed), the SDK here; both traced or neither (or,
    with ``side="worker"``, the producer always propagating). Returns (req/s, worker CPU µs a
    request)."""
    import tempfile

    from jetbatch import sdk

    if side == "worker":
        provider = install_silent_tracing()
    else:
        provider = install_tracing(endpoint, sample_ratio) if tracing else None
    env = {"OTEL_TRACES_EXPORTER": "none"}
    if tracing:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint or "", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(sample_ratio),
        }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, harness.server() as server:
        cfg = harness.write_config({"models": {"m": {"handler": "identity", "max_batch_size": 64, "max_delay_ms": 2}}}, tmp, "m")
        with harness.processes(cfg, server.url, extra_env=env) as dep:
            async with sdk.Client.connect(dep.url) as client:
                await client.infer(b"warm", model="m", timeout=30)
                pid = dep.procs["worker0"].pid
                cpu_before = harness.cpu_s(pid)
                run = await harness.gather(lambda: client.infer(b"x" * 256, model="m", timeout=60), n, 64)
                cpu_us = (harness.cpu_s(pid) - cpu_before) / n * 1e6
    if provider is not None:
        provider.shutdown()  # type: ignore[attr-defined]
    return run.rate, cpu_us


def producer_span_cost(n: int, mode: str, endpoint: str | None) -> float:
    """CPU µs per request of the SDK's span work (what ``Client.infer`` calls around a publish)."""
    import time

    from jetbatch.sdk import telemetry

    provider = None
    if mode == "silent":
        provider = install_silent_tracing()
    elif mode == "export":
        provider = install_tracing(endpoint)
    server = ("127.0.0.1", 4222)
    if mode == "bare":
        # The floor: one span without attributes, started and ended, under a provider that exports nothing.
        from opentelemetry import trace

        provider = install_silent_tracing()
        tracer = trace.get_tracer("bench")
        started = time.process_time()
        for _ in range(n):
            tracer.start_span("x").end()
        return (time.process_time() - started) / n * 1e6
    started = time.process_time()
    for i in range(n):
        headers: dict[str, str] = {}
        span = telemetry.start_producer_span("jetbatch.model.m", f"r{i}", "m", headers, 256)
        send = telemetry.start_send_span(span, "jetbatch.model.m", f"r{i}", headers, 256, server)
        telemetry.end_send_span(send)
        telemetry.end_producer_span(span, "m", "ok", 0.01)
    cost = (time.process_time() - started) / n * 1e6
    if provider is not None:
        provider.shutdown()  # type: ignore[attr-defined]  # waits for the exporter thread's last batch
    return cost


async def one_round(n: int, tracing: bool, endpoint: str | None, sample_ratio: float = 1.0) -> float:
    from jetbatch import sdk

    provider = install_tracing(endpoint, sample_ratio) if tracing else None
    with harness.server() as server:
        cfg = harness.config({"models": {"m": {"handler": "identity", "max_batch_size": 64, "max_delay_ms": 2}}}, tag="tr")
        async with harness.in_process(cfg, server.url), sdk.Client.connect(server.url, prefix=cfg.nats.prefix) as client:
            await client.infer(b"warm", model="m", timeout=30)
            run = await harness.gather(lambda: client.infer(b"x" * 256, model="m", timeout=60), n, 64)
    if provider is not None:
        provider.shutdown()  # type: ignore[attr-defined]
    return run.rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--topology", choices=["processes", "one-process"], default="processes",
                        help="worker in its own process (default), or SDK and worker in one process")
    parser.add_argument("--sample-ratio", type=float, default=1.0, help="share of traces sampled when tracing is on (default 1.0)")
    parser.add_argument("--side", choices=["both", "worker"], default="both",
                        help="trace the SDK and the worker (default), or toggle the worker's tracing only (processes topology)")
    parser.add_argument("--producer-span", action="store_true", help="measure the SDK's span work per request, alone")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    if args.child:
        if args.producer_span:
            print(producer_span_cost(args.requests, args.child, args.endpoint))
        elif args.topology == "processes":
            print(*asyncio.run(one_round_processes(args.requests, args.child == "on", args.endpoint, args.sample_ratio, args.side)))
        else:
            print(asyncio.run(one_round(args.requests, args.child == "on", args.endpoint, args.sample_ratio)))
        return
    from tests.otlp_receiver import OtlpReceiver

    def child(mode: str, endpoint: str, *extra: str) -> list[float]:
        out = subprocess.run(
            [sys.executable, "-m", "bench.overhead.tracing", "--child", mode, "--requests", str(args.requests), "--endpoint", endpoint,
             "--topology", args.topology, "--sample-ratio", str(args.sample_ratio), "--side", args.side, *extra],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        return [float(x) for x in out.stdout.strip().splitlines()[-1].split()]

    if args.producer_span:
        costs: dict[str, list[float]] = {"none": [], "bare": [], "silent": [], "export": []}
        with OtlpReceiver() as receiver:
            for _ in range(args.rounds):
                for mode, bucket in costs.items():
                    bucket.append(child(mode, receiver.endpoint, "--producer-span")[0])
        harness.emit({
            "requests": args.requests, "cpu_us_per_request": {k: [round(x, 1) for x in v] for k, v in costs.items()},
            "median_us": {k: round(statistics.median(v), 1) for k, v in costs.items()},
        }, args.json)  # fmt: skip
        return

    off, on, off_cpu, on_cpu = [], [], [], []
    with OtlpReceiver() as receiver:
        for _ in range(args.rounds):
            for mode, bucket, cpu in (("off", off, off_cpu), ("on", on, on_cpu)):
                got = child(mode, receiver.endpoint)
                bucket.append(got[0])
                if len(got) > 1:
                    cpu.append(got[1])
        exported = len(receiver.snapshot())
    ratios = [a / b for a, b in zip(on, off)]
    summary: dict[str, object] = {
        "topology": args.topology, "side": args.side, "requests": args.requests, "sample_ratio": args.sample_ratio,
        "off_rps": [round(x) for x in off], "on_rps": [round(x) for x in on],
        "ratio_median": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios], "spans_exported": exported,
    }  # fmt: skip
    if off_cpu and on_cpu:
        cpu_ratios = [b / a for a, b in zip(on_cpu, off_cpu)]  # worker-bound throughput on ÷ off
        summary.update({
            "worker_cpu_us_per_request_off": [round(x, 1) for x in off_cpu], "worker_cpu_us_per_request_on": [round(x, 1) for x in on_cpu],
            "worker_bound_ratio_median": statistics.median(cpu_ratios), "worker_bound_ratios": [round(r, 3) for r in cpu_ratios],
        })  # fmt: skip
    harness.emit(summary, args.json)


if __name__ == "__main__":
    main()
