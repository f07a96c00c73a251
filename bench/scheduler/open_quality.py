"""Open-traffic quality of the cost-aware policy against exhaustive service, simulator only.

One slot, 8 models with load costs spread geometrically over 0.1-2 s (batch costs grow with
the load cost), Zipf 1.1 popularity shuffled against cost per seed, Poisson and on/off arrivals
at ρ = 0.7. For each seed both policies run on the same trace; the record gives, per arrival
kind, the median over seeds of cost-aware ÷ exhaustive mean and p99 latency, beside the
targets of issue 51 (mean ≤ 0.9×, p99 ≤ 0.8×). Each run is deterministic, so two commits
compare seed by seed.

    python -m bench.scheduler.open_quality                          # 8 seeds, 600 s, on/off 20 s / 20 s (~1-2 min on 2 cores)
    python -m bench.scheduler.open_quality --on 10 --off 10         # the on/off period nearer the cycle
    python -m bench.scheduler.open_quality --seeds 2 --duration 120 --json out.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from jetbatch.sidecar.simulator import Workload, build_workload, simulate

from bench.harness import emit
from bench.harness.simulated import open_models

N_MODELS = 8
TARGET_MEAN = 0.9
TARGET_P99 = 0.8


def models(seed: int, n: int = N_MODELS) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """The models (loads 0.1-2 s, cheapest first) and a Zipf mix whose ranks are shuffled by
    ``seed``, so popularity is unrelated to load cost and each seed is a different pairing."""
    return open_models("unrelated", seed, n=n, min_load_s=0.1)


def workload(kind: str, seed: int, *, rho: float, duration_s: float, on_s: float, off_s: float) -> Workload:
    spec, mix = models(seed)
    arrivals: dict[str, Any] = {"kind": kind, "utilization": rho, "duration_s": duration_s, "mix": mix, "seed": seed}
    if kind == "onoff":
        arrivals.update(on_s=on_s, off_s=off_s)
    return build_workload({"models": spec, "budget": {"max_models": 1}, "arrivals": arrivals})


def run(*, kinds: list[str], seeds: int, rho: float = 0.7, duration_s: float = 600.0, on_s: float = 20.0, off_s: float = 20.0) -> dict[str, Any]:
    """One record: per kind, the per-seed ratios and their medians (cost-aware ÷ exhaustive)."""
    record: dict[str, Any] = {
        "bench": "open_quality", "rho": rho, "duration_s": duration_s, "seeds": seeds, "models": N_MODELS,
        "on_s": on_s, "off_s": off_s, "target_mean_ratio": TARGET_MEAN, "target_p99_ratio": TARGET_P99,
    }  # fmt: skip
    for kind in kinds:
        mean_r, p99_r = [], []
        for seed in range(1, seeds + 1):
            w = workload(kind, seed, rho=rho, duration_s=duration_s, on_s=on_s, off_s=off_s)
            ex = simulate(w, "exhaustive").summary(w)
            ca = simulate(w, "cost-aware").summary(w)
            mean_r.append(ca["mean_ms"] / ex["mean_ms"])
            p99_r.append(ca["p99_ms"] / ex["p99_ms"])
        mean, p99 = statistics.median(mean_r), statistics.median(p99_r)
        record[kind] = {
            "mean_ratio": mean, "p99_ratio": p99, "mean_ratios": mean_r, "p99_ratios": p99_r,
            "met": mean <= TARGET_MEAN and p99 <= TARGET_P99,
        }  # fmt: skip
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals")
    ap.add_argument("--rho", type=float, default=0.7)
    ap.add_argument("--kinds", default="poisson,onoff")
    ap.add_argument("--on", type=float, default=20.0, help="on/off: seconds on")
    ap.add_argument("--off", type=float, default=20.0, help="on/off: seconds off")
    ap.add_argument("--json", help="append the record here")
    args = ap.parse_args()
    record = run(kinds=args.kinds.split(","), seeds=args.seeds, rho=args.rho, duration_s=args.duration, on_s=args.on, off_s=args.off)
    emit(record, args.json)


if __name__ == "__main__":
    main()
