"""Forged arrival and take events at full speed on an open server (issue 52, finding 2).

Arrival (``<prefix>.arrived.<model>``) and take events (``<prefix>.taken.<model>``) are core
messages: on a server without permissions anyone can send them (docs/security.md). A worker
process (as deployed, default settings) registers two sleep models, ``real`` (5 ms a batch of up
to 8) and ``ghost`` (never requested). ``real`` gets ``--rate`` requests a second, open loop, with
a 5 s timeout: ``--seconds`` quiet, then ``--seconds`` while a raw client floods, per target:

- ``takes``: take events of ``real`` claiming a peer took 100 000 of its requests (the most a
  take may say), under ``--peers`` made-up worker ids, each message another;
- ``arrivals``: arrival events of ``ghost`` with a timestamp 5 s old and sequences far past the
  stream's (the most urgent-looking queue there is);
- ``nobody``: the arrivals' messages on a subject nobody reads, the control: what the flood costs
  the host and nats-server alone (the flooder runs on the worker's host).

Side by side: ``real``'s p50, p99, max and errors in each phase, the loads the worker made in each
(``ghost`` must get none), and the worker's counters of checked and refuted events.

    python -m bench.reliability.forged_events [--seconds 10] [--rate 100] [--targets takes,arrivals] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

from jetbatch import sdk
from jetbatch.sdk.protocol import Subjects

from bench import harness

_SLEEP = {"load_cost_s": 0.05, "batch_cost_s": 0.005, "item_cost_s": 0.0}
SECTIONS = {
    "models": {
        "real": {"handler": "sleep", "max_batch_size": 8, "max_delay_ms": 5, "options": _SLEEP},
        "ghost": {"handler": "sleep", "max_batch_size": 8, "max_delay_ms": 5, "options": _SLEEP},
    },
}
KEEP = ("loads", "loads_refuted", "takes_refuted", "arrivals_doubted", "unreadable_messages")


def forged(target: str, subjects: Subjects, peers: int) -> dict[str, Any]:
    """The subject, payload and headers of one target's forged events (``{i}``: the message's number)."""
    if target == "takes":
        # {i} of a chunk of 10 000: ``peers`` ids by its last digits (a prefix of zeros is one id).
        peer = "evil-{i}" if peers > 1 else "evil"
        return {"subject": subjects.taken("real"), "data": "+100000", "headers": {"Jetbatch-Worker": peer}}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime(time.time() - 5))
    return {
        "subject": subjects.arrived("ghost") if target == "arrivals" else f"{subjects.prefix}.nobody", "data": "",
        "headers": {"Nats-Time-Stamp": stamp, "Nats-Sequence": "100000000000{i}"},
    }  # fmt: skip


async def stats(url: str, prefix: str, timeout_s: float = 30.0) -> dict[str, int]:
    """The worker's counters, once it answers (a flood may have cut its connection: it reconnects)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = await harness.worker_stats(url, prefix)
        if "loads" in seen or time.monotonic() > deadline:
            return seen


async def run(url: str, prefix: str, seconds: float, rate: float, target: str, peers: int) -> dict[str, Any]:
    subjects = Subjects(prefix)
    phases: dict[str, Any] = {}
    async with sdk.Client.connect(url, prefix=prefix) as client:
        await client.infer(b"warm", model="real", timeout=30)
        for name in ("quiet", "flood"):
            before = await stats(url, prefix)
            flooder = None
            if name == "flood":
                event = forged(target, subjects, peers)
                flooder = await harness.start_flooder(url, event["subject"], seconds, data=event["data"], headers=event["headers"])
            seen = await harness.open_loop(lambda: client.infer(b"r", model="real", timeout=5.0), rate, seconds)
            if flooder is not None:
                out, _ = await flooder.communicate()
                seen["sent"] = int(out or 0)
            after = await stats(url, prefix)
            seen["worker"] = {k: after.get(k, 0) - before.get(k, 0) for k in KEEP}
            phases[name] = seen
    q, f = phases["quiet"]["p99_ms"], phases["flood"]["p99_ms"]
    return {**phases, "p99_flood_over_quiet": round(f / q, 2) if q and f else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=100.0, help="requests a second to the real model")
    parser.add_argument("--targets", default="takes,arrivals", help="comma-separated: takes, arrivals, nobody (each on a fresh server)")
    parser.add_argument("--peers", type=int, default=1, help="made-up worker ids of the forged takes (1, or one a message)")
    parser.add_argument("--json", default=None, help="append each target's record to this file (one JSON object per line)")
    args = parser.parse_args()
    targets = args.targets.split(",")
    if any(t not in ("takes", "arrivals", "nobody") for t in targets):
        parser.error(f"targets are takes, arrivals and nobody, got {args.targets}")
    for target in targets:
        config = harness.config(SECTIONS, tag="fe")
        with tempfile.TemporaryDirectory() as tmp, harness.server() as server:
            cfg = harness.write_config(config, tmp, "forged_events")
            with harness.processes(cfg, server.url, classifier=False):
                record = asyncio.run(run(server.url, config.nats.prefix, args.seconds, args.rate, target, args.peers))
            record["slow_consumer_cuts"] = harness.slow_consumer_cuts(server.log)
        harness.emit({"target": target, "seconds": args.seconds, "rate": args.rate, "load": round(os.getloadavg()[0], 2), **record}, args.json)


if __name__ == "__main__":
    main()
