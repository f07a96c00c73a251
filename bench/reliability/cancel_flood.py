"""One tenant floods a subject it may publish to; what the other tenant's requests see (issue 52,
finding 1).

A worker and a classifier process (as deployed, default settings, a sleep model of 5 ms a batch
of up to 8) serve tenant B's requests, sent at ``--rate`` a second, open loop. For each target
(``--targets``: tenant A's cancel subject, its ingress, a model queue, the stream-name lookup, a
direct get, or a subject nobody reads as a control), ``--seconds`` quiet, then ``--seconds``
while a raw client publishes to it as fast as its socket takes them. Side by side: B's p50, p99,
max and errors in each phase, the CPU seconds the worker, the classifier and nats-server spent
in it, the worker's notice counters, and the slow-consumer cuts nats-server logged, by connection
name (the worker's data connection is ``jetbatch-worker``; its cancel notices', ``jetbatch-worker-control``).

    python -m bench.reliability.cancel_flood [--seconds 10] [--rate 100] [--targets cancel,ingress,...] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from typing import Any

from jetbatch import sdk
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.status import collect_status

from bench import harness

SECTIONS = {
    # A classifier reads the ingress (a flood of it is junk it dead-letters); B names its model.
    "classifier": {"router": "rules", "default_model": "m1"},
    "models": {
        "m1": {"handler": "sleep", "max_batch_size": 8, "max_delay_ms": 5, "options": {"load_cost_s": 0.0, "batch_cost_s": 0.005, "item_cost_s": 0.0}},
    },
}


# What tenant A's flood may target: its cancel subject, its ingress (junk the classifier reads and
# dead-letters), a model queue its permissions may allow (``app``: ``model.>``; junk for a model
# no one registered), the stream-name lookup, a direct get of its own answers; and, as a control,
# a subject nobody reads (what the flood costs the host and the server alone).
TARGETS = {
    "cancel": "{prefix}.cancel.a",
    "ingress": "{prefix}.in.a",
    "model": "{prefix}.model.junk",
    "stream-names": "$JS.API.STREAM.NAMES",
    "direct-get": "$JS.API.DIRECT.GET.{streams}_RESULTS.{prefix}.result.a.x",
    "nobody": "{prefix}.nobody",
}


async def run(url: str, prefix: str, seconds: float, rate: float, target: str, pids: dict[str, int]) -> dict[str, Any]:
    """A quiet phase then one with ``target`` flooded (``seconds`` each, side by side): B's
    latencies and errors, and the CPU seconds each process (``pids``) spent in each phase."""
    streams = Subjects(prefix).results_stream.removesuffix("_RESULTS")
    subject = TARGETS[target].format(prefix=prefix, streams=streams)

    async def phase(flood: bool) -> dict[str, Any]:
        flooder = await harness.start_flooder(url, subject, seconds) if flood else None
        cpu = {name: harness.cpu_s(pid) for name, pid in pids.items()}
        seen = await harness.open_loop(lambda: client.infer(b"b", model="m1", timeout=5.0), rate, seconds)
        seen["cpu_s"] = {name: round(harness.cpu_s(pid) - cpu[name], 2) for name, pid in pids.items()}
        if flooder is not None:
            out, _ = await flooder.communicate()
            seen["sent"] = int(out or 0)
        return seen

    async with sdk.Client.connect(url, prefix=prefix) as client:
        await client.infer(b"warm", model="m1", timeout=30)
        quiet = await phase(False)
        flooded = await phase(True)
    nc = await connect_nats(url)
    try:
        reports = [r for r in await collect_status(nc, Subjects(prefix), wait_s=1.0) if r.role == "worker"]
    finally:
        await nc.close()
    stats = reports[0].stats if reports else {}
    keep = ("cancels_heard", "cancels_dropped", "cancels_connection_cuts", "unreadable_messages")
    q, f = quiet["p99_ms"], flooded["p99_ms"]
    return {
        "subject": subject, "quiet": quiet, "flood": flooded, "p99_flood_over_quiet": round(f / q, 2) if q and f else None,
        "worker": {k: stats.get(k) for k in keep},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--rate", type=float, default=100.0, help="tenant B's requests a second"
    )
    parser.add_argument(
        "--targets", default="cancel", help=f"comma-separated, each on a fresh server and deployment, quiet then flooded: {', '.join(TARGETS)}"
    )
    parser.add_argument(
        "--json",
        default=None,
        help="append the run's record to this file (one JSON object per line)",
    )
    args = parser.parse_args()
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    for target in targets:
        config = harness.config(SECTIONS, tag="cf")
        with tempfile.TemporaryDirectory() as tmp, harness.server() as server:
            cfg = harness.write_config(config, tmp, "cancel_flood")
            with harness.processes(cfg, server.url) as dep:
                pids = {"worker": dep.procs["worker0"].pid, "classifier": dep.procs["classifier0"].pid, "server": server.pid}
                record = asyncio.run(run(server.url, config.nats.prefix, args.seconds, args.rate, target, pids))
            record["slow_consumer_cuts"] = harness.slow_consumer_cuts(server.log)
        record = {"target": target, "seconds": args.seconds, "rate": args.rate, "load": round(os.getloadavg()[0], 2), **record}
        harness.emit(record, args.json)

if __name__ == "__main__":
    main()
