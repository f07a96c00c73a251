"""Placement at scale in the simulator: W workers sharing M model queues, each worker with its
own policy, estimator and cluster share, as the live workers run (docs/scaleout.md).

    python -m bench.scheduler.placement --workers 100 --models 1000 --duration 120

Models: load costs spread 0.2-2 s, Zipf(1.1) popularity, two resident slots per worker. The
offered load is a share of the fleet's full-batch capacity. Reports served/offered, latency,
loads per worker-minute, how often the most popular model was loaded (once per worker that took
it, if placement is stable), and the wall time of the simulation itself.
"""

from __future__ import annotations

import argparse
import json
import time

from jetbatch.sidecar.simulator import build_workload, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--utilization", type=float, default=0.5, help="share of the fleet's full-batch capacity offered")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--policy", default="cost-aware")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    models = {
        f"m{k:04d}": {
            "load_cost_s": round(0.2 + 1.8 * ((k * 7919) % args.models) / max(args.models - 1, 1), 3),
            "batch_cost_s": 0.02,
            "item_cost_s": 0.002,
            "max_batch_size": 16,
        }
        for k in range(args.models)
    }
    per_request_s = (0.02 + 16 * 0.002) / 16
    rate = args.utilization * args.workers / per_request_s
    w = build_workload({
        "models": models,
        "budget": {"max_models": args.slots},
        "workers": {"count": args.workers},
        "arrivals": {"kind": "poisson", "rate": rate, "duration_s": args.duration, "zipf": 1.1, "seed": 7},
    })  # fmt: skip
    started = time.perf_counter()
    res = simulate(w, args.policy)
    wall = time.perf_counter() - started
    s = res.summary(w)
    loads_by_model: dict[str, int] = {}
    for _start, _end, model in res.load_log:
        loads_by_model[model] = loads_by_model.get(model, 0) + 1
    out = {
        "workers": args.workers, "models": args.models, "slots": args.slots, "requests": len(w.arrivals),
        "offered_rps": round(rate, 1), "served_fraction": round(s["served_fraction"], 3),
        "mean_s": round(s["mean_ms"] / 1000, 2), "p99_s": round(s["p99_ms"] / 1000, 2),
        "loads_per_worker_minute": round(res.loads / args.workers / (res.makespan_s / 60), 2),
        "models_ever_loaded": len(loads_by_model),
        "loads_of_the_most_popular_model": loads_by_model.get("m0000", 0),
        "simulation_wall_s": round(wall, 1),
    }  # fmt: skip
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
