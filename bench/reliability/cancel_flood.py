"""One tenant floods its cancel subject; what the other tenant's requests see (issue 52, finding 1).

A worker process (as deployed: ``jetbatch worker``, default settings, a sleep model of 5 ms a
batch of up to 8) serves tenant B's requests, sent at ``--rate`` a second, open loop, for
``--seconds``: once quiet, then while a raw client publishes to ``<prefix>.cancel.a`` as fast as
its socket takes them. Side by side: B's p50, p99, max and errors in each phase, the worker's
notice counters, and the slow-consumer cuts nats-server logged, by connection name (the worker's
data connection is ``jetbatch-worker``; its cancel notices' own, ``jetbatch-worker-control``).

    python -m bench.cancel_flood [--seconds 10] [--rate 100] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from typing import Any

from jetbatch import sdk
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.status import collect_status

from bench import harness

# A raw client publishing 8-byte notices in chunks of 10 000 until its time is up; prints the count.
FLOODER = r"""
import socket, sys, time
host, port, subject, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), float(sys.argv[4])
s = socket.create_connection((host, port))
s.makefile("rb").readline()
s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
chunk = b"".join(b"PUB %s 8\r\n%08d\r\n" % (subject, i) for i in range(10_000))
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(chunk)
    sent += 10_000
print(sent)
"""

SECTIONS = {
    "models": {
        "m1": {"handler": "sleep", "max_batch_size": 8, "max_delay_ms": 5, "options": {"load_cost_s": 0.0, "batch_cost_s": 0.005, "item_cost_s": 0.0}},
    },
}


async def load(client: sdk.Client, rate: float, seconds: float) -> dict[str, Any]:
    """B's requests, ``rate`` a second for ``seconds`` (open loop), each with a 5 s timeout."""
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def one() -> None:
        started = time.perf_counter()
        try:
            await client.infer(b"b", model="m1", timeout=5.0)
            latencies.append(time.perf_counter() - started)
        except sdk.JetbatchError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    tasks = []
    started = time.monotonic()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    latencies.sort()
    ms = lambda q: (
        round(1000 * percentile(latencies, q / 100), 1) if latencies else None
    )
    return {
        "answered": len(latencies),
        "errors": errors,
        "p50_ms": ms(50),
        "p99_ms": ms(99),
        "max_ms": round(1000 * latencies[-1], 1) if latencies else None,
    }


def slow_consumer_cuts(log: list[str]) -> dict[str, int]:
    """Slow-consumer lines of the server's log, by the client's connection name."""
    cuts: dict[str, int] = {}
    for line in log:
        if "Slow Consumer" in line:
            name = re.search(r'"[^"]*:([^":]+)"', line)
            key = name.group(1) if name else "?"
            cuts[key] = cuts.get(key, 0) + 1
    return cuts


async def run(url: str, prefix: str, seconds: float, rate: float) -> dict[str, Any]:
    async with sdk.Client.connect(url, prefix=prefix) as client:
        await client.infer(b"warm", model="m1", timeout=30)
        quiet = await load(client, rate, seconds)
        host, port = url.removeprefix("nats://").rsplit(":", 1)
        flooder = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            FLOODER,
            host,
            port,
            f"{prefix}.cancel.a",
            str(seconds),
            stdout=asyncio.subprocess.PIPE,
        )
        flooded = await load(client, rate, seconds)
        out, _ = await flooder.communicate()
    nc = await connect_nats(url)
    try:
        reports = [
            r
            for r in await collect_status(nc, Subjects(prefix), wait_s=1.0)
            if r.role == "worker"
        ]
    finally:
        await nc.close()
    stats = reports[0].stats if reports else {}
    keep = (
        "cancels_heard",
        "cancels_dropped",
        "cancels_connection_cuts",
        "unreadable_messages",
    )
    return {
        "quiet": quiet,
        "flood": {**flooded, "notices_sent": int(out or 0)},
        "worker": {k: stats.get(k) for k in keep},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--rate", type=float, default=100.0, help="tenant B's requests a second"
    )
    parser.add_argument(
        "--json",
        default=None,
        help="append the run's record to this file (one JSON object per line)",
    )
    args = parser.parse_args()
    config = harness.config(SECTIONS, tag="cf")
    prefix = config.nats.prefix
    with tempfile.TemporaryDirectory() as tmp, harness.server() as server:
        cfg = harness.write_config(config, tmp, "cancel_flood")
        with harness.processes(cfg, server.url):
            record = asyncio.run(run(server.url, prefix, args.seconds, args.rate))
        record["slow_consumer_cuts"] = slow_consumer_cuts(server.log)
    quiet, flood = record["quiet"]["p99_ms"], record["flood"]["p99_ms"]
    record["p99_flood_over_quiet"] = (
        round(flood / quiet, 2) if quiet and flood else None
    )
    harness.emit({"seconds": args.seconds, "rate": args.rate, **record}, args.json)


if __name__ == "__main__":
    main()
