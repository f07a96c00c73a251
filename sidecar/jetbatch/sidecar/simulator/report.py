"""What a simulation measured, and how it is shown: summaries (JSON), a table, a timeline plot."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .workloads import Workload

from ..percentiles import percentile

__all__ = ["SimResult", "format_table", "lower_bound", "plot", "print_table", "timeline_figure"]


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q / 100)


@dataclass
class SimResult:
    policy: str
    completed: int = 0
    deadline_exceeded: int = 0
    makespan_s: float = 0.0
    loads: int = 0
    load_seconds: float = 0.0
    load_log: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, model
    batches: list[tuple[float, float, str, int, bool]] = field(default_factory=list)  # start, end, model, size, loaded
    latencies_s: list[float] = field(default_factory=list)
    latency_by_model: dict[str, list[float]] = field(default_factory=dict)
    latency_by_class: dict[str, list[float]] = field(default_factory=dict)  # when the workload gives classes
    waits_s: list[float] = field(default_factory=list)
    completions: list[tuple[float, float]] = field(default_factory=list)  # (completed at, arrived at)
    offered_s: float = 0.0  # the arrival window
    max_resident_seen: int = 0
    max_bytes_seen: int = 0
    served_ids: list[int] = field(default_factory=list)
    late_beyond_bound: int = 0  # requests whose wait exceeded max_wait + one load + one batch
    idle_unloads: int = 0  # resident models evicted for idleness (models.<m>.idle_unload_s)
    reaped_queues: int = 0  # queues whose callers had all given up, answered without a load
    cancelled: int = 0  # requests not computed because their callers cancelled them
    # Per tenant, when the workload has tenants (docs/tenancy.md): requests sent, answered
    # latencies, device seconds of the batches that served them (split evenly within a batch),
    # refused by a quota, moved to the batch line beyond a fair share.
    offered_by_tenant: dict[str, int] = field(default_factory=dict)
    latency_by_tenant: dict[str, list[float]] = field(default_factory=dict)
    service_s_by_tenant: dict[str, float] = field(default_factory=dict)
    window_service_s_by_tenant: dict[str, float] = field(default_factory=dict)  # of batches started while arrivals came
    window_completed_by_tenant: dict[str, int] = field(default_factory=dict)  # requests in those batches
    refused_by_tenant: dict[str, int] = field(default_factory=dict)
    demoted_by_tenant: dict[str, int] = field(default_factory=dict)

    def percentile_ms(self, q: float) -> float:
        return _pct(self.latencies_s, q) * 1000

    arrivals_second_half: int = 0  # arrivals in the second half of the arrival window

    def served_fraction(self) -> float:
        """Completions over arrivals in the second half of the arrival window: about 1 when the
        system keeps up, less when queues grow without bound."""
        if not self.offered_s or not self.arrivals_second_half:
            return 1.0
        half = self.offered_s / 2
        done = sum(1 for end, _ in self.completions if half <= end < self.offered_s)
        return done / self.arrivals_second_half

    def summary(self, workload: "Workload") -> dict[str, Any]:
        per_model = {m: _pct(v, 99) * 1000 for m, v in sorted(self.latency_by_model.items())}
        out: dict[str, Any] = {
            "policy": self.policy,
            "completed": self.completed,
            "deadline_exceeded": self.deadline_exceeded,
            "makespan_s": self.makespan_s,
            "throughput_rps": self.completed / self.makespan_s if self.makespan_s else 0.0,
            "loads": self.loads,
            "idle_unloads": self.idle_unloads,
            "reaped_queues": self.reaped_queues,
            "cancelled": self.cancelled,
            "loads_per_minute": self.loads / (self.makespan_s / 60) if self.makespan_s else 0.0,
            "load_seconds": self.load_seconds,
            "mean_batch": statistics.mean(b[3] for b in self.batches) if self.batches else 0.0,
            "mean_ms": statistics.mean(self.latencies_s) * 1000 if self.latencies_s else float("nan"),
            "p50_ms": self.percentile_ms(50),
            "p95_ms": self.percentile_ms(95),
            "p99_ms": self.percentile_ms(99),
            "max_ms": max(self.latencies_s) * 1000 if self.latencies_s else float("nan"),
            "max_wait_ms": max(self.waits_s) * 1000 if self.waits_s else 0.0,
            "p99_ms_by_model": per_model,
            "worst_model_p99_ms": max(per_model.values()) if per_model else float("nan"),
        }
        if self.latency_by_class:
            out["by_class"] = {
                c: {"completed": len(v), "p50_ms": _pct(v, 50) * 1000, "p99_ms": _pct(v, 99) * 1000, "max_ms": max(v) * 1000}
                for c, v in sorted(self.latency_by_class.items())
            }
        if self.offered_by_tenant:
            out["by_tenant"] = self.tenant_summary()
        if workload.closed:
            bound = lower_bound(workload)
            out["lower_bound_s"] = bound
            out["ratio_to_bound"] = self.makespan_s / bound if bound else float("nan")
        else:
            out["offered_rps"] = len(workload.arrivals) / self.offered_s if self.offered_s else 0.0
            out["served_fraction"] = self.served_fraction()
        return out


    def tenant_summary(self) -> dict[str, dict[str, float]]:
        """Per tenant: sent, answered, p50/p99, share of the device's service seconds (over the
        run, and over the arrival window, while tenants contend), refused by a quota, moved to the
        batch line."""
        total_s = sum(self.service_s_by_tenant.values())
        window_s = sum(self.window_service_s_by_tenant.values())
        out: dict[str, dict[str, float]] = {}
        for t in sorted(self.offered_by_tenant):
            lat = self.latency_by_tenant.get(t, [])
            out[t] = {
                "offered": self.offered_by_tenant[t],
                "completed": len(lat),
                "p50_ms": _pct(lat, 50) * 1000 if lat else float("nan"),
                "p99_ms": _pct(lat, 99) * 1000 if lat else float("nan"),
                "service_share": self.service_s_by_tenant.get(t, 0.0) / total_s if total_s else 0.0,
                "window_service_share": self.window_service_s_by_tenant.get(t, 0.0) / window_s if window_s else 0.0,
                "window_completed": self.window_completed_by_tenant.get(t, 0),
                "refused": self.refused_by_tenant.get(t, 0),
                "demoted": self.demoted_by_tenant.get(t, 0),
            }
        return out


def lower_bound(workload: "Workload") -> float:
    """Offline lower bound of a closed burst: each model with work loaded once (unless resident at
    the start) plus ceil(n / max_batch) batch overheads plus n per-item costs."""
    counts: dict[str, int] = {}
    for _, model in workload.arrivals:
        counts[model] = counts.get(model, 0) + 1
    total = 0.0
    for name, n in counts.items():
        m = workload.models[name]
        if name not in workload.resident_at_start:
            total += m.load_cost_s
        total += math.ceil(n / m.max_batch_size) * m.batch_cost_s + n * m.item_cost_s
    return total


# (summary key, column header): short headers, each column as wide as its widest cell, so the
# table fits a terminal (under 100 columns).
_COLUMNS = [
    ("policy", "policy"), ("makespan_s", "makespan s"), ("loads", "loads"), ("mean_batch", "batch"),
    ("mean_ms", "mean s"), ("p50_ms", "p50 s"), ("p99_ms", "p99 s"), ("max_ms", "max s"), ("worst_model_p99_ms", "worst p99 s"),
]  # fmt: skip


def format_table(rows: list[dict[str, Any]], workload: "Workload") -> list[str]:
    """The policies side by side, one line each (``--json`` has every field)."""
    cols = _COLUMNS + ([("ratio_to_bound", "x bound")] if workload.closed else [("served_fraction", "served")])

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.2f}" if abs(value) < 1e5 else f"{value:.3g}"
        return str(value)

    # Latencies in seconds, like every other time here (the summary keeps milliseconds).
    cells = [[cell(row[key] / 1000 if key.endswith("_ms") else row[key]) for key, _ in cols] for row in rows]
    widths = [max([len(header)] + [len(r[i]) for r in cells]) for i, (_, header) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((_, h), w) in enumerate(zip(cols, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    if workload.closed and rows:
        lines.append(f"lower bound: {rows[0]['lower_bound_s']:.2f} s (every model loaded once, full batches)")
    if any("by_class" in row for row in rows):
        # Per priority class, one line per policy: p50 / p99 in seconds.
        for row in rows:
            parts = [f"{c} p50 {v['p50_ms'] / 1000:.2f} p99 {v['p99_ms'] / 1000:.2f}" for c, v in row.get("by_class", {}).items()]
            lines.append(f"{row['policy']}: " + "; ".join(parts))
    return lines


def print_table(rows: list[dict[str, Any]], workload: "Workload") -> None:
    for line in format_table(rows, workload):
        print(line)


# One colour per meaning (the row already names the model), shared by the bars and the legend.
LOAD_STYLE = {"facecolor": "lightgray", "hatch": "//", "edgecolor": "gray"}
BATCH_COLOR = "tab:blue"
LOADED_BATCH_COLOR = "tab:red"
MIN_BAR_FRACTION = 0.004  # of a panel's time span: a batch of a few ms in a 300 s run stays visible


def timeline_figure(results: list[SimResult], workload: "Workload") -> Any:
    """One timeline per policy, each on its own time axis from 0 to its makespan (written in its
    title), so the fastest policies are as readable as the slowest: a bar per batch on its
    model's row (at least ``MIN_BAR_FRACTION`` of the span wide), red when it paid a load, and
    each load hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    models = list(workload.models)
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.4 + (0.5 + 0.3 * len(models)) * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        end_s = max(res.makespan_s, 1e-3)
        min_width = end_s * MIN_BAR_FRACTION
        for start, end, model in res.load_log:
            ax.barh(models.index(model), end - start, left=start, height=0.6, **LOAD_STYLE)
        for start, end, model, size, loaded in res.batches:
            color = LOADED_BATCH_COLOR if loaded else BATCH_COLOR
            ax.barh(models.index(model), max(end - start, min_width), left=start, height=0.6, facecolor=color)
        ax.set_yticks(range(len(models)), models)
        ax.set_xlim(0, end_s)
        ax.set_title(f"{res.policy}: {res.loads} loads, makespan {res.makespan_s:.2f} s (own time axis)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (s)")
    handles = [
        Patch(label="model load", facecolor=LOAD_STYLE["facecolor"], hatch=LOAD_STYLE["hatch"], edgecolor=LOAD_STYLE["edgecolor"]),
        Patch(label="batch", facecolor=BATCH_COLOR),
        Patch(label="batch that paid a load", facecolor=LOADED_BATCH_COLOR),
    ]
    fig.legend(handles=handles, loc="upper right", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def plot(results: list[SimResult], workload: "Workload", path: str) -> None:
    """Write :func:`timeline_figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(results, workload)
    fig.savefig(path, dpi=100)
    plt.close(fig)
