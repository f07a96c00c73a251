"""Callers who give up: the closed burst of examples/workloads/burst.toml (4 models x 64 requests,
interleaved, one slot, 0.5 s loads), every caller gone ``--deadline-s`` after sending (about half
the burst's mean queueing time by default), simulated and live side by side.

Counted: loads, the loads whose model then computed nothing (every caller was gone), and, live,
requests computed for nobody: a caller gave up, yet the answer stored for its id is a result.
``--gone cancel``: callers cancel their tasks at ``--deadline-s`` (the SDK's cancel notice; their
timeouts are long) instead of timing out (the deadline the SDK sends).

    python -m bench.scheduler.abandoned [--deadline-s 0.67] [--gone timeout|cancel] [--live]
"""

from __future__ import annotations

import argparse
import asyncio
import tomllib
from pathlib import Path
from typing import Any

from jetbatch import sdk
from jetbatch.sdk.protocol import Headers, Status
from jetbatch.sidecar.simulator import build_workload, simulate

from bench import harness

BURST = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "burst.toml"


def simulated(deadline_s: float, gone: str) -> dict[str, Any]:
    raw = tomllib.loads(BURST.read_text())
    for model in raw["models"].values():
        model["cancel_after_s" if gone == "cancel" else "deadline_s"] = deadline_s
    result = simulate(build_workload(raw), "cost-aware")
    loaded = [m for _, _, m in result.load_log]
    computed = {m for _, _, m, _, _ in result.batches}
    return {
        "loads": result.loads, "loaded": loaded, "loads_for_nothing": sum(1 for m in loaded if m not in computed),
        "reaped_queues": result.reaped_queues, "completed": result.completed,
        "deadline_exceeded": result.deadline_exceeded, "cancelled": result.cancelled,
    }  # fmt: skip


async def _burst(url: str, cfg: Any, deadline_s: float, gone: str) -> dict[str, Any]:
    raw = tomllib.loads(BURST.read_text())
    models = list(raw["models"])
    per_model = int(raw["arrivals"]["per_model"])
    async with harness.in_process(cfg, url) as worker, sdk.Client.connect(url, prefix=cfg.subjects.prefix) as client:
        results: dict[str, Any] = {}

        async def one(i: int, model: str) -> None:
            rid = f"ab{i}"
            try:
                if gone == "cancel":
                    results[rid] = await asyncio.wait_for(client.infer_result(b"x", model=model, timeout=60, request_id=rid), deadline_s)
                else:
                    results[rid] = await client.infer_result(b"x", model=model, timeout=deadline_s, request_id=rid)
            except (sdk.JetbatchError, TimeoutError) as exc:
                results[rid] = exc

        order = [models[k % len(models)] for k in range(per_model * len(models))]
        await asyncio.gather(*(one(i, m) for i, m in enumerate(order)))
        # Every request answered somewhere (computed, refused, reaped): the store holds each id.
        js = client.nats.jetstream()

        async def stored(rid: str) -> str | None:
            try:
                msg = await js.get_msg(cfg.subjects.results_stream, subject=cfg.subjects.result(rid), direct=True)
            except Exception:  # noqa: BLE001 - not stored yet
                return None
            return (msg.headers or {}).get(Headers.STATUS)

        for _ in range(300):
            statuses = {rid: await stored(rid) for rid in results}
            if all(s is not None for s in statuses.values()):
                break
            await asyncio.sleep(0.1)
        ok = [r for r in results.values() if isinstance(r, sdk.Result)]
        paid = {r.batch.batch_id for r in ok if r.batch.model_loaded}
        stats = worker.stats.snapshot()
    gave_up = [rid for rid, r in results.items() if not isinstance(r, sdk.Result)]
    return {
        "loads": stats.get("loads", 0),
        "loads_for_nothing": stats.get("loads", 0) - len(paid),
        "answered_in_time": len(ok),
        "gave_up": len(gave_up),
        "computed_for_nobody": sum(1 for rid in gave_up if statuses.get(rid) == Status.OK.value),
        "unanswered_in_store": sum(1 for s in statuses.values() if s is None),
        "reaped": stats.get("reaped", 0), "cancelled_in_batches": stats.get("cancelled", 0),
    }  # fmt: skip


def live(deadline_s: float, gone: str) -> dict[str, Any]:
    raw = tomllib.loads(BURST.read_text())
    models = {
        name: {
            "handler": "sleep", "max_batch_size": int(m.get("max_batch_size", 16)), "load_cost_s": m["load_cost_s"], "max_wait_s": m.get("max_wait_s"),
            "options": {"load_cost_s": m["load_cost_s"], "batch_cost_s": m.get("batch_cost_s", 0.005), "item_cost_s": m.get("item_cost_s", 0.0001)},
        }
        for name, m in raw["models"].items()
    }  # fmt: skip
    cfg = harness.config({"models": models, "worker": {"max_resident_models": 1, "host_memory_budget_bytes": 0, "poll_interval_ms": 50}})
    with harness.server() as server:
        return asyncio.run(_burst(server.url, cfg, deadline_s, gone))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deadline-s", type=float, default=0.67)
    parser.add_argument("--gone", choices=["timeout", "cancel"], default="timeout", help="how callers give up")
    parser.add_argument("--live", action="store_true", help="also run the burst against a live worker (sleep handler)")
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    record: dict[str, Any] = {"bench": "abandoned", "deadline_s": args.deadline_s, "gone": args.gone, "simulated": simulated(args.deadline_s, args.gone)}
    if args.live:
        record["live"] = live(args.deadline_s, args.gone)
    harness.emit(record, args.json)


if __name__ == "__main__":
    main()
