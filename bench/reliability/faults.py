"""Faults under load, counted: sent / answered / lost / duplicated to the caller.

Real processes on an embedded nats-server with file storage; a producer at a fixed rate through
the SDK; a supervisor that restarts a dead worker at once. Scenarios (each in one run):

- ``kill``: kill -9 of the worker every 3-6 s (seeded), ``max_deliver`` 3.
- ``restart``: the nats-server SIGKILLed and restarted (down 1 s) every 4-6 s.

"Duplicated" counts answers that reached the caller's inbox more than once for one request id
(the SDK returns one; this listens on the inbox beside it). "Lost": no answer within the call's
timeout. Run:

    python -m bench.reliability.faults [--rate 200] [--duration 30] [--scenario kill restart]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from jetbatch import sdk

from bench import harness


def write_config(directory: Path, prefix: str, max_deliver: int) -> Path:
    model = {"handler": "sleep", "max_batch_size": 32, "max_delay_ms": 10, "options": {"load_cost_s": 0.0, "batch_cost_s": 0.02, "item_cost_s": 0.0}}
    sections = {
        "nats": {"prefix": prefix}, "streams": {"ack_wait_s": 2.0, "max_deliver": max_deliver}, "worker": {"poll_interval_ms": 50},
        "models": {"m1": model},
    }  # fmt: skip
    return harness.write_config(sections, directory, prefix)


async def run_scenario(name: str, rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prefix = f"f{name}"
    with (
        tempfile.TemporaryDirectory() as tmp,
        harness.server(store_dir=Path(tmp) / "store") as server,
        harness.processes(write_config(Path(tmp), prefix, 3), server.url) as dep,
    ):
        answers: dict[str, int] = {}
        outcomes: list[Any] = []
        async with sdk.Client.connect(server.url, prefix=prefix) as client:

            async def count(msg: Any) -> None:
                rid = msg.subject.rsplit(".", 1)[-1]
                answers[rid] = answers.get(rid, 0) + 1

            await client.nats.subscribe(f"{client.subjects.prefix}.result.>", cb=count)  # every answer, live
            calls: list[asyncio.Future[Any]] = []
            stop = time.monotonic() + duration_s

            async def produce() -> None:
                i = 0
                while time.monotonic() < stop:
                    calls.append(asyncio.ensure_future(client.infer(f"r{i}".encode(), model="m1", timeout=90)))
                    i += 1
                    await asyncio.sleep(1.0 / rate)

            async def supervise() -> None:
                restarts = 0
                while time.monotonic() < stop + 60 and not (calls and all(c.done() for c in calls) and time.monotonic() > stop):
                    for proc_name, proc in list(dep.procs.items()):
                        if proc.poll() is not None:
                            dep.procs.pop(proc_name)
                            restarts += 1
                            await asyncio.to_thread(dep.start_worker, 100 + restarts)
                    await asyncio.sleep(0.05)

            async def inject() -> int:
                faults = 0
                while time.monotonic() < stop:
                    await asyncio.sleep(rng.uniform(3.0, 6.0) if name == "kill" else rng.uniform(4.0, 6.0))
                    if time.monotonic() >= stop:
                        break
                    if name == "kill" and dep.procs:
                        next(iter(dep.procs.values())).kill()
                    elif name == "restart":
                        await asyncio.to_thread(lambda: server.restart(down_s=1.0))
                    faults += 1
                return faults

            producer = asyncio.ensure_future(produce())
            supervisor = asyncio.ensure_future(supervise())
            faults = await inject()
            await producer
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            await supervisor
            await asyncio.sleep(0.5)  # late duplicates, if any, arrive now
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    return {
        "scenario": name,
        "faults": faults,
        "sent": len(outcomes),
        "answered_ok": len(outcomes) - len(failed),
        "answered_error": sum(1 for o in failed if isinstance(o, sdk.JetbatchError) and not isinstance(o, sdk.RequestTimeout)),
        "lost": sum(1 for o in failed if isinstance(o, sdk.RequestTimeout)),
        "duplicated_to_caller": sum(n - 1 for n in answers.values() if n > 1),
        "errors": sorted({type(o).__name__ for o in failed}),
    }


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await run_scenario(name, args.rate, args.duration, args.seed) for name in args.scenario]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scenario", nargs="+", default=["kill", "restart"], choices=["kill", "restart"])
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    ns = parser.parse_args()
    harness.emit(asyncio.run(main(ns)), ns.json)
