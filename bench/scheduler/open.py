"""The scheduler on open, heterogeneous traffic: every policy on the same arrival traces.

Workload families (ten models, load costs 0.12-2 s spaced geometrically, batch costs linear in
size, Zipf 1.1 popularity):

- ``cheap-popular``: the most popular models are the cheapest to load;
- ``costly-popular``: the most popular models are the most expensive to load;
- ``unrelated``: popularity shuffled against cost (seeded).

Arrivals are Poisson or on/off (20 s on, 20 s off, the same mean rate) at a utilisation ρ that
counts full-batch service work only; memory is 1, 2 or 3 model slots, or a byte budget of 40% of
all models' bytes (sizes proportional to load cost). Each cell runs several seeds; the tables
give geometric means over seeds of each policy's ratio to ``exhaustive`` on the same trace, plus
served/offered (completions over arrivals in the second half of the window: < 0.95 means queues
grow without bound).

    python -m bench.scheduler.open                      # the full grid (about 15 minutes on 2 cores)
    python -m bench.scheduler.open --quick              # one seed, 300 s, fewer cells
    python -m bench.scheduler.open --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from jetbatch.sidecar.simulator import simulate

from bench.harness.simulated import FAMILIES, MEMORY, nominal_cycle_s, open_workload

POLICIES = ("cost-aware", "exhaustive", "round-robin", "cost-aware-lru")
def run_cell(cell: tuple[str, str, float, str, int, float, tuple[str, ...]]) -> list[dict[str, Any]]:
    family, memory, rho, kind, seed, duration_s, policies = cell
    w = open_workload(family, memory, rho, kind, seed, duration_s)
    # The rarest model: its worst latency, to hold against the cycle.
    rare = min(w.models, key=lambda n: sum(1 for _, m in w.arrivals if m == n))
    cycle_s = nominal_cycle_s(w, rho)
    rows = []
    for policy in policies:
        started = time.perf_counter()
        res = simulate(w, policy)
        s = res.summary(w)
        rows.append(
            {
                "family": family, "memory": memory, "rho": rho, "kind": kind, "seed": seed, "policy": policy,
                "served": s["served_fraction"], "mean_s": s["mean_ms"] / 1000, "p99_s": s["p99_ms"] / 1000,
                "max_s": s["max_ms"] / 1000, "worst_model_p99_s": s["worst_model_p99_ms"] / 1000,
                "rare_max_s": max(res.latency_by_model.get(rare, [0.0])), "cycle_s": cycle_s,
                "loads_per_min": s["loads_per_minute"], "requests": len(w.arrivals),
                "sim_s": time.perf_counter() - started,
            }
        )
    return rows


def _geo(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(statistics.mean(math.log(v) for v in values)) if values else float("nan")


def tables(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> str:
    """The table of docs/benchmarks.md: every ratio is a geometric mean over seeds of the policy ÷
    exhaustive on the same trace; the rarest model's worst latency ÷ the nominal cycle is the worst
    seed's. The first policy other than exhaustive gets the full set of columns, the others their
    mean ratio and served share."""
    by_cell: dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        by_cell.setdefault((r["family"], r["memory"], r["kind"], r["rho"]), {}).setdefault(r["policy"], []).append(r)
    main_policy, *others = [p for p in policies if p != "exhaustive"] or ["exhaustive"]
    head = (
        f"| family | memory | arrivals | ρ | served: exhaustive / {main_policy} | exhaustive mean, p99 (s) "
        f"| {main_policy} mean × | p99 × | max × | worst-model p99 × | rarest model's max ÷ cycle: exhaustive / {main_policy} |"
    )
    for p in others:
        head += f" {p} mean × | {p} served |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for (family, memory, kind, rho), per in sorted(by_cell.items()):
        ex = sorted(per["exhaustive"], key=lambda r: r["seed"])

        def of(policy: str) -> list[dict[str, Any]]:
            return sorted(per.get(policy, []), key=lambda r: r["seed"])

        def ratio(policy: str, key: str) -> float:
            return _geo([a[key] / b[key] for a, b in zip(of(policy), ex) if b[key] > 0])

        def served(policy: str) -> float:
            return statistics.mean(r["served"] for r in of(policy))

        def rare(policy: str) -> float:
            return max(r["rare_max_s"] / r["cycle_s"] for r in of(policy))

        m = main_policy
        line = (
            f"| {family} | {memory} | {kind} | {rho:.2f} | {served('exhaustive'):.2f} / {served(m):.2f} "
            f"| {_geo([r['mean_s'] for r in ex]):.1f}, {_geo([r['p99_s'] for r in ex]):.1f} "
            f"| {ratio(m, 'mean_s'):.2f} | {ratio(m, 'p99_s'):.2f} | {ratio(m, 'max_s'):.2f} "
            f"| {ratio(m, 'worst_model_p99_s'):.2f} | {rare('exhaustive'):.2f} / {rare(m):.2f} |"
        )
        for p in others:
            line += f" {ratio(p, 'mean_s'):.2f} | {served(p):.2f} |"
        out.append(line)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 300 s, ρ .5/.85, Poisson only")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--memory", default=",".join(MEMORY))
    ap.add_argument("--rho", default="0.3,0.5,0.7,0.85")
    ap.add_argument("--kinds", default="poisson,onoff")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write every run's row here")
    ap.add_argument("--markdown", help="write the tables here")
    args = ap.parse_args()
    seeds, duration, rhos, kinds = args.seeds, args.duration, [float(x) for x in args.rho.split(",")], args.kinds.split(",")
    if args.quick:
        seeds, duration, rhos, kinds = 1, 300.0, [0.5, 0.85], ["poisson"]
    policies = tuple(args.policies.split(","))
    if "exhaustive" not in policies:
        policies = ("exhaustive", *policies)
    cells = [
        (f, m, rho, k, seed, duration, policies)
        for f, m, rho, k, seed in itertools.product(args.families.split(","), args.memory.split(","), rhos, kinds, range(1, seeds + 1))
    ]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for done, cell_rows in enumerate(pool.map(run_cell, cells), 1):
            rows.extend(cell_rows)
            print(f"\r{done}/{len(cells)} cells, {time.perf_counter() - started:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    text = tables(rows, policies)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
