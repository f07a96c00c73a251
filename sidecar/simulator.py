"""A discrete-event simulator of one device serving many model queues, driving the same
scheduling policies as the live worker (sidecar.scheduler).

Workloads are TOML or JSON files (see docs/scheduler.md and examples/workloads/):

    [budget]
    max_models = 1                      # and/or max_bytes

    [models.m1]
    load_s = 0.5                        # device seconds to load
    batch_fixed_s = 0.005               # per batch
    batch_item_s = 0.0001               # per request
    max_batch_size = 16
    max_wait_s = 2.0
    memory_bytes = 1

    [arrivals]
    kind = "burst"                      # burst | poisson | trace
    per_model = 64                      # burst: requests per model, interleaved m1, m2, ... m1, m2
    # poisson: rate = 100.0 (req/s) or utilization = 0.7; duration_s = 60; mix = {m1 = 0.5, m2 = 0.5}
    #          or zipf = 1.1 (popularity by model order); seed = 1
    # trace:   path = "trace.jsonl" (lines {"t": seconds, "model": "m1"}, relative to this file)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .policy import scheduling as sched

__all__ = [
    "SimModel",
    "SimResult",
    "Workload",
    "add_arguments",
    "load_workload",
    "lower_bound",
    "run",
    "simulate",
]


@dataclass(frozen=True)
class SimModel:
    name: str
    load_s: float
    batch_fixed_s: float
    batch_item_s: float
    max_batch_size: int
    max_wait_s: float = 2.0
    memory_bytes: int = 1

    def batch_s(self, n: int) -> float:
        return self.batch_fixed_s + self.batch_item_s * n


@dataclass(frozen=True)
class Workload:
    models: dict[str, SimModel]
    arrivals: tuple[tuple[float, str], ...]  # (time, model), sorted by time
    budget: sched.Budget = sched.Budget(max_models=1)
    closed: bool = False  # every request present at t=0 (a burst)
    resident_at_start: tuple[str, ...] = ()


@dataclass
class SimResult:
    policy: str
    completed: int = 0
    makespan_s: float = 0.0
    loads: int = 0
    load_seconds: float = 0.0
    load_log: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, model
    batches: list[tuple[float, float, str, int, bool]] = field(default_factory=list)  # start, end, model, size, loaded
    latencies_s: list[float] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)
    offered_s: float = 0.0  # span of the arrivals
    max_resident_seen: int = 0
    max_bytes_seen: int = 0
    served_ids: list[int] = field(default_factory=list)
    late_beyond_bound: int = 0  # requests whose wait exceeded max_wait + one load + one batch

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000

    def summary(self, workload: Workload) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "completed": self.completed,
            "makespan_s": self.makespan_s,
            "throughput_rps": self.completed / self.makespan_s if self.makespan_s else 0.0,
            "loads": self.loads,
            "loads_per_minute": self.loads / (self.makespan_s / 60) if self.makespan_s else 0.0,
            "loads_per_1000": 1000 * self.loads / self.completed if self.completed else 0.0,
            "load_seconds": self.load_seconds,
            "load_s_per_1000": 1000 * self.load_seconds / self.completed if self.completed else 0.0,
            "mean_batch": statistics.mean(b[3] for b in self.batches) if self.batches else 0.0,
            "p50_ms": self.percentile_ms(50),
            "p95_ms": self.percentile_ms(95),
            "p99_ms": self.percentile_ms(99),
            "max_wait_ms": max(self.waits_s) * 1000 if self.waits_s else 0.0,
        }
        if workload.closed:
            bound = lower_bound(workload)
            out["lower_bound_s"] = bound
            out["ratio_to_bound"] = self.makespan_s / bound if bound else float("nan")
        else:
            out["offered_rps"] = len(workload.arrivals) / self.offered_s if self.offered_s else 0.0
        return out


def lower_bound(workload: Workload) -> float:
    """Offline lower bound of a closed burst: each model with work loaded once (unless resident at
    the start) plus ceil(n / max_batch) batch overheads plus n per-item costs."""
    counts: dict[str, int] = {}
    for _, model in workload.arrivals:
        counts[model] = counts.get(model, 0) + 1
    total = 0.0
    for name, n in counts.items():
        m = workload.models[name]
        if name not in workload.resident_at_start:
            total += m.load_s
        total += math.ceil(n / m.max_batch_size) * m.batch_fixed_s + n * m.batch_item_s
    return total


def simulate(workload: Workload, policy: sched.Policy | str, *, max_events: int = 5_000_000) -> SimResult:
    """Run ``workload`` under ``policy``; the policy sees exact costs and queue states."""
    if isinstance(policy, str):
        policy = sched.make_policy(policy)
    result = SimResult(policy=policy.name)
    arrivals = list(workload.arrivals)
    if arrivals:
        result.offered_s = max(arrivals[-1][0], 1e-9)
    queues: dict[str, deque[tuple[float, int]]] = {name: deque() for name in workload.models}
    arrival_log: deque[tuple[float, int, str]] = deque()  # global arrival order of waiting requests
    served: set[int] = set()
    resident: set[str] = set(workload.resident_at_start)
    fresh: set[str] = set()
    current: str | None = None
    last_used: dict[str, float] = {}
    t = 0.0
    i = 0
    events = 0
    total = len(arrivals)
    while result.completed < total:
        events += 1
        if events > max_events:
            raise RuntimeError(f"simulation of {policy.name} did not finish within {max_events} decisions")
        while i < total and arrivals[i][0] <= t + 1e-12:
            at, model = arrivals[i]
            queues[model].append((at, i))
            arrival_log.append((at, i, model))
            i += 1
        while arrival_log and arrival_log[0][1] in served:
            arrival_log.popleft()
        state = sched.SchedulerState(
            models={
                name: sched.ModelState(
                    name=name,
                    backlog=len(queues[name]),
                    oldest_enqueued_at=queues[name][0][0] if queues[name] else None,
                    resident=name in resident,
                    load_cost_s=m.load_s,
                    batch_cost=sched.BatchCost(m.batch_fixed_s, m.batch_item_s),
                    memory_bytes=m.memory_bytes,
                    max_batch_size=m.max_batch_size,
                    max_wait_s=m.max_wait_s,
                    last_used_at=last_used.get(name),
                )
                for name, m in workload.models.items()
            },
            current=current,
            budget=workload.budget,
            arrival_order=_head_order(arrival_log, served) if policy.name == "fifo" else None,
        )
        decision = policy.decide(state, t)
        if isinstance(decision, sched.Serve):
            m = workload.models[decision.model]
            if decision.model not in resident:
                raise RuntimeError(f"{policy.name} served non-resident model {decision.model}")
            q = queues[decision.model]
            n = min(decision.max_items, m.max_batch_size, len(q))
            if n == 0:
                t = _next_time(t, arrivals, i)
                continue
            batch = [q.popleft() for _ in range(n)]
            start = t
            t += m.batch_s(n)
            for at, rid in batch:
                wait = start - at
                result.waits_s.append(wait)
                result.latencies_s.append(t - at)
                served.add(rid)
                result.served_ids.append(rid)
                if wait > m.max_wait_s + m.load_s + m.batch_s(m.max_batch_size) + 1e-9:
                    result.late_beyond_bound += 1
            result.completed += n
            result.batches.append((start, t, m.name, n, m.name in fresh))
            fresh.discard(m.name)
            current = m.name
            last_used[m.name] = t
            policy.on_batch_done(m.name, n, t)
        elif isinstance(decision, sched.Load):
            for victim in decision.evict:
                resident.discard(victim)
                fresh.discard(victim)
                policy.on_evicted(victim, t)
            m = workload.models[decision.model]
            if decision.model not in resident:
                result.load_log.append((t, t + m.load_s, m.name))
                t += m.load_s
                result.load_seconds += m.load_s
                resident.add(decision.model)
                fresh.add(decision.model)
                result.loads += 1
            result.max_resident_seen = max(result.max_resident_seen, len(resident))
            result.max_bytes_seen = max(result.max_bytes_seen, sum(workload.models[r].memory_bytes for r in resident))
            current = decision.model
            policy.on_loaded(decision.model, t)
        else:
            nxt = arrivals[i][0] if i < total else math.inf
            if any(queues.values()):
                t = max(min(decision.until, nxt), t + 1e-6)  # a gather window, or a policy pausing
            elif nxt == math.inf:
                break
            else:
                t = max(nxt, t)  # nothing queued: jump to the next arrival
    result.makespan_s = t
    return result


def _head_order(log: deque[tuple[float, int, str]], served: set[int], limit: int = 256) -> tuple[str, ...]:
    """Models of the first ``limit`` waiting requests, in arrival order."""
    order: list[str] = []
    for _, rid, model in log:
        if rid not in served:
            order.append(model)
            if len(order) >= limit:
                break
    return tuple(order)


def _next_time(t: float, arrivals: Sequence[tuple[float, str]], i: int) -> float:
    return arrivals[i][0] if i < len(arrivals) else t + 1e-3


# --- workloads ---------------------------------------------------------------------------------


def load_workload(path: str | Path) -> Workload:
    """Read a workload file (TOML or JSON); raises ValueError with the file and key on errors."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: cannot read: {exc}") from None
    try:
        raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{p}: invalid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
    try:
        return build_workload(raw, base=p.parent)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{p}: {exc}") from None


def build_workload(raw: dict[str, Any], base: Path = Path(".")) -> Workload:
    models = {}
    for name, m in raw["models"].items():
        models[name] = SimModel(
            name=name,
            load_s=float(m["load_s"]),
            batch_fixed_s=float(m.get("batch_fixed_s", 0.005)),
            batch_item_s=float(m.get("batch_item_s", 0.0001)),
            max_batch_size=int(m.get("max_batch_size", 16)),
            max_wait_s=float(m.get("max_wait_s", 2.0)),
            memory_bytes=int(m.get("memory_bytes", 1)),
        )
    b = raw.get("budget", {})
    budget = sched.Budget(max_bytes=b.get("max_bytes"), max_models=b.get("max_models", 1 if "max_bytes" not in b else None))
    arr = raw.get("arrivals", {"kind": "burst"})
    kind = arr.get("kind", "burst")
    names = list(models)
    if kind == "burst":
        per_model = int(arr.get("per_model", 64))
        arrivals = tuple((0.0, names[k % len(names)]) for k in range(per_model * len(names)))
        closed = True
    elif kind == "poisson":
        rng = random.Random(int(arr.get("seed", 1)))
        if "mix" in arr:
            weights = [float(arr["mix"].get(n, 0.0)) for n in names]
        elif "zipf" in arr:
            weights = [1.0 / (k + 1) ** float(arr["zipf"]) for k in range(len(names))]
        else:
            weights = [1.0] * len(names)
        total_w = sum(weights)
        weights = [w / total_w for w in weights]
        if "rate" in arr:
            rate = float(arr["rate"])
        else:
            rate = float(arr.get("utilization", 0.7)) * capacity_rps(models, weights)
        duration = float(arr.get("duration_s", 60.0))
        t, out = 0.0, []
        while True:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            out.append((t, rng.choices(names, weights)[0]))
        arrivals = tuple(out)
        closed = False
    elif kind == "trace":
        lines = (base / arr["path"]).read_text().splitlines()
        out = []
        for n, line in enumerate(lines, 1):
            if line.strip():
                rec = json.loads(line)
                if rec["model"] not in models:
                    raise ValueError(f"trace line {n}: unknown model {rec['model']!r}")
                out.append((float(rec["t"]), str(rec["model"])))
        arrivals = tuple(sorted(out))
        closed = False
    else:
        raise ValueError(f"arrivals.kind: expected burst, poisson or trace, got {kind!r}")
    return Workload(models=models, arrivals=arrivals, budget=budget, closed=closed)


def capacity_rps(models: dict[str, SimModel], weights: Sequence[float]) -> float:
    """Requests/s the device sustains in full batches, ignoring loads (the utilisation reference)."""
    per_request_s = sum(
        w * m.batch_s(m.max_batch_size) / m.max_batch_size for w, m in zip(weights, models.values())
    )
    return 1.0 / per_request_s


# --- CLI ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="workload file (TOML or JSON)")
    parser.add_argument("--policy", default="all", help=f"comma list of {', '.join(sched.POLICIES)}, or all")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default=None, help="PNG with a residency and batch timeline per policy")


def run(args: argparse.Namespace) -> int:
    try:
        workload = load_workload(args.workload)
        names = list(sched.POLICIES) if args.policy == "all" else [p.strip() for p in args.policy.split(",")]
        results = [simulate(workload, sched.make_policy(n)) for n in names]
    except ValueError as exc:
        print(f"jetbatch simulate: {exc}", file=sys.stderr)
        return 2
    rows = [r.summary(workload) for r in results]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows, workload)
    if args.plot:
        plot(results, workload, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def print_table(rows: list[dict[str, Any]], workload: Workload) -> None:
    cols = ["policy", "makespan_s", "throughput_rps", "loads", "mean_batch", "p50_ms", "p95_ms", "p99_ms", "max_wait_ms"]
    if workload.closed:
        cols += ["lower_bound_s", "ratio_to_bound"]
    print("  ".join(f"{c:>14}" for c in cols))
    for row in rows:
        print("  ".join(f"{row[c]:>14.3f}" if isinstance(row[c], float) else f"{row[c]:>14}" for c in cols))


def plot(results: list[SimResult], workload: Workload, path: str) -> None:
    """One timeline per policy: a bar per batch on its model's row, a tick per load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(workload.models)
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 1.1 * len(results) * max(1, len(models) / 3)), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        for start, end, model in res.load_log:
            y = models.index(model)
            ax.barh(y, end - start, left=start, height=0.6, color="lightgray", hatch="//", edgecolor="gray")
        for start, end, model, size, loaded in res.batches:
            y = models.index(model)
            ax.barh(y, max(end - start, 1e-4), left=start, height=0.6, color=f"C{y}")
            if loaded:
                ax.plot([start], [y], marker="|", color="black", markersize=10)
        ax.set_yticks(range(len(models)), models)
        ax.set_xlim(left=0)
        ax.set_title(f"{res.policy}: {res.loads} loads, makespan {res.makespan_s:.2f} s", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (s); hatched = model load, coloured = batches, | = batch that paid a load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
