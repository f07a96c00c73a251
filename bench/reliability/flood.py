"""A worker's memory under a flood of 10x its capacity: peak RSS against idle RSS, in one run.

A worker process (sleep handler: 50 ms per batch of 16, so about 320 req/s) is flooded with
requests published as fast as JetStream takes them, 10x what it serves in the same time. The
queue is JetStream's (on disk); the worker holds at most one running and one gathered batch, so
its memory should not grow with the flood. Run:

    python -m bench.reliability.flood [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid

import nats
from jetbatch.sdk.protocol import Headers

from bench import harness
from bench.harness import rss_kib


async def flood(url: str, prefix: str, seconds: float, rate: float) -> int:
    nc = await nats.connect(url)
    js = nc.jetstream()
    sent = 0
    started = time.monotonic()
    body = b"x" * 1024
    while time.monotonic() - started < seconds:
        batch = [
            js.publish(f"{prefix}.model.m1", body, headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: "_INBOX.flood.x"})
            for _ in range(200)
        ]
        await asyncio.gather(*batch)
        sent += len(batch)
        ahead = sent / rate - (time.monotonic() - started)
        if ahead > 0:
            await asyncio.sleep(ahead)
    await nc.close()
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    capacity = 16 / 0.05
    prefix = harness.fresh_prefix("fl")
    model = {"handler": "sleep", "max_batch_size": 16, "max_delay_ms": 5, "options": {"load_cost_s": 0.0, "batch_cost_s": 0.05, "item_cost_s": 0.0}}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = harness.write_config({"nats": {"prefix": prefix}, "streams": {"max_msgs": 200000}, "models": {"m1": model}}, tmp, "flood")
        with harness.processes(cfg) as dep:
            pid = dep.procs["worker0"].pid
            idle = rss_kib(pid, "VmRSS")
            sent = asyncio.run(flood(dep.url, prefix, args.seconds, 10 * capacity))
            time.sleep(1.0)  # keep serving the backlog a little: the peak is recorded by the kernel
            peak = rss_kib(pid, "VmHWM")
    harness.emit({
        "capacity_rps": capacity, "offered_rps": sent / args.seconds, "offered_over_capacity": sent / args.seconds / capacity,
        "idle_rss_mib": round(idle / 1024, 1), "peak_rss_mib": round(peak / 1024, 1), "peak_over_idle": round(peak / idle, 3),
    }, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
