"""A profile of each process of SDK → worker: the producer (this process) and the worker (its own
process, as deployed, under ``python -m cProfile``), the same load as ``bench/overhead.py``
(identity handler, 256-byte payloads, 64 in flight); with ``--classifier``, SDK → classifier →
worker, the classifier profiled in its own process too. Run:

    python -m bench.process_profiles [--requests 10000] [--classifier] [--out DIR]

Prints, for each process, where its CPU went (grouped by package), its CPU time per request and
the calls per request that matter on the hot path (messages published and received, header
blocks parsed, ``asyncio.wait_for`` calls, tasks created). The worker's start-up (imports, stream
setup) is counted apart. To compare two checkouts, run the script from each.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jetbatch import sdk
from jetbatch.sidecar.dev.natsserver import EmbeddedNats

ROOT = Path(__file__).resolve().parent.parent

CALLS = {
    "_send_publish": "messages published",
    "_process_msg": "messages received",
    "_parse_header_lines": "header blocks parsed",
    "parse_header_lines": "header blocks parsed",  # jetbatch's own, on the connections it opens (sdk/connection.py)
    "wait_for": "asyncio.wait_for calls",
    "create_task": "tasks created",
}


_STARTUP = frozenset(
    f"<built-in method {name}>"
    for name in ("builtins.exec", "marshal.loads", "_imp.create_dynamic", "builtins.compile", "_ctypes.dlopen", "builtins.__build_class__")
)


def group(filename: str, function: str) -> str:
    if "importlib" in filename or function == "<module>" or function in _STARTUP:
        return "start-up (imports)"
    if "select.epoll" in function:
        return "idle (epoll wait)"
    for part, name in (("/sdk/", "jetbatch SDK"), ("/sidecar/", "jetbatch sidecar"), ("/nats/", "nats-py"), ("asyncio", "asyncio"),
                       ("opentelemetry", "OpenTelemetry"), ("anyio", "anyio"), ("torch", "torch")):
        if part in filename:
            return name
    if "socket" in function:
        return "socket"
    return "builtins" if filename == "~" else "other"


def summary(path: Path, requests: int) -> tuple[dict[str, float], dict[str, float]]:
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    groups: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for (filename, _, function), (_, ncalls, tottime, _, _) in stats.items():
        groups[group(filename, function)] += tottime
        if function in CALLS:
            calls[CALLS[function]] += ncalls
    return dict(groups), {k: v / requests for k, v in calls.items()}


async def drive(url: str, n: int, profile: Path, model: str | None = "m") -> tuple[float, float]:
    async with sdk.Client.connect(url) as client:
        await client.infer(b"warm", model=model, timeout=60)
        gate = asyncio.Semaphore(64)

        async def one() -> None:
            async with gate:
                await client.infer(b"x" * 256, model=model, timeout=60)

        profiler = cProfile.Profile()
        started, cpu = time.perf_counter(), time.process_time()
        profiler.enable()
        await asyncio.gather(*(one() for _ in range(n)))
        profiler.disable()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        profiler.dump_stats(str(profile))
    return n / elapsed, cpu / n * 1e6


async def wait_for_streams(url: str, streams: tuple[str, ...], timeout_s: float = 60.0) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # The streams (consumers are made on demand, at the first request's load).
                for stream in streams:
                    await nc.jetstream().stream_info(stream)
                return
            except Exception:  # noqa: BLE001 - not created yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--classifier", action="store_true", help="through a classifier process (profiled too)")
    ap.add_argument("--out", default=None, help="keep the .pstats files here (default: a temporary folder)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="jetbatch-profiles-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "m.toml"
    cfg.write_text(
        '[models.m]\nhandler = "identity"\nmax_batch_size = 64\nmax_delay_ms = 2\n'
        '[classifier]\nrouter = "rules"\ndefault_model = "m"\nmax_batch_size = 64\nmax_delay_s = 0.002\n'
    )
    roles = ("worker", "classifier") if args.classifier else ("worker",)
    env = dict(os.environ, JETBATCH_UVLOOP="0", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    with EmbeddedNats() as server:
        sidecars = [
            subprocess.Popen(
                [sys.executable, "-m", "cProfile", "-o", str(out / f"{role}.pstats"), "-m", "jetbatch", role, "--config", str(cfg),
                 "--nats-url", server.url, "--http-port", "off"],
                env=env, cwd=ROOT,
            )  # fmt: skip
            for role in roles
        ]
        try:
            asyncio.run(wait_for_streams(server.url, ("JETBATCH_MODELS", "JETBATCH_IN") if args.classifier else ("JETBATCH_MODELS",)))
            rps, producer_us = asyncio.run(drive(server.url, args.requests, out / "producer.pstats", None if args.classifier else "m"))
        finally:
            for proc in sidecars:
                proc.send_signal(signal.SIGINT)  # the CLI exits cleanly, and cProfile writes its file
            for proc in sidecars:
                proc.wait(60)
    print(f"{args.requests} requests, {rps:.0f} req/s (every process profiled); profiles in {out}")
    for name in ("producer", *roles):
        groups, calls = summary(out / f"{name}.pstats", args.requests)
        startup = groups.pop("start-up (imports)", 0.0)
        busy = sum(v for k, v in groups.items() if not k.startswith("idle"))
        print(f"\n{name}: {busy / args.requests * 1e6:.0f} µs of profiled CPU a request" + (f" (start-up {startup:.1f} s apart)" if startup else ""))
        for key, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {key:22s} {seconds:7.3f} s  {100 * seconds / sum(groups.values()):5.1f}%")
        print("  per request: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(calls.items())))
    print(f"\n(producer process CPU, unprofiled share included: {producer_us:.0f} µs a request)")


if __name__ == "__main__":
    main()
