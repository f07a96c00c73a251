"""Throughput with tracing on (100% sampling, OTLP/HTTP export to a receiver on loopback) against
tracing off, same workload (SDK → worker, identity handler), alternating in one run. Each round
runs in a fresh process, because OpenTelemetry's global providers can be set only once. Run:

    python bench/tracing_overhead.py [--requests 3000] [--rounds 3] [--sample-ratio 1.0]

``--sample-ratio`` below 1 samples that share of traces (``parentbased_traceidratio`` in the SDK and
the worker) to show what sampling buys back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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


async def one_round_processes(n: int, tracing: bool, endpoint: str | None, sample_ratio: float = 1.0) -> float:
    """The worker in its own process (as deployed), the SDK here; both traced or neither."""
    import tempfile

    from jetbatch import sdk
    from jetbatch.sidecar.dev.deployment import Deployment

    provider = install_tracing(endpoint, sample_ratio) if tracing else None
    env = {"OTEL_TRACES_EXPORTER": "none"}
    if tracing:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint or "", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(sample_ratio),
        }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "m.toml"
        cfg.write_text('[models.m]\nhandler = "identity"\nmax_batch_size = 64\nmax_delay_ms = 2\n')
        with Deployment(cfg, extra_env=env) as dep:
            async with sdk.Client.connect(dep.url) as client:
                await client.infer(b"warm", model="m", timeout=30)
                gate = asyncio.Semaphore(64)

                async def one() -> None:
                    async with gate:
                        await client.infer(b"x" * 256, model="m", timeout=60)

                started = asyncio.get_running_loop().time()
                await asyncio.gather(*(one() for _ in range(n)))
                elapsed = asyncio.get_running_loop().time() - started
    if provider is not None:
        provider.shutdown()  # type: ignore[attr-defined]
    return n / elapsed


async def one_round(n: int, tracing: bool, endpoint: str | None, sample_ratio: float = 1.0) -> float:
    import uuid

    import anyio
    import msgspec

    from jetbatch import sdk
    from jetbatch.sidecar.config import Config
    from jetbatch.sidecar.dev.natsserver import EmbeddedNats
    from jetbatch.sidecar.transport import connect
    from jetbatch.sidecar.worker import Worker

    provider = install_tracing(endpoint, sample_ratio) if tracing else None
    with EmbeddedNats() as server:
        prefix = f"tr{uuid.uuid4().hex[:6]}"
        cfg = msgspec.convert(
            {"nats": {"prefix": prefix}, "models": {"m": {"handler": "identity", "max_batch_size": 64, "max_delay_ms": 2}}}, Config
        )
        nc = await connect(cfg.nats, server.url)
        worker = Worker(cfg, nc)
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            await worker.ready.wait()
            async with sdk.Client.connect(server.url, prefix=prefix) as client:
                await client.infer(b"warm", model="m", timeout=30)
                gate = asyncio.Semaphore(64)

                async def one() -> None:
                    async with gate:
                        await client.infer(b"x" * 256, model="m", timeout=60)

                started = asyncio.get_running_loop().time()
                await asyncio.gather(*(one() for _ in range(n)))
                elapsed = asyncio.get_running_loop().time() - started
            worker.stop()
        await nc.close()
    if provider is not None:
        provider.shutdown()  # type: ignore[attr-defined]
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--topology", choices=["processes", "one-process"], default="processes",
                        help="worker in its own process (default), or SDK and worker in one process")
    parser.add_argument("--sample-ratio", type=float, default=1.0, help="share of traces sampled when tracing is on (default 1.0)")
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fn = one_round_processes if args.topology == "processes" else one_round
        print(asyncio.run(fn(args.requests, args.child == "on", args.endpoint, args.sample_ratio)))
        return
    from tests.otlp_receiver import OtlpReceiver

    off, on = [], []
    with OtlpReceiver() as receiver:
        for _ in range(args.rounds):
            for mode, bucket in (("off", off), ("on", on)):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, "--requests", str(args.requests), "--endpoint", receiver.endpoint,
                     "--topology", args.topology, "--sample-ratio", str(args.sample_ratio)],
                    capture_output=True, text=True, check=True, cwd=ROOT,
                )  # fmt: skip
                bucket.append(float(out.stdout.strip().splitlines()[-1]))
        exported = len(receiver.snapshot())
    ratios = [a / b for a, b in zip(on, off)]
    print(json.dumps({
        "topology": args.topology, "requests": args.requests, "sample_ratio": args.sample_ratio, "off_rps": [round(x) for x in off], "on_rps": [round(x) for x in on],
        "ratio_median": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios], "spans_exported": exported,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
