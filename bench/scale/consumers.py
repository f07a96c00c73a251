"""What many per-model consumers cost the server: creation time and idle CPU and memory.

A work-queue stream with ``--models`` subjects and one durable pull consumer per subject (as the
worker makes them), on one server or on a 3-node cluster with 3 replicas (each consumer is then a
Raft group; work-queue streams refuse consumers with fewer replicas than the stream). Reports the
time to create them ``--concurrency`` at a time, then each server's CPU and resident memory over
``--idle-s`` seconds with nothing happening.

    python -m bench.scale.consumers --models 1000                    # one server
    python -m bench.scale.consumers --models 1000 --cluster          # 3 nodes, R3
    python -m bench.scale.consumers --models 1000 --cluster --memory # memory-backed consumers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from bench import harness
from bench.harness import cpu_s, rss_kib


async def measure(urls: list[str], pids: list[int], args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    nc = await nats.connect(urls)
    try:
        js = nc.jetstream(timeout=30)
        subjects = [f"bench.model.m{i}" for i in range(args.models)]
        await js.add_stream(StreamConfig(name="BENCH", subjects=subjects, retention=RetentionPolicy.WORK_QUEUE, num_replicas=replicas))
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with gate:
                await js.add_consumer(
                    "BENCH",
                    ConsumerConfig(
                        durable_name=f"model-m{i}", filter_subject=subjects[i], ack_policy=AckPolicy.EXPLICIT,
                        num_replicas=0, mem_storage=args.memory or None,
                    ),
                )  # fmt: skip

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(args.models)))
        created_s = time.monotonic() - started
        await asyncio.sleep(3.0)  # let the Raft groups settle before reading idle figures
        before = [cpu_s(p) for p in pids]
        await asyncio.sleep(args.idle_s)
        idle = [(cpu_s(p) - b) / args.idle_s for p, b in zip(pids, before)]
        return {"created_s": created_s, "idle_cores_per_server": idle, "rss_mib_per_server": [rss_kib(p) / 1024 for p in pids]}
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--memory", action="store_true", help="memory-backed consumers")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.cluster:
            cluster = stack.enter_context(harness.cluster(3, base_dir=Path(tmp)))
            urls, pids, replicas = cluster.urls, [n.pid for n in cluster.nodes], 3
        else:
            server = stack.enter_context(harness.server(store_dir=Path(tmp) / "store"))
            urls, pids, replicas = [server.url], [server.pid], 1
        record = asyncio.run(measure(urls, [p for p in pids if p is not None], args, replicas))
    record.update({"bench": "consumers", "models": args.models, "cluster": args.cluster, "memory": args.memory, "concurrency": args.concurrency})
    harness.emit(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
