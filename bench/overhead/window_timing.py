"""How late the two clocks a batch window could close on end: a timed wait on the event loop
(``asyncio``'s timer, and ``sidecar/wakeup.py``'s timerfd, alternating), and nats-server's end
of a waiting pull request (the 408 at its ``expires``). Each wait is timed from this process.

    python -m bench.overhead.window_timing [--waits 300] [--pulls 20]

Prints the overshoot's p10 / p50 / p90 in milliseconds: for the timed waits, waits drawn
uniformly from 1-3 ms (a 2 ms window's remainder); for the pulls, each ``expires`` in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from typing import Any

import nats
from jetbatch.sidecar.wakeup import Wakeup

from bench import harness

EXPIRES_MS = (1.0, 1.5, 2.0, 3.0, 5.0)


def _quantiles_ms(late_s: list[float]) -> dict[str, float]:
    xs = sorted(late_s)
    return {f"p{q}": round(xs[min(len(xs) - 1, len(xs) * q // 100)] * 1000, 3) for q in (10, 50, 90)}


async def timed_waits(n: int) -> dict[str, Any]:
    wakeup = Wakeup()
    late: dict[str, list[float]] = {"event_loop_timer": [], "wakeup": []}
    rng = random.Random(1)
    for _ in range(n):
        for kind in late:
            wait_s = rng.uniform(0.001, 0.003)
            started = time.perf_counter()
            if kind == "wakeup":
                await wakeup.wait(wait_s)
            else:
                await asyncio.sleep(wait_s)
            late[kind].append(time.perf_counter() - started - wait_s)
    return {kind: _quantiles_ms(xs) for kind, xs in late.items()} | {"wakeup_on_timerfd": Wakeup.precise}


async def pull_expiries(url: str, n: int) -> dict[str, Any]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        stream = f"WT{uuid.uuid4().hex[:6].upper()}"
        await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
        await js.add_consumer(stream, durable_name="c", ack_policy="explicit")
        inbox = nc.new_inbox()
        ended: asyncio.Queue[float] = asyncio.Queue()

        async def on_status(_msg: Any) -> None:
            await ended.put(time.perf_counter())

        await nc.subscribe(inbox, cb=on_status)
        out: dict[str, Any] = {}
        for expires_ms in EXPIRES_MS:
            late = []
            for _ in range(n):
                body = json.dumps({"batch": 1, "expires": int(expires_ms * 1e6)}).encode()
                started = time.perf_counter()
                await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.c", body, reply=inbox)
                late.append(await asyncio.wait_for(ended.get(), 5) - started - expires_ms / 1000)
            out[f"expires_{expires_ms}ms"] = _quantiles_ms(late)
        return out
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waits", type=int, default=300, help="timed waits of each kind")
    parser.add_argument("--pulls", type=int, default=20, help="pull requests for each expires")
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    record: dict[str, Any] = {"bench": "window_timing", "timed_waits_late_ms": asyncio.run(timed_waits(args.waits))}
    with harness.server() as server:
        record["pull_end_late_ms"] = asyncio.run(pull_expiries(server.url, args.pulls))
    harness.emit(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
