"""Variants of the default policy's choice of the next model, against exhaustive, on the open-traffic
workloads of ``bench/scheduler/open.py`` (same traces, same simulator, one model slot).

The question it answers: can reweighting the cost-aware score reach the one-slot targets of the
open-traffic work (mean ≤ 0.9× and p99 ≤ 0.8× exhaustive on every family) where the default
misses them (the cheap-popular family, on/off arrivals)? Each variant changes only ``score``:

    score = backlog × age^b / (switch + work)^c × (1 + ageing × age / bound) × deadline factor

with ``work`` one batch (the default) or the whole backlog's drain time (``drain``), plus the
default policy's own options (``wait_cycles``, ...). Results are geometric means over seeds of the
variant ÷ exhaustive on the same trace, as in ``scheduler_open.py``. Run:

    python -m bench.scheduler.variants                       # the preset variants, 1 slot, ρ .5/.85
    python -m bench.scheduler.variants --variants '{"mine": {"b": 1.5, "c": 1.25}}' --rho 0.7
    python -m bench.scheduler.variants --memory "2 slots"

About 50 s per variant on one core (12 cells × 2 seeds × 600 s simulated).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from jetbatch.sidecar.policy.base import age, drain_seconds
from jetbatch.sidecar.policy.cost_aware import CostAware
from jetbatch.sidecar.policy.types import ModelState
from jetbatch.sidecar.simulator import simulate

from bench.harness.simulated import FAMILIES, open_workload

PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "no overdue override (wait_cycles ∞)": {"wait_cycles": 1e9},
    "wait_cycles 1": {"wait_cycles": 1.0},
    "ageing 4": {"ageing": 4.0},
    "age² (b 2)": {"b": 2.0},
    "cost² (c 2)": {"c": 2.0},
    "b 1.5, c 1.25": {"b": 1.5, "c": 1.25},
    "drain time, age²": {"drain": True, "b": 2.0},
}


class ScoreVariant(CostAware):
    """The default policy with a reweighted choice of the next model (see the module docstring)."""

    name = "cost-aware-variant"

    def __init__(self, *, b: float = 1.0, c: float = 1.0, ageing: float = 1.0, drain: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.b, self.c, self.ageing, self.drain = b, c, ageing, drain

    def score(self, m: ModelState, now: float, cycle_s: float) -> float:
        switch_s = 0.0 if m.resident else m.load_cost_s
        waited = m.backlog * (age(m, now) + 1e-3) ** self.b
        work_s = drain_seconds(m, m.backlog) if self.drain else m.batch_cost.batch_cost_s
        ageing = 1.0 + self.ageing * age(m, now) / self.bound_s(m, cycle_s)
        return waited / max(switch_s + work_s, 1e-6) ** self.c * ageing * self._deadline_factor(m, now, cycle_s, switch_s)


def _geo(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=None, help="JSON object: name → ScoreVariant options (default: the presets)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--kinds", default="poisson,onoff")
    ap.add_argument("--rho", default="0.5,0.85")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--memory", default="1 slot")
    ap.add_argument("--json", help="write every ratio here")
    args = ap.parse_args()
    variants: dict[str, dict[str, Any]] = json.loads(args.variants) if args.variants else PRESETS
    cells = [(f, k, float(r)) for f in args.families.split(",") for k in args.kinds.split(",") for r in args.rho.split(",")]
    started = time.perf_counter()
    ratios: dict[tuple[str, str, str, float], list[tuple[float, float, float]]] = {}
    for family, kind, rho in cells:
        for seed in range(1, args.seeds + 1):
            w = open_workload(family, args.memory, rho, kind, seed, args.duration)
            base = simulate(w, "exhaustive").summary(w)
            for name, options in variants.items():
                s = simulate(w, ScoreVariant(**options)).summary(w)
                ratios.setdefault((name, family, kind, rho), []).append(
                    (s["mean_ms"] / base["mean_ms"], s["p99_ms"] / base["p99_ms"], s["served_fraction"])
                )
        print(f"{family} {kind} ρ {rho}: done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    head = "| variant | " + " | ".join(f"{f} {k} {r}" for f, k, r in cells) + " | cells met | min served |"
    lines = [head, "|" + "---|" * (len(cells) + 3)]
    for name in variants:
        row, met, served = [], 0, []
        for family, kind, rho in cells:
            rs = ratios[(name, family, kind, rho)]
            mean_x, p99_x = _geo([r[0] for r in rs]), _geo([r[1] for r in rs])
            ok = mean_x <= 0.9 and p99_x <= 0.8
            met += ok
            served += [r[2] for r in rs]
            cell = f"{mean_x:.2f} / {p99_x:.2f}"
            row.append(f"**{cell}**" if ok else cell)
        lines.append(f"| {name} | " + " | ".join(row) + f" | {met} of {len(cells)} | {min(served):.2f} |")
    print(f"mean × / p99 × exhaustive ({args.memory}, {args.seeds} seeds, {args.duration:.0f} s simulated; bold: both targets met)")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({" | ".join(map(str, k)): v for k, v in ratios.items()}, indent=1))


if __name__ == "__main__":
    main()
