"""What handing a forward pass to a worker thread costs, against running it on the event loop:
the worker's ``anyio.to_thread.run_sync`` round trip (hand-off, the thread's wake-up, the event
loop's wake-up back), timed around a pass that does nothing, and around the identity model's
pass over a batch of 64 tensors. Alternating, in one process, CPU (``time.process_time``, every
thread of the process) and wall time per pass.

    python -m bench.overhead.thread_hop [--passes 3000] [--rounds 3]

``BatchRunner._forward`` (sidecar/worker/execution.py) calls an ``inline`` handler's ``predict`` on
the event loop (``Handler.inline``): this is the cost that saves.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch


async def _timed(passes: int, one: Callable[[], Any], threaded: bool) -> tuple[float, float]:
    """CPU and wall microseconds a pass."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(passes):
        if threaded:
            await anyio.to_thread.run_sync(one)
        else:
            one()
            await anyio.lowlevel.checkpoint()  # the loop turns once, as after an inline pass
    return (time.process_time() - cpu) / passes * 1e6, (time.perf_counter() - wall) / passes * 1e6


async def main(args: argparse.Namespace) -> dict[str, Any]:
    batch = [torch.full((64,), float(i)) for i in range(64)]
    work: dict[str, Callable[[], Any]] = {"nothing": lambda: None, "identity_64": lambda: list(batch)}
    rows: list[dict[str, Any]] = []
    for one in work.values():
        for threaded in (True, False):
            await _timed(200, one, threaded)  # the thread exists, caches are warm
    for r in range(args.rounds):
        for name, one in work.items():
            thread_cpu, thread_wall = await _timed(args.passes, one, True)
            inline_cpu, inline_wall = await _timed(args.passes, one, False)
            rows.append(
                {
                    "round": r, "pass": name,
                    "thread_cpu_us": round(thread_cpu, 1), "thread_wall_us": round(thread_wall, 1),
                    "inline_cpu_us": round(inline_cpu, 1), "inline_wall_us": round(inline_wall, 1),
                    "hop_cpu_us": round(thread_cpu - inline_cpu, 1), "hop_wall_us": round(thread_wall - inline_wall, 1),
                }
            )  # fmt: skip
            print(json.dumps(rows[-1]))
    return {"bench": "thread_hop", "passes": args.passes, "rows": rows}


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    result = anyio.run(main, ap.parse_args())
    print(json.dumps(result))


if __name__ == "__main__":
    cli()
