"""Overload at the default settings: an open-loop stream of calls at ``--times`` the capacity of
one slow model (a sleep handler: ``--batch`` requests per ``--batch-cost-s``) for
``--duration-s``, each caller waiting ``--timeout-s``. Counted: how each call ended (an answer,
``Overloaded``, ``DeadlineExceeded``, ``RequestTimeout``, ...), the latency of each outcome, and
memory: this process's RSS (the worker and the callers), the server's, and the model queue's
depth, sampled each second (RSS reported at the start, middle and end of the run, then its
peak), and how many requests the worker refused at arrival (``refused_by_worker``).

``--admission off`` is the SDK without admission (every request sent, as before); ``--route
classifier`` sends through the classifier (no model named), which applies the same rule;
``--max-msgs`` sets the streams' limit (the default is the configuration's).

    python -m bench.overload [--duration-s 20] [--times 10] [--timeout-s 2] [--clients 1] [--admission on|off] [--route direct|classifier]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import time
from typing import Any

from bench import harness
from jetbatch import sdk


def _rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(int(q * len(values)), len(values) - 1)] * 1000, 1)


async def _run(url: str, server_pid: int | None, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    capacity_rps = args.batch / args.batch_cost_s
    rate = args.times * capacity_rps
    model = "m1" if args.route == "direct" else None
    latencies: dict[str, list[float]] = collections.defaultdict(list)
    samples: list[dict[str, float]] = []
    async with harness.in_process(cfg, url, classifier=args.route == "classifier") as worker, contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(sdk.Client.connect(url, prefix=cfg.subjects.prefix, admission=args.admission == "on"))
            for _ in range(args.clients)
        ]
        client = clients[0]
        js = client.nats.jetstream()
        await client.infer(b"warm", model="m1", timeout=30)
        # The first adverts with a measured drain rate (a heartbeat or two).
        await asyncio.sleep(2.5)

        async def one(i: int) -> None:
            started = time.monotonic()
            try:
                await clients[i % len(clients)].infer(f"r{i}".encode(), model=model, timeout=args.timeout_s)
                outcome = "ok"
            except sdk.JetbatchError as exc:
                outcome = type(exc).__name__
            latencies[outcome].append(time.monotonic() - started)

        async def sample(stop: asyncio.Event) -> None:
            while not stop.is_set():
                info = await js.stream_info(cfg.subjects.models_stream)
                samples.append({"t_s": round(time.monotonic() - began, 1), "queued": info.state.messages,
                                "rss_mb": round(_rss_mb(), 1), "server_rss_mb": round(_rss_mb(server_pid), 1) if server_pid else 0.0})  # fmt: skip
                with_timeout = asyncio.ensure_future(stop.wait())
                await asyncio.wait([with_timeout], timeout=1.0)
                with_timeout.cancel()

        stop = asyncio.Event()
        began = time.monotonic()
        sampler = asyncio.ensure_future(sample(stop))
        tasks: list[asyncio.Task[None]] = []
        n = int(rate * args.duration_s)
        for i in range(n):
            delay = began + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
        sent_s = time.monotonic() - began
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
    counts = {k: len(v) for k, v in sorted(latencies.items())}
    return {
        "capacity_rps": capacity_rps, "offered_rps": rate, "sent": n, "sent_in_s": round(sent_s, 1),
        "outcomes": counts,
        "p50_ms": {k: _pct(v, 0.5) for k, v in sorted(latencies.items())},
        "p99_ms": {k: _pct(v, 0.99) for k, v in sorted(latencies.items())},
        "max_queued": max((s["queued"] for s in samples), default=0),
        # Start, middle and end of the run, then the peak: flat memory is the first three alike.
        "rss_mb": _start_middle_end_peak(samples, "rss_mb"), "server_rss_mb": _start_middle_end_peak(samples, "server_rss_mb"),
        "refused_by_worker": {k: v for k, v in worker.stats.items() if k.startswith("arrivals_refus")},
    }  # fmt: skip


def _start_middle_end_peak(samples: list[dict[str, float]], key: str) -> list[float]:
    if not samples:
        return []
    return [samples[0][key], samples[len(samples) // 2][key], samples[-1][key], max(s[key] for s in samples)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--times", type=float, default=10.0, help="offered load, in multiples of the model's capacity")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="each caller's timeout")
    parser.add_argument("--batch", type=int, default=8, help="the model's max_batch_size")
    parser.add_argument("--batch-cost-s", type=float, default=0.2, help="seconds a batch sleeps")
    parser.add_argument("--clients", type=int, default=1, help="SDK clients (connections) the calls are spread over")
    parser.add_argument("--admission", choices=["on", "off"], default="on")
    parser.add_argument("--route", choices=["direct", "classifier"], default="direct")
    parser.add_argument("--max-msgs", type=int, default=None, help="the streams' max_msgs (default: the configuration's)")
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    model = {"handler": "sleep", "max_batch_size": args.batch, "batch_cost_s": args.batch_cost_s, "item_cost_s": 0.0, "load_cost_s": 0.0,
             "options": {"load_cost_s": 0.0, "batch_cost_s": args.batch_cost_s, "item_cost_s": 0.0}}  # fmt: skip
    sections: dict[str, Any] = {"models": {"m1": model}}
    if args.route == "classifier":
        sections["classifier"] = {"router": "rules", "default_model": "m1"}
    if args.max_msgs is not None:
        sections["streams"] = {"max_msgs": args.max_msgs}
    cfg = harness.config(sections)
    with harness.server() as server:
        result = asyncio.run(_run(server.url, server.pid, cfg, args))
    record = {"bench": "overload", "duration_s": args.duration_s, "times": args.times, "timeout_s": args.timeout_s,
              "admission": args.admission, "clients": args.clients, "route": args.route, "max_msgs": args.max_msgs, **result}  # fmt: skip
    harness.emit(record, args.json)


if __name__ == "__main__":
    main()
