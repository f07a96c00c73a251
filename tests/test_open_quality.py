"""bench.scheduler.open_quality on a tiny run: the record carries, per arrival kind, the cost-aware ÷
exhaustive ratios the open-traffic targets are read from, and a run replays exactly (the bisect
over commits compares seed by seed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.scheduler import open_quality


def test_tiny_run_reports_ratios_per_kind(tmp_path: Path) -> None:
    record = open_quality.run(kinds=["poisson", "onoff"], seeds=2, duration_s=60.0, on_s=10.0, off_s=10.0)
    for kind in ("poisson", "onoff"):
        cell = record[kind]
        assert len(cell["mean_ratios"]) == len(cell["p99_ratios"]) == 2
        for key in ("mean_ratio", "p99_ratio"):
            assert math.isfinite(cell[key]) and cell[key] > 0
        assert cell["met"] == (cell["mean_ratio"] <= open_quality.TARGET_MEAN and cell["p99_ratio"] <= open_quality.TARGET_P99)
    out = tmp_path / "q.jsonl"
    open_quality.emit(record, str(out))
    assert json.loads(out.read_text())["onoff"]["mean_ratio"] == record["onoff"]["mean_ratio"]


def test_a_run_is_deterministic_per_seed() -> None:
    first = open_quality.run(kinds=["onoff"], seeds=1, duration_s=40.0, on_s=10.0, off_s=10.0)
    again = open_quality.run(kinds=["onoff"], seeds=1, duration_s=40.0, on_s=10.0, off_s=10.0)
    assert first["onoff"]["mean_ratios"] == again["onoff"]["mean_ratios"]


def test_the_family_is_eight_models_over_the_load_range_with_shuffled_popularity() -> None:
    spec, mix = open_quality.models(1)
    loads = sorted(m["load_cost_s"] for m in spec.values())
    assert len(spec) == 8 and loads[0] == 0.1 and loads[-1] == 2.0
    # Popularity is shuffled against cost: another seed pairs ranks with models differently.
    assert mix != open_quality.models(2)[1] and sorted(mix.values()) == sorted(open_quality.models(2)[1].values())
