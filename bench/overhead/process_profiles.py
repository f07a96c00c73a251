"""A profile of each process of SDK → worker: the producer (this process) and the worker (its own
process, as deployed, under ``python -m cProfile``), the same load as ``bench/overhead/in_process.py``
(identity handler, 256-byte payloads, 64 in flight, or ``--concurrency``); with ``--classifier``, SDK → classifier →
worker, the classifier profiled in its own process too. Run:

    python -m bench.overhead.process_profiles [--requests 10000] [--concurrency 64] [--priority interactive|batch] [--classifier]
                                     [--out DIR] [--sampler cprofile|py-spy [--raw-stored | --classifier --raw-relayed] [--twin]]

Prints, for each process, where its CPU went (grouped by package), its CPU time per request and
the calls per request that matter on the hot path (messages published and received, header
blocks parsed, ``asyncio.wait_for`` calls, tasks created). The worker's start-up (imports, stream
setup) is counted apart. To compare two checkouts, run the script from each.

cProfile (the default) counts calls exactly but charges every Python call an overhead, so it
inflates code made of many small calls (the worker runs about 3.7x slower under it). ``--sampler
py-spy`` (``pip install py-spy``; not a dependency) samples every process from outside at 500 Hz
without stopping it, over the measured requests only: each busy sample is charged to the
function on top of the stack (C calls such as a socket write or a regular expression to the
Python function that made them). It prints each process's busy samples by package and the top
functions, and each process's user and system CPU a request over the sampled requests (from
``/proc``). A sample counts a process as busy while it waits for a core too: on a small host a
socket write that wakes nats-server is often preempted there, so socket writes' share of the
samples can be far above the system CPU's share, which bounds what they really cost.

With ``--raw-stored`` (py-spy only), the same requests then go through the raw loop that stores
its replies (``bench.harness.raw``'s consumer with ``--stored``: fetch up to 64, a JetStream publish of
each reply, the acks once the PubAcks came), its consumer sampled the same way on the same
server, and the worker's CPU a request is set beside the raw consumer's, package by package: where
the worker spends more than the least loop that acks only safe answers, and where less. With
``--classifier --raw-relayed``, the raw twin of the classifier path instead (``bench.overhead.deployed
--relay`` in front of that consumer: fetch up to 64 from an ingress stream, republish each as a
JetStream publish, ack once the PubAcks came), its relay set beside the classifier as well.
``--twin``: those raw loops ask nats-server for the work jetbatch's protocol asks (random ids, the
SDK's request headers, answers under the request's key with an answer's headers, the arrival
events' republish), as ``bench.overhead.deployed --raw-twin`` / ``--raw-relayed-twin`` do.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import os
import pstats
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import nats
from jetbatch import sdk

ROOT = Path(__file__).resolve().parents[2]

from bench import harness
from bench.harness import cpu_split
from bench.harness.raw import add_raw_streams, raw_processes, raw_requests

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


def spy_group(frame: str) -> str:
    """The package of one py-spy frame, ``function (path/file.py:line)``."""
    where = frame.rpartition("(")[2]
    for part, name in (("/sdk/", "jetbatch SDK"), ("sdk/", "jetbatch SDK"), ("sidecar/", "jetbatch sidecar"), ("nats/", "nats-py"),
                       ("asyncio/", "asyncio"), ("anyio/", "anyio"), ("torch/", "torch"), ("opentelemetry/", "OpenTelemetry"),
                       ("threading.py", "threads"), ("bench/", "bench loop")):  # fmt: skip
        if where.startswith(part) or f"/{part}" in where:
            return name
    return "other"


def _idle(frames: list[str]) -> bool:
    # The event loop waiting in epoll, or a thread pool's thread waiting for work.
    return frames[-1].endswith(("select (selectors.py)", "wait (threading.py)"))


def spy_summary(path: Path) -> tuple[int, dict[str, int], dict[str, int]]:
    """Busy samples, and busy samples by package and by function (the top of each stack)."""
    groups: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        if not frames or not count.isdigit() or _idle(frames):
            continue
        busy += int(count)
        groups[spy_group(frames[-1])] += int(count)
        functions[frames[-1]] += int(count)
    return busy, dict(groups), dict(functions)


class _Spies:
    """py-spy recording the given processes (raw collapsed stacks, one file each) until stopped."""

    def __init__(self, out: Path, pids: dict[str, int]) -> None:
        exe = shutil.which("py-spy")
        if exe is None:
            raise SystemExit("error: --sampler py-spy needs py-spy on PATH (pip install py-spy)")
        self.procs = [
            subprocess.Popen([exe, "record", "--nonblocking", "-r", "500", "-f", "raw", "-o", str(out / f"{name}.spy"), "--pid", str(pid)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            for name, pid in pids.items()
        ]

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc in self.procs:
            proc.wait(60)


async def drive(
    url: str, n: int, profile: Path, model: str | None = "m", spy: dict[str, int] | None = None, split: dict[str, tuple[float, float]] | None = None,
    concurrency: int = 64, priority: str = "interactive",
) -> tuple[float, float]:
    """``spy``: sample these processes (and this one) with py-spy instead of profiling this one;
    each one's user and system CPU a request (µs) over the sampled requests then goes into
    ``split``."""
    async with sdk.Client.connect(url) as client:
        await client.infer(b"warm", model=model, timeout=60)
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                await client.infer(b"x" * 256, model=model, timeout=60, priority=priority)

        spies: _Spies | None = None
        profiler = cProfile.Profile()
        if spy is not None:
            await asyncio.gather(*(one() for _ in range(min(n, 2000))))  # every model loaded, every path warm
            spies = _Spies(profile.parent, {"producer": os.getpid(), **spy})
            await asyncio.sleep(1.0)  # py-spy attached to every process
        pids = {"producer": os.getpid(), **(spy or {})}
        before = {name: cpu_split(pid) for name, pid in pids.items()}
        started, cpu = time.perf_counter(), time.process_time()
        if spies is None:
            profiler.enable()
        await asyncio.gather(*(one() for _ in range(n)))
        if spies is None:
            profiler.disable()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        if split is not None:
            for name, pid in pids.items():
                (user, system), (user0, system0) = cpu_split(pid), before[name]
                split[name] = ((user - user0) / n * 1e6, (system - system0) / n * 1e6)
        if spies is None:
            profiler.dump_stats(str(profile))
        else:
            spies.stop()
    return n / elapsed, cpu / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight (beyond 3 batches of 64 the worker drains a deep queue)")
    ap.add_argument("--priority", choices=("interactive", "batch"), default="interactive", help="the requests' class (the model's line)")
    ap.add_argument("--classifier", action="store_true", help="through a classifier process (profiled too)")
    ap.add_argument("--out", default=None, help="keep the .pstats files here (default: a temporary folder)")
    ap.add_argument("--sampler", choices=("cprofile", "py-spy"), default="cprofile", help="how each process is profiled (module docstring)")
    ap.add_argument("--raw-stored", action="store_true", help="py-spy: then the stored raw loop, its consumer beside the worker (module docstring)")
    ap.add_argument("--raw-relayed", action="store_true",
                    help="py-spy, --classifier: then the raw twin of the classifier path, its relay beside the classifier (module docstring)")
    ap.add_argument("--twin", action="store_true",
                    help="with --raw-stored or --raw-relayed: the raw loop asks nats-server for jetbatch's work (bench.overhead.deployed's twins)")
    args = ap.parse_args()
    if args.raw_stored and (args.sampler != "py-spy" or args.classifier):
        ap.error("--raw-stored needs --sampler py-spy, without --classifier")
    if args.raw_relayed and (args.sampler != "py-spy" or not args.classifier):
        ap.error("--raw-relayed needs --sampler py-spy and --classifier")
    if args.twin and not (args.raw_stored or args.raw_relayed):
        ap.error("--twin needs --raw-stored or --raw-relayed")
    if args.sampler == "py-spy":
        return sampled(args)
    out, cfg, roles, env = _setup(args, "jetbatch-profiles-")
    # Each sidecar under cProfile, which writes its file when the CLI exits on SIGINT.
    profiled = lambda role: ["-m", "cProfile", "-o", str(out / f"{role}.pstats")]
    with harness.server() as server, harness.cli_processes(cfg, server.url, roles, wrap=profiled, env=env):
        rps, producer_us = asyncio.run(
            drive(
                server.url, args.requests, out / "producer.pstats", None if args.classifier else "m",
                concurrency=args.concurrency, priority=args.priority,
            )  # fmt: skip
        )
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


def _setup(args: argparse.Namespace, prefix: str) -> tuple[Path, Path, tuple[str, ...], dict[str, str]]:
    """The output folder, the sidecars' config, their roles and environment (both samplers)."""
    out = Path(args.out or tempfile.mkdtemp(prefix=prefix))
    out.mkdir(parents=True, exist_ok=True)
    cfg = harness.write_config({
        "models": {"m": {"handler": "identity", "max_batch_size": 64, "max_delay_ms": 2}},
        "classifier": {"router": "rules", "default_model": "m", "max_batch_size": 64, "max_delay_s": 0.002},
    }, out, "m")  # fmt: skip
    roles = ("worker", "classifier") if args.classifier else ("worker",)
    env = dict(os.environ, JETBATCH_UVLOOP="0", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    return out, cfg, roles, env


def sampled(args: argparse.Namespace) -> None:
    """The same load, each process sampled by py-spy from outside (unprofiled, full speed)."""
    out, cfg, roles, env = _setup(args, "jetbatch-samples-")
    with harness.server() as server:
        with harness.cli_processes(cfg, server.url, roles, env=env) as sidecars:
            pids = {role: p.pid for role, p in sidecars.items()}
            split: dict[str, tuple[float, float]] = {}
            model = None if args.classifier else "m"
            rps, producer_us = asyncio.run(
                drive(server.url, args.requests, out / "producer.spy", model, spy=pids, split=split, concurrency=args.concurrency, priority=args.priority)
            )
        raw_rps = None
        if args.raw_stored or args.raw_relayed:
            raw_rps = _raw_round(server.url, out, args.requests, args.concurrency, split, relayed=args.raw_relayed, twin=args.twin)
    print(f"{args.requests} requests, {rps:.0f} req/s (sampled by py-spy at 500 Hz, not slowed); samples in {out}")
    raw_names = ("raw_producer", *(("raw_relay",) if args.raw_relayed else ()), "raw_consumer") if raw_rps is not None else ()
    by_package: dict[str, dict[str, float]] = {}
    for name in ("producer", *roles, *raw_names):
        if name == "raw_producer":
            loop = ("the raw twin of the classifier path" if args.twin else "the raw relayed loop") if args.raw_relayed else (
                "the raw twin" if args.twin else "the stored raw loop")  # fmt: skip
            print(f"\n{loop}, the same requests on the same server: {raw_rps:.0f} req/s")
        busy, groups, functions = spy_summary(out / f"{name}.spy")
        user_us, system_us = split[name]
        print(f"\n{name}: {busy} busy samples; CPU a request: user {user_us:.0f} µs, system {system_us:.0f} µs "
              f"({100 * system_us / max(user_us + system_us, 1e-9):.0f}% system)")  # fmt: skip
        for key, n in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {key:22s} {100 * n / max(busy, 1):5.1f}%")
        print("  top functions (self):")
        for key, n in sorted(functions.items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {100 * n / max(busy, 1):5.1f}%  {key}")
        by_package[name] = {key: n / max(busy, 1) * sum(split[name]) for key, n in groups.items()}
    print(f"\n(producer process CPU: {producer_us:.0f} µs a request)")
    if raw_rps is not None:
        _beside("worker", by_package["worker"], "raw consumer", by_package["raw_consumer"])
        if args.raw_relayed:
            _beside("classifier", by_package["classifier"], "raw relay", by_package["raw_relay"])


def _beside(ours: str, worker: dict[str, float], theirs: str, raw: dict[str, float]) -> None:
    """A sidecar's CPU a request beside its raw counterpart's (the worker's beside the raw
    consumer's, the classifier's beside the raw relay's), by package (each process's CPU a request
    shared out as its busy samples are)."""
    print(f"\nCPU a request (µs), by package: {ours} {sum(worker.values()):.0f}, {theirs} {sum(raw.values()):.0f}")
    print(f"  {'':22s} {ours:>10s} {theirs:>12s} {'difference':>11s}")
    for key in sorted(set(worker) | set(raw), key=lambda k: -(worker.get(k, 0.0) + raw.get(k, 0.0))):
        w, r = worker.get(key, 0.0), raw.get(key, 0.0)
        print(f"  {key:22s} {w:10.1f} {r:12.1f} {w - r:+11.1f}")


def _raw_round(
    url: str, out: Path, n: int, concurrency: int, split: dict[str, tuple[float, float]], *, relayed: bool = False, twin: bool = False
) -> float:
    """The stored raw loop (the raw consumer in its own process, this process its producer) on
    the server at ``url``, every process sampled; their CPU a request goes into ``split``.
    ``relayed``: with the raw relay process in front (the raw twin of the classifier
    path); ``twin``: the raw loop asks nats-server for jetbatch's work (random ids, the protocol's
    headers, answers under the key, the arrival events' republish). Returns req/s."""
    prefix = harness.fresh_prefix("raw")

    async def setup() -> None:
        nc = await nats.connect(url)
        await add_raw_streams(nc.jetstream(), prefix, stored=True, relayed=relayed, republish=twin)
        await nc.close()

    asyncio.run(setup())
    how = {"stored": True, "relayed": relayed, "random_ids": twin, "protocol_headers": twin}
    with raw_processes(url, prefix, stored=True, protocol_headers=twin, relayed=relayed) as procs:
        pids = {"raw_producer": os.getpid(), **{name: p.pid for name, p in procs.items()}}

        async def run() -> float:
            nc = await nats.connect(url)
            try:
                payload = b"x" * 256
                await raw_requests(nc, prefix, min(n, 2000), concurrency, payload, first=n, **how)  # every path warm
                spies = _Spies(out, pids)
                await asyncio.sleep(1.0)  # py-spy attached to every process
                before = {name: cpu_split(pid) for name, pid in pids.items()}
                elapsed, _ = await raw_requests(nc, prefix, n, concurrency, payload, **how)
                for name, pid in pids.items():
                    (user, system), (user0, system0) = cpu_split(pid), before[name]
                    split[name] = ((user - user0) / n * 1e6, (system - system0) / n * 1e6)
                spies.stop()
                return n / elapsed
            finally:
                await nc.close()

        return asyncio.run(run())


if __name__ == "__main__":
    main()
