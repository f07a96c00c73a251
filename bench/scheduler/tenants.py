"""Fair shares between tenants (docs/tenancy.md), simulated: the flood and the weights of issue 54.

Four models on one slot (0.5 s loads, batches of 16 at 20 ms + 2 ms a request); the
classifier's admission rule (sidecar/tenancy.py) decides each request's line, the worker core
serves the lines. Three scenarios, each with the same seeds side by side:

- **flood**: tenants a and b at 35% of capacity each (70% load); then a sends 10x for
  ``--flood-s``. Figures: b's p99 with the flood ÷ b's p99 without it (shares on), the same with
  first come, first served; b's part of the requests served during the arrival window ÷ its fair
  part (max-min: what it asked, up to half); throughput with shares ÷ first come, first served;
  requests lost (sent and never answered nor refused).
- **weights**: a (weight 3) and b (weight 1) each sending the whole capacity: a's share of
  service over the arrival window ÷ 0.75.
- **one tenant**: a workload with one tenant against the same without tenants: the batches must
  be identical (the rule changes nothing with one tenant).

    python -m bench.scheduler.tenants                       # ~1 min on 2 cores
    python -m bench.scheduler.tenants --seeds 3 --json out.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from jetbatch.sidecar.simulator import build_workload, simulate

from bench.harness import emit

MODELS = {f"m{k}": {"load_cost_s": 0.5, "batch_cost_s": 0.02, "item_cost_s": 0.002, "max_batch_size": 16} for k in range(4)}
TARGET_P99_RATIO = 1.2
TARGET_SHARE = 0.10  # within 10% of the fair share
TARGET_THROUGHPUT = 0.95


def _run(tenants: dict[str, Any], *, seed: int, duration_s: float, shares: bool = True) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "models": MODELS,
        "arrivals": {"kind": "poisson", "duration_s": duration_s, "seed": seed},
        "tenants": tenants,
        "tenancy": {"enabled": shares},
    }
    w = build_workload(raw)
    r = simulate(w, "cost-aware")
    out = r.summary(w)
    out["lost"] = len(w.arrivals) - (r.completed + r.deadline_exceeded + r.cancelled + sum(r.refused_by_tenant.values()))
    return out


def flood(seed: int, *, duration_s: float, flood_s: float) -> dict[str, Any]:
    calm = {"a": {"utilization": 0.35}, "b": {"utilization": 0.35}}
    surge = {"factor": 10, "start_s": (duration_s - flood_s) / 2, "duration_s": flood_s}
    flooded = {"a": {"utilization": 0.35, "surge": surge}, "b": {"utilization": 0.35}}
    base = _run(calm, seed=seed, duration_s=duration_s)
    shared = _run(flooded, seed=seed, duration_s=duration_s)
    fcfs = _run(flooded, seed=seed, duration_s=duration_s, shares=False)
    b, a = shared["by_tenant"]["b"], shared["by_tenant"]["a"]
    # Max-min over the arrival window: b's fair part of what was served then is what it asked,
    # up to half (equal weights); its share is the part of those requests that were its own.
    served = a["window_completed"] + b["window_completed"]
    fair_b = min(b["offered"], served / 2) / served
    share_b = b["window_completed"] / served
    return {
        "b_p99_ratio": b["p99_ms"] / base["by_tenant"]["b"]["p99_ms"],
        "b_p99_ratio_fcfs": fcfs["by_tenant"]["b"]["p99_ms"] / base["by_tenant"]["b"]["p99_ms"],
        "b_p50_ratio": b["p50_ms"] / base["by_tenant"]["b"]["p50_ms"],
        "b_share_ratio": share_b / fair_b,
        "throughput_ratio": shared["throughput_rps"] / fcfs["throughput_rps"],
        "a_demoted": shared["by_tenant"]["a"]["demoted"],
        "b_demoted": b["demoted"],
        "loads": shared["loads"],
        "loads_fcfs": fcfs["loads"],
        "lost": shared["lost"] + fcfs["lost"] + base["lost"],
    }


def weights(seed: int, *, duration_s: float) -> dict[str, Any]:
    shared = _run({"a": {"utilization": 1.0, "weight": 3}, "b": {"utilization": 1.0}}, seed=seed, duration_s=duration_s)
    return {"a_share": shared["by_tenant"]["a"]["window_service_share"], "a_share_ratio": shared["by_tenant"]["a"]["window_service_share"] / 0.75}


def one_tenant(seed: int, *, duration_s: float) -> bool:
    arrivals = {"kind": "poisson", "duration_s": duration_s, "utilization": 0.6, "seed": seed}
    plain = simulate(build_workload({"models": MODELS, "arrivals": arrivals}), "cost-aware")
    # A tenant's stream is drawn with the seed moved by 7919 (workloads.py): moved back here.
    one = build_workload({"models": MODELS, "arrivals": {**arrivals, "seed": seed - 7919}, "tenants": {"a": {"utilization": 0.6}}})
    return [b[:4] for b in simulate(one, "cost-aware").batches] == [b[:4] for b in plain.batches]


def run(*, seeds: int, duration_s: float, flood_s: float) -> dict[str, Any]:
    floods = [flood(s, duration_s=duration_s, flood_s=flood_s) for s in range(1, seeds + 1)]
    weighted = [weights(s, duration_s=duration_s / 2) for s in range(1, seeds + 1)]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    record: dict[str, Any] = {
        "bench": "tenants", "seeds": seeds, "duration_s": duration_s, "flood_s": flood_s,
        "flood": {k: med(floods, k) for k in floods[0]},
        "flood_runs": floods,
        "weights": {k: med(weighted, k) for k in weighted[0]},
        "one_tenant_identical": all(one_tenant(s, duration_s=60) for s in range(1, seeds + 1)),
        "targets": {"b_p99_ratio": TARGET_P99_RATIO, "share_within": TARGET_SHARE, "throughput_ratio": TARGET_THROUGHPUT},
    }  # fmt: skip
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=180.0, help="simulated seconds of arrivals")
    ap.add_argument("--flood-s", type=float, default=60.0, help="how long tenant a sends 10x")
    ap.add_argument("--json", help="append the record here")
    args = ap.parse_args()
    emit(run(seeds=args.seeds, duration_s=args.duration, flood_s=args.flood_s), args.json)


if __name__ == "__main__":
    main()
