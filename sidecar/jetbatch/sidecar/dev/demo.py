"""``jetbatch demo``: an embedded NATS server, the classifier and a worker with the example models,
and a mixed workload sent through the SDK. Prints one line per batch, as seen from the replies'
batch headers, and a summary table."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from jetbatch import sdk
from jetbatch.sdk.protocol import Tensor

from ..interrupts import run_interruptible
from ..percentiles import percentile

from .deployment import Deployment
from .example_models import build_examples, sample_inputs

__all__ = ["run_demo"]


def _percentile(values: list[float], q: float) -> float:
    return percentile(values, q / 100)


class _BatchPrinter:
    """Prints a batch once all of its replies have arrived (the batch size header tells how many)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.seen: dict[str, list[sdk.Result]] = defaultdict(list)
        self.printed: set[str] = set()

    def add(self, result: sdk.Result) -> None:
        b = result.batch
        members = self.seen[b.batch_id]
        members.append(result)
        if len(members) == b.batch_size and b.batch_id not in self.printed:
            self.printed.add(b.batch_id)
            if not self.quiet:
                waits = [m.batch.queue_wait_ms for m in members]
                print(
                    f"batch {b.batch_id[:8]}  model={b.model:<10} size={b.batch_size:>3}  "
                    f"wait={statistics.mean(waits):7.1f} ms  {'LOAD' if b.model_loaded else '    '}",
                    flush=True,
                )


async def _workload(url: str, n: int, concurrency: int, quiet: bool, classify: bool, options: dict[str, str]) -> dict[str, Any]:
    vectors, truth = sample_inputs(n, seed=7)
    printer = _BatchPrinter(quiet)
    latencies: list[float] = []
    errors: dict[str, int] = defaultdict(int)
    correct = 0
    gate = asyncio.Semaphore(concurrency)
    async with sdk.Client.connect(url, **options) as client:

        async def one(i: int) -> None:
            nonlocal correct
            # Half the requests name their model; the other half let the classifier decide.
            model = truth[i] if (not classify or i % 2 == 0) else None
            async with gate:
                try:
                    result = await client.infer_result(Tensor.from_torch(vectors[i]), model=model, timeout=60)
                except sdk.JetbatchError as exc:
                    errors[exc.code] += 1
                    return
            latencies.append(result.latency_s)
            correct += result.batch.model == truth[i]
            printer.add(result)

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.monotonic() - started
    batches = {r.batch.batch_id: r.batch for rs in printer.seen.values() for r in rs}
    return {
        "requests": n,
        "answered": len(latencies),
        "errors": dict(errors),
        "batches": len(batches),
        "mean_batch": (len(latencies) / len(batches)) if batches else 0.0,
        "loads": sum(1 for b in batches.values() if b.model_loaded),
        "p50_ms": _percentile(latencies, 50) * 1000,
        "p99_ms": _percentile(latencies, 99) * 1000,
        "throughput": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "routed_correctly": correct,
    }


def run_demo(args: argparse.Namespace) -> int:
    examples = build_examples(Path(args.dir))
    print(f"example models in {examples.directory}; starting NATS, classifier and worker...", flush=True)
    classify = _has_classifier()
    # The embedded server admits only the roles of `jetbatch up`, with passwords of this run.
    credentials = tempfile.mkdtemp(prefix="jetbatch-demo-credentials-")
    try:
        summary, interrupted = _run(examples.up_toml, args, classify, credentials)
    finally:
        shutil.rmtree(credentials, ignore_errors=True)
    if interrupted or summary is None:
        print("interrupted; sidecars and NATS stopped", file=sys.stderr)
        return 130
    _print_summary(summary)
    return 0 if summary["answered"] == summary["requests"] else 1


def _run(config: Path, args: argparse.Namespace, classify: bool, credentials: str) -> tuple[dict[str, Any] | None, bool]:
    with Deployment(
        config, nats_url=args.nats_url, classifier=classify, log_level=args.log_level, store_dir=None, credentials_dir=credentials,
        progress=lambda line: print(line, flush=True),
    ) as dep:
        print(f"NATS at {dep.url}; sending {args.requests} requests ({'half classified, half with a model' if classify else 'each names its model'})", flush=True)
        previous = signal.getsignal(signal.SIGINT)
        try:
            workload = _workload(dep.url, args.requests, args.concurrency, args.quiet, classify, dep.connect_options("app"))
            return run_interruptible(workload), False
        except KeyboardInterrupt:
            return None, True
        finally:
            signal.signal(signal.SIGINT, previous)


def _has_classifier() -> bool:
    try:
        import jetbatch.sidecar.classifier  # noqa: F401
    except ImportError:
        return False
    return True


def _print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("requests", f"{s['requests']}"),
        ("answered", f"{s['answered']}"),
        ("errors", ", ".join(f"{k}={v}" for k, v in s["errors"].items()) or "0"),
        ("batches", f"{s['batches']}"),
        ("mean batch size", f"{s['mean_batch']:.1f}"),
        ("model loads", f"{s['loads']}"),
        ("routed to the right model", f"{s['routed_correctly']}/{s['answered']}"),
        ("throughput", f"{s['throughput']:.0f} req/s"),
        ("latency p50", f"{s['p50_ms']:.1f} ms"),
        ("latency p99", f"{s['p99_ms']:.1f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nsummary")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if os.environ.get("JETBATCH_DEMO_JSON"):
        import json

        Path(os.environ["JETBATCH_DEMO_JSON"]).write_text(json.dumps(s))
