"""Recovery from one fault, with the default settings: how long the requests around it wait.

Real processes on an embedded nats-server with file storage; three models (`sleep` handler,
load 0.5 s, batch 5 ms + 0.2 ms/item), one worker with one slot, a producer at ``--rate`` req/s
spread evenly over the models through the SDK (open loop), for ``--duration`` s. After
``--fault-at`` s, one fault:

- ``outage``: the nats-server is SIGKILLed and restarted on the same store ``--down`` s later;
- ``kill``: the worker is SIGKILLed and restarted at once;
- ``none``: no fault, the baseline the other two are read against.

Reports p50/p99/max of every request's latency (from its send time to its answer), the requests
lost (no answer within the call's 120 s timeout), and the bound the issue set: the outage (or
the restart) + ``ack_wait`` + two loads.

    python -m bench.reliability.recovery --fault outage
    python -m bench.reliability.recovery --fault kill
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from jetbatch import sdk
from jetbatch.sidecar.config import StreamsConfig
from jetbatch.sidecar.percentiles import percentile

from bench import harness
from bench.harness import emit

MODELS = ("m1", "m2", "m3")
LOAD_S = 0.5


def write_config(directory: Path, prefix: str, batch_cost_s: float = 0.005) -> Path:
    options = {"load_cost_s": LOAD_S, "batch_cost_s": batch_cost_s, "item_cost_s": 0.0002}
    model = {"handler": "sleep", "max_batch_size": 16, "max_delay_ms": 5, "load_cost_s": LOAD_S, "options": options}
    return harness.write_config({"nats": {"prefix": prefix}, "models": dict.fromkeys(MODELS, model)}, directory, prefix)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"rec{args.fault}"
    with (
        tempfile.TemporaryDirectory() as tmp,
        harness.server(store_dir=Path(tmp) / "store") as server,
        harness.processes(write_config(Path(tmp), prefix, args.batch_cost_s), server.url, classifier=False, http_port=-1) as dep,
    ):
        latencies: list[float] = []
        errors: dict[str, int] = {}
        fault_s = 0.0
        async with sdk.Client.connect(server.url, prefix=prefix) as client:

            async def one(i: int) -> None:
                sent = time.monotonic()
                try:
                    await client.infer(b"x", model=MODELS[i % len(MODELS)], timeout=120)
                    latencies.append(time.monotonic() - sent)
                except sdk.JetbatchError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

            async def fault() -> None:
                nonlocal fault_s
                if args.fault == "none":
                    return  # the baseline: the same traffic with no fault
                await asyncio.sleep(args.fault_at)
                started = time.monotonic()
                if args.fault == "outage":
                    await asyncio.to_thread(lambda: server.restart(down_s=args.down))
                else:
                    name = next(iter(dep.procs))
                    dep.procs.pop(name).kill()
                    await asyncio.to_thread(dep.start_worker, 1)
                    await asyncio.to_thread(dep.wait_ready, 60.0)
                fault_s = time.monotonic() - started

            fault_task = asyncio.ensure_future(fault())
            calls = []
            start = time.monotonic()
            for i in range(int(args.rate * args.duration)):
                await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
                calls.append(asyncio.ensure_future(one(i)))
            await fault_task
            await asyncio.gather(*calls)
    ack_wait_s = StreamsConfig().ack_wait_s
    return {
        "bench": "recovery", "fault": args.fault, "rate": args.rate, "duration_s": args.duration,
        "sent": int(args.rate * args.duration), "answered": len(latencies), "errors": errors,
        "fault_s": fault_s, "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
        "max_s": max(latencies, default=float("nan")),
        "bound_s": fault_s + ack_wait_s + 2 * LOAD_S,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=["outage", "kill", "none"], default="outage", help="none: the same traffic, no fault (the baseline)")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--fault-at", type=float, default=8.0)
    parser.add_argument("--batch-cost-s", type=float, default=0.005, help="each batch's fixed cost (the issue's case: 0.05)")
    parser.add_argument("--down", type=float, default=8.0, help="seconds the server stays down (outage)")
    parser.add_argument("--json", help="append the record to this file")
    args = parser.parse_args(argv)
    record = asyncio.run(run(args))
    emit(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
