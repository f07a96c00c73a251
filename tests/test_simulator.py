"""The simulator and `jetbatch simulate` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from jetbatch.sidecar.policy import HOLD_S
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.simulator import build_workload, load_workload, lower_bound, simulate
from jetbatch.sidecar.simulator.report import format_table
from jetbatch.sidecar.simulator.workloads import WorkloadError

ROOT = Path(__file__).resolve().parent.parent


def test_example_workloads_load() -> None:
    for path in (ROOT / "examples" / "workloads").glob("*.toml"):
        workload = load_workload(path)
        assert workload.arrivals and workload.models


def test_lower_bound_counts_loads_batches_and_items() -> None:
    w = build_workload({"models": {"a": {"load_cost_s": 1.0, "batch_cost_s": 0.01, "item_cost_s": 0.001, "max_batch_size": 4}},
                        "arrivals": {"kind": "burst", "per_model": 10}})  # fmt: skip
    assert lower_bound(w) == 1.0 + 3 * 0.01 + 10 * 0.001


def test_trace_workload(tmp_path: Path) -> None:
    (tmp_path / "trace.jsonl").write_text('{"t": 0.0, "model": "a"}\n{"t": 0.5, "model": "b"}\n{"t": 0.6, "model": "a"}\n')
    (tmp_path / "w.toml").write_text(
        '[models.a]\nload_cost_s = 0.1\n[models.b]\nload_cost_s = 0.1\n[arrivals]\nkind = "trace"\npath = "trace.jsonl"\n'
    )
    result = simulate(load_workload(tmp_path / "w.toml"), "cost-aware")
    assert result.completed == 3 and sorted(result.served_ids) == [0, 1, 2]


def test_priority_classes_from_a_share_or_a_trace(tmp_path: Path) -> None:
    """``interactive_share`` draws each request's class (the arrivals themselves unchanged); a
    trace names each record's; the summary and the table report latency per class."""
    raw = {"models": {"a": {"load_cost_s": 0.2}, "b": {"load_cost_s": 0.2}}, "arrivals": {"kind": "poisson", "rate": 20, "duration_s": 20, "seed": 4}}
    plain = build_workload(raw)
    classed = build_workload({**raw, "arrivals": {**raw["arrivals"], "interactive_share": 0.25}})
    assert classed.arrivals == plain.arrivals and plain.interactive == ()
    assert 0.1 < sum(classed.interactive) / len(classed.interactive) < 0.4
    summary = simulate(classed, "cost-aware").summary(classed)
    assert summary["by_class"]["interactive"]["completed"] == sum(classed.interactive)
    assert summary["by_class"]["batch"]["completed"] == len(classed.interactive) - sum(classed.interactive)
    assert any(line.startswith("cost-aware: batch p50") for line in format_table([summary], classed))
    (tmp_path / "trace.jsonl").write_text('{"t": 0.5, "model": "a", "priority": "batch"}\n{"t": 0.0, "model": "b"}\n')
    (tmp_path / "w.toml").write_text('[models.a]\nload_cost_s = 0.1\n[models.b]\nload_cost_s = 0.1\n[arrivals]\nkind = "trace"\npath = "trace.jsonl"\n')
    traced = load_workload(tmp_path / "w.toml")
    assert traced.arrivals == ((0.0, "b"), (0.5, "a")) and traced.interactive == (True, False)
    (tmp_path / "trace.jsonl").write_text('{"t": 0.5, "model": "a", "priority": "urgent"}\n')
    with pytest.raises(WorkloadError, match="line 1: priority must be one of interactive, batch"):
        load_workload(tmp_path / "w.toml")


def test_a_simulated_queue_serves_its_interactive_requests_first() -> None:
    """As the live worker's two lines: a model's batch-class requests queued first still wait
    behind its interactive ones."""
    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    models = {"a": {"load_cost_s": 0.1, "max_batch_size": 2, "batch_cost_s": 0.1, "item_cost_s": 0.0}}
    trace = [(0.0, "a")] * 4 + [(0.01, "a")] * 2
    workload = replace(build_workload({"models": models}), arrivals=tuple(trace), interactive=(False,) * 4 + (True,) * 2, control=IDEAL_CONTROL)
    result = simulate(workload, "cost-aware")
    assert [b[3] for b in result.batches] == [2, 2, 2]
    # The first batch formed after the interactive pair arrived is theirs.
    waits = result.summary(workload)["by_class"]
    assert waits["interactive"]["max_ms"] < waits["batch"]["max_ms"]


def test_requests_that_cannot_finish_in_time_are_not_computed() -> None:
    """Batches take 0.5 s: with 0.3 s deadlines nothing can finish, and only the probe batches
    (one after every PROBE_AFTER_REFUSALS refused whole, to keep measuring) are computed; with
    5 s deadlines every request is, as the live worker does."""
    def run(deadline_s: float) -> object:
        raw = {"models": {"a": {"load_cost_s": 0.0, "batch_cost_s": 0.5, "item_cost_s": 0.0, "deadline_s": deadline_s}},
               "arrivals": {"kind": "poisson", "rate": 1.0, "duration_s": 20, "seed": 2}}  # fmt: skip
        return simulate(build_workload(raw), "cost-aware")

    tight, loose = run(0.3), run(5.0)
    assert tight.deadline_exceeded > 0 and tight.completed <= len(tight.batches) <= tight.deadline_exceeded / 4  # type: ignore[attr-defined]
    assert loose.deadline_exceeded == 0 and loose.completed > 0  # type: ignore[attr-defined]


def test_a_deadline_closes_the_simulated_window_as_it_does_live() -> None:
    from dataclasses import replace

    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    def first_batch_start(deadline_s: float | None) -> float:
        model = {"load_cost_s": 0.0, "batch_cost_s": 0.01, "item_cost_s": 0.0, "max_batch_size": 16, "max_delay_s": 1.0}
        if deadline_s is not None:
            model["deadline_s"] = deadline_s
        raw = {"models": {"a": model}, "arrivals": {"kind": "burst", "per_model": 1}}
        result = simulate(replace(build_workload(raw), control=IDEAL_CONTROL, resident_at_start=("a",)), "cost-aware")
        return result.batches[0][0]

    assert first_batch_start(None) == pytest.approx(1.0)  # the full window
    assert first_batch_start(0.3) == pytest.approx(0.3 - 0.01)  # early enough to finish by the deadline


def test_simulate_cli_table_json_and_plot(tmp_path: Path) -> None:
    workload = ROOT / "examples" / "workloads" / "burst.toml"
    out = subprocess.run(
        [sys.executable, "-m", "jetbatch", "simulate", "--workload", str(workload), "--policy", "cost-aware,fifo", "--json",
         "--plot", str(tmp_path / "t.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout[: out.stdout.rindex("]") + 1])
    by_policy = {r["policy"]: r for r in rows}
    assert by_policy["cost-aware"]["ratio_to_bound"] <= 1.15
    assert by_policy["fifo"]["makespan_s"] >= 10 * by_policy["cost-aware"]["makespan_s"]
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_the_table_fits_a_terminal_and_each_plot_panel_has_its_own_time_axis() -> None:
    from jetbatch.sidecar.simulator.report import format_table, timeline_figure

    # The burst with the policy of the longest name and the slowest one (fifo's two-minute
    # makespan gives the widest cells): the 218-column table of before had 18 per column.
    workload = load_workload(ROOT / "examples" / "workloads" / "burst.toml")
    results = [simulate(workload, policy) for policy in ("cost-aware", "fifo", "longest-backlog")]
    lines = format_table([r.summary(workload) for r in results], workload)
    assert len(lines) >= len(results) + 1
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    fig = timeline_figure(results, workload)
    try:
        # Each policy on its own time axis: on fifo's 131 s one, cost-aware's 2 s were a sliver.
        assert [ax.get_xlim() for ax in fig.axes] == [(0.0, r.makespan_s) for r in results]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_plots_bars_are_visible_and_coloured_as_its_legend_says() -> None:
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt
    from jetbatch.sidecar.simulator.report import MIN_BAR_FRACTION, timeline_figure

    workload = load_workload(ROOT / "examples" / "workloads" / "burst.toml")
    results = [simulate(workload, policy) for policy in ("cost-aware", "longest-backlog")]
    fig = timeline_figure(results, workload)
    try:
        (legend,) = fig.legends
        legend_colors = {text.get_text(): mcolors.to_hex(h.get_facecolor()) for text, h in zip(legend.get_texts(), legend.legend_handles)}
        assert set(legend_colors) == {"model load", "batch", "batch that paid a load"}
        for ax, res in zip(fig.axes, results):
            bars = [mcolors.to_hex(p.get_facecolor()) for p in ax.patches]
            # One bar per load and per batch, each in a colour the legend names, and each meaning
            # drawn in its legend colour (batches were coloured by model, with no key).
            assert len(bars) == len(res.load_log) + len(res.batches)
            assert bars.count(legend_colors["model load"]) == len(res.load_log)
            assert bars.count(legend_colors["batch that paid a load"]) == sum(1 for *_, loaded in res.batches if loaded)
            assert bars.count(legend_colors["batch"]) == sum(1 for *_, loaded in res.batches if not loaded)
            assert min(p.get_width() for p in ax.patches) >= res.makespan_s * MIN_BAR_FRACTION * 0.999
    finally:
        plt.close(fig)


def test_simulate_cli_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[models.a]\nload_cost_s = 'slow'\n")
    out = subprocess.run([sys.executable, "-m", "jetbatch", "simulate", "--workload", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and str(bad) in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "jetbatch", "simulate", "--workload", str(ROOT / "examples/workloads/burst.toml"), "--policy", "nope"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "unknown policy" in out.stderr


def test_the_simulated_worker_pays_the_control_plane() -> None:
    from dataclasses import replace

    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL, Control

    raw = {
        "models": {"m1": {"load_cost_s": 0.1, "batch_cost_s": 0.01, "item_cost_s": 0.0, "max_batch_size": 1}},
        "arrivals": {"kind": "poisson", "rate": 5, "duration_s": 20, "seed": 3},
    }
    base = build_workload(raw)
    ideal = simulate(replace(base, control=IDEAL_CONTROL), "cost-aware")
    costly = simulate(replace(base, control=Control(decision_s=0.002, decision_per_model_s=0.0, arrival_delay_s=0.003, load_overhead_s=0.05)), "cost-aware")
    # One load in both; every request pays the arrival delay and at least one decision more.
    assert ideal.loads == costly.loads == 1
    pairs = zip(sorted(ideal.latencies_s), sorted(costly.latencies_s))
    assert all(c >= i + 0.003 + 0.002 - 1e-9 for i, c in pairs)
    assert max(costly.latencies_s) >= max(ideal.latencies_s) + 0.05  # the load's overhead, once
    assert build_workload({**raw, "control": {"decision_s": 0.0}}).control.decision_s == 0.0


def test_the_simulated_device_computes_while_answers_are_stored_up_to_the_live_bound() -> None:
    """As live (policy.pipeline_has_room): a batch's answers stored after its compute do not
    hold the device, but at most ANSWERING_BATCHES + 1 of a model's batches store answers while
    the next one computes; the one after waits for the oldest answers."""
    from dataclasses import replace

    from jetbatch.sidecar.policy import ANSWERING_BATCHES
    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    raw = {"models": {"a": {"load_cost_s": 0.0, "batch_cost_s": 0.01, "item_cost_s": 0.0, "max_batch_size": 1, "max_delay_s": 0.0}},
           "arrivals": {"kind": "burst", "per_model": 8}}  # fmt: skip
    result = simulate(replace(build_workload(raw), control=replace(IDEAL_CONTROL, answer_s=1.0), resident_at_start=("a",)), "cost-aware")
    starts = [start for start, *_ in result.batches]
    free = ANSWERING_BATCHES + 2  # the batch computing beside them, and the one just gathered
    # Back to back while the answers pile up...
    assert starts[:free] == pytest.approx([0.01 * i for i in range(free)])
    # ...then each waits for the oldest batch's answers (its compute end + 1 s).
    assert starts[free] == pytest.approx(0.01 + 1.0)
    assert result.completed == 8


def test_a_batch_refused_whole_stores_its_answers_within_the_same_bound() -> None:
    """As live, where a batch whose every request is refused still stores those answers: its
    answers take a place in the pipeline too. Every batch below is refused on its prediction (10 s
    against 5 s deadlines) until the probe after PROBE_AFTER_REFUSALS of them; with storing
    answers taking 1 s, four refusals go at once, four a second later, the probe a second after."""
    from dataclasses import replace

    from jetbatch.sidecar.policy import ANSWERING_BATCHES, PROBE_AFTER_REFUSALS
    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    raw = {"models": {"a": {"load_cost_s": 0.0, "batch_cost_s": 10.0, "item_cost_s": 0.0, "max_batch_size": 1, "max_delay_s": 0.0,
                            "deadline_s": 5.0}},
           "arrivals": {"kind": "burst", "per_model": PROBE_AFTER_REFUSALS + 1}}  # fmt: skip
    result = simulate(replace(build_workload(raw), control=replace(IDEAL_CONTROL, answer_s=1.0), resident_at_start=("a",)), "cost-aware")
    free = ANSWERING_BATCHES + 2
    assert PROBE_AFTER_REFUSALS == 2 * free  # the arithmetic of the timings below
    assert result.deadline_exceeded == PROBE_AFTER_REFUSALS
    assert [start for start, *_ in result.batches] == pytest.approx([2.0])


def _first_taker(model: str, workers: list[str]) -> str:
    from jetbatch.sidecar.policy import first_taker_rank

    return next(w for w in workers if first_taker_rank(model, w, workers, has_warm=lambda _: False) == 0)


def _simulate_trace(tmp_path: Path, models: dict[str, dict[str, float]], events: list[tuple[float, str]], workers: int) -> object:
    from dataclasses import replace

    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": t, "model": m}) + "\n" for t, m in events))
    raw = {"models": models, "workers": {"count": workers}, "arrivals": {"kind": "trace", "path": str(trace)}}
    return simulate(replace(build_workload(raw), control=IDEAL_CONTROL), "cost-aware")


def test_a_queue_nobody_holds_goes_first_to_a_worker_with_room(tmp_path: Path) -> None:
    """The first taker of "big" loads it for 5 s; a request for a model whose hash would pick the
    same worker goes at once to the other, idle one (it evicts nothing), not after a wait."""
    small = next(f"m{i}" for i in range(100) if _first_taker(f"m{i}", ["w0", "w1"]) == _first_taker("big", ["w0", "w1"]))
    spec = {"batch_cost_s": 0.01, "item_cost_s": 0.0, "max_batch_size": 1}
    result = _simulate_trace(tmp_path, {"big": {**spec, "load_cost_s": 5.0}, small: {**spec, "load_cost_s": 0.1}}, [(0.0, "big"), (0.1, small)], 2)
    starts = {model: start for start, _end, model in result.load_log}  # type: ignore[attr-defined]
    assert result.loads == 2  # type: ignore[attr-defined]
    assert starts["big"] == pytest.approx(0.0) and starts[small] == pytest.approx(0.1)


def test_with_no_room_anywhere_a_queue_waits_one_load_time_for_its_busy_first_taker(tmp_path: Path) -> None:
    """Two workers with one slot each hold "a" and "b". A model nobody holds arrives while its
    first taker computes a 1 s batch: the other worker leaves it alone for one load time (0.1 s),
    then evicts its own model for it, instead of racing the first taker at once or waiting 1 s."""
    workers = ["w0", "w1"]
    holder_of_a = _first_taker("a", workers)  # both free at t=0: a goes to its hash-first worker, b to the other
    q = next(f"q{i}" for i in range(100) if _first_taker(f"q{i}", workers) == holder_of_a)
    spec = {"batch_cost_s": 1.0, "item_cost_s": 0.0, "max_batch_size": 1, "load_cost_s": 0.1}
    result = _simulate_trace(tmp_path, {"a": spec, "b": spec, q: spec}, [(0.0, "a"), (0.01, "b"), (1.95, "a"), (2.0, q)], 2)
    starts = {model: start for start, _end, model in result.load_log}  # type: ignore[attr-defined]
    assert result.loads == 3  # type: ignore[attr-defined]
    assert starts[q] == pytest.approx(2.0 + 0.1)


def test_control_costs_measured_by_live_workers_replace_the_defaults() -> None:
    from jetbatch.sidecar.simulator.workloads import Control
    from jetbatch.sidecar.worker.counters import add_sample

    stats = {"decisions": 10, "decision_us": 5_000, "models_shown": 100}
    for seconds in (0.01, 0.03):  # mean 20 ms, spread 10 ms: cv 0.5
        add_sample(stats, "claim", seconds)
    for _ in range(3):
        add_sample(stats, "advert", 0.003)
    add_sample(stats, "arrival_delay", 0.0015)
    c = Control.measured(stats)
    assert c.claim_s == pytest.approx(0.02) and c.cv["claim_s"] == pytest.approx(0.5, rel=1e-3)
    assert c.advert_s == pytest.approx(0.003) and c.cv["advert_s"] == 0.0
    assert c.arrival_delay_s == pytest.approx(0.0015) and "arrival_delay_s" not in c.cv
    assert c.decision_s == pytest.approx(0.0005 - Control().decision_per_model_s * 10)
    assert c.answer_s == Control().answer_s and c.consumer_create_s == Control().consumer_create_s  # no sample: the default
    assert c.compute_excess_s == 0.0
    add_sample(stats, "compute_excess", 0.003)
    assert Control.measured(stats).compute_excess_s == pytest.approx(0.003)


def test_a_measured_compute_excess_lengthens_every_simulated_batch() -> None:
    """What a live forward pass took beyond its model's cost (the thread hop) is paid by each
    simulated batch; a workload file may set it too."""
    from dataclasses import replace

    raw = {
        "models": {"a": {"load_cost_s": 0.01, "batch_cost_s": 0.002, "item_cost_s": 0.0, "max_batch_size": 1}},
        "budget": {"max_models": 1},
        "arrivals": {"kind": "poisson", "rate": 20, "duration_s": 10, "seed": 3},
    }
    base = build_workload(raw)
    plain = simulate(base, "cost-aware")
    slower = simulate(replace(base, control=replace(base.control, compute_excess_s=0.003)), "cost-aware")
    assert [round(end - start, 6) for start, end, *_ in plain.batches] == [0.002] * len(plain.batches)
    assert [round(end - start, 6) for start, end, *_ in slower.batches] == [0.005] * len(slower.batches)
    assert build_workload({**raw, "control": {"compute_excess_s": 0.003}}).control.compute_excess_s == 0.003


def test_a_spread_of_the_control_costs_keeps_their_mean_and_widens_the_tail() -> None:
    from dataclasses import replace

    from jetbatch.sidecar.simulator.workloads import Control

    raw = {
        "models": {f"m{i}": {"load_cost_s": 0.01, "batch_cost_s": 0.001, "item_cost_s": 0.0, "max_batch_size": 4} for i in range(50)},
        "budget": {"max_models": 1},
        "arrivals": {"kind": "poisson", "rate": 20, "duration_s": 60, "zipf": 1.1, "seed": 2},
    }
    base = build_workload(raw)
    flat = Control(consumer_create_s=0.05, claim_s=0.02)
    fixed = simulate(replace(base, control=flat), "cost-aware")
    spread = simulate(replace(base, control=replace(flat, cv={"consumer_create_s": 2.0, "claim_s": 2.0})), "cost-aware")
    assert fixed.loads == pytest.approx(spread.loads, rel=0.1)
    assert percentile(spread.latencies_s, 0.5) == pytest.approx(percentile(fixed.latencies_s, 0.5), rel=0.1)
    assert percentile(spread.latencies_s, 0.99) > 1.5 * percentile(fixed.latencies_s, 0.99)
    assert build_workload({**raw, "control": {"cv": {"claim_s": 1.0}}}).control.cv == {"claim_s": 1.0}


def test_refused_requests_count_as_demand_in_the_simulator_as_they_do_live() -> None:
    """The live worker tells the policy every batch it took, refused requests included
    (execution.py: on_batch_done(len(requests))); the simulated worker does the same."""
    from jetbatch.sidecar.policy import make_policy

    policy = make_policy("cost-aware")
    told: list[int] = []
    original = policy.on_batch_done

    def spy(model: str, size: int, now: float, device_s: float = 0.0, *, excess_s: float = 0.0) -> None:
        told.append(size)
        original(model, size, now, device_s, excess_s=excess_s)

    policy.on_batch_done = spy  # type: ignore[method-assign]
    raw = {"models": {"a": {"load_cost_s": 0.0, "batch_cost_s": 0.5, "item_cost_s": 0.0, "deadline_s": 0.3}},
           "arrivals": {"kind": "poisson", "rate": 1.0, "duration_s": 20, "seed": 2}}  # fmt: skip
    # Resident from the start: no load to decide, so no queue is reaped before one (which is
    # answered without a batch, live as simulated).
    result = simulate(replace(build_workload(raw), resident_at_start=("a",)), policy)
    assert result.deadline_exceeded > 0 and result.reaped_queues == 0
    assert sum(told) == result.completed + result.deadline_exceeded  # every request taken was told


def test_a_policy_that_serves_a_model_not_on_the_device_gets_the_load_it_implies_as_live() -> None:
    from jetbatch.sidecar.policy import Idle, SchedulerState, Serve, make_policy

    base = make_policy("exhaustive")

    class ServesAnything:
        """A custom policy that never loads: it serves whatever waits (the worker loads it)."""

        name = "serves-anything"

        def decide(self, state: SchedulerState, now: float) -> object:
            waiting = [m for m in state.models.values() if m.backlog]
            return Serve(waiting[0].name, max_items=16) if waiting else Idle(now + 1.0)

        def __getattr__(self, name: str) -> object:
            return getattr(base, name)  # the event hooks of a real policy

    raw = {"models": {"a": {"load_cost_s": 0.1, "batch_cost_s": 0.01, "item_cost_s": 0.0}, "b": {"load_cost_s": 0.1, "batch_cost_s": 0.01, "item_cost_s": 0.0}},
           "arrivals": {"kind": "burst", "per_model": 4}}  # fmt: skip
    result = simulate(build_workload(raw), ServesAnything())  # type: ignore[arg-type]
    assert result.completed == 8 and result.loads == 2
    assert result.max_resident_seen == 2  # loaded without eviction past a one-model budget, as live


def test_pinned_models_stay_and_idle_models_go_in_the_simulator(tmp_path: Path) -> None:
    """The live worker's rules, simulated: pinned and preloaded models are on the device from the
    start, a pinned one is never evicted, and an idle model goes after its idle_unload_s."""
    from dataclasses import replace

    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    raw = {
        "models": {
            "p": {"load_cost_s": 0.5, "pin": True},
            "a": {"load_cost_s": 0.2, "preload": True},
            "b": {"load_cost_s": 0.2, "idle_unload_s": 1.0},
        },
        "budget": {"max_models": 3},
        "arrivals": {"kind": "trace", "path": "trace.jsonl"},
    }
    # a and b alternate, then a long quiet spell on b while a keeps going
    events = [(0.1 * i, "a" if i % 2 else "b") for i in range(20)] + [(5.0 + 0.5 * i, "a") for i in range(10)]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps({"t": at, "model": m}) + "\n" for at, m in events))
    workload = replace(build_workload(raw, tmp_path), control=IDEAL_CONTROL)
    assert workload.resident_at_start == ("p", "a")
    result = simulate(workload, "cost-aware")
    assert result.completed == 30
    assert all(model != "p" for _, _, model in result.load_log)  # never evicted, so never reloaded
    assert result.idle_unloads >= 1  # b, quiet from 2 s on, went after its 1 s
    assert result.loads == 1  # b, once: p and a were there from the start, and all three fit
    # Two slots: a and b take turns in the one slot p leaves; p is never evicted (never reloaded).
    tight = replace(build_workload({**raw, "budget": {"max_models": 2}}, tmp_path), control=IDEAL_CONTROL)
    squeezed = simulate(tight, "cost-aware")
    assert squeezed.completed == 30 and squeezed.loads >= 2
    assert all(model != "p" for _, _, model in squeezed.load_log)
    with pytest.raises(WorkloadError, match="budget.max_models: 3 pinned models do not fit 3 slots"):
        build_workload({**raw, "models": {**raw["models"], "a": {"load_cost_s": 0.2, "pin": True}, "b": {"load_cost_s": 0.2, "pin": True}, "c": {"load_cost_s": 0.1}}}, tmp_path)


def test_the_simulator_pays_no_load_for_a_queue_whose_callers_gave_up(tmp_path: Path) -> None:
    """As live: b's requests time out while a's long batches hold the one slot; when the worker
    turns to b, its queue is answered deadline_exceeded without a load."""
    from dataclasses import replace

    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    events = [(0.0, "a"), (0.0, "a"), (0.1, "b"), (0.1, "b"), (0.1, "b")]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps({"t": at, "model": m}) + "\n" for at, m in events))
    raw = {
        "models": {"a": {"load_cost_s": 0.1, "batch_cost_s": 1.0, "max_batch_size": 1}, "b": {"load_cost_s": 0.5, "deadline_s": 0.3}},
        "budget": {"max_models": 1},
        "arrivals": {"kind": "trace", "path": "trace.jsonl"},
    }
    result = simulate(replace(build_workload(raw, tmp_path), control=IDEAL_CONTROL), "cost-aware")
    assert result.completed == 2 and result.deadline_exceeded == 3
    assert result.reaped_queues == 1
    assert [m for _, _, m in result.load_log] == ["a"]  # b never loaded


@pytest.mark.parametrize("priority", ["interactive", "batch"])
def test_a_worker_draining_a_deep_queue_sees_the_count_of_its_last_take(tmp_path: Path, priority: str) -> None:
    """As live (policy/interest.py): while more than three batches wait on a line, the worker
    does not listen to that line's arrivals, so a burst stored meanwhile is seen at its next take."""
    from jetbatch.sidecar.policy.cost_aware import CostAware
    from jetbatch.sidecar.policy.types import SchedulerState

    lines = [json.dumps({"t": 0.0 if i < 40 else 0.15, "model": "a", "priority": priority}) for i in range(60)]
    (tmp_path / "trace.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "w.toml").write_text(
        '[models.a]\nload_cost_s = 0.0\nbatch_cost_s = 0.1\nitem_cost_s = 0.0\nmax_batch_size = 4\n[arrivals]\nkind = "trace"\npath = "trace.jsonl"\n'
    )

    class Recording(CostAware):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[float, int]] = []

        def decide(self, state: SchedulerState, now: float) -> Any:
            self.seen.append((now, state.models["a"].backlog if "a" in state.models else 0))
            return super().decide(state, now)

    policy = Recording()
    assert simulate(load_workload(tmp_path / "w.toml"), policy).completed == 60
    before = [n for t, n in policy.seen if 0.0 < t < 0.15]
    after = [n for t, n in policy.seen if t > 0.15]
    # The first decision after the burst still sees the count of the last take (one batch less
    # than the one before), not the 20 stored meanwhile; the next take counts them.
    assert after[0] == before[-1] - 4
    assert after[1] == after[0] + 20 - 4
    assert policy.seen[-1][1] == 4  # drained listening again: the last batch's four, exactly


def _two_models_trace(trace: list[tuple[float, str]], b: dict[str, Any] | None = None, **control: float) -> Any:
    """Models a (on the device at the start) and b (``b``: its settings beyond a's), one device
    slot, the arrivals ``trace``, and an ideal control plane but for ``control``."""
    from dataclasses import replace

    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    model = {"load_cost_s": 0.1, "batch_cost_s": 0.01, "item_cost_s": 0.0, "max_batch_size": 8, "max_delay_s": 0.0}
    base = build_workload({"models": {"a": model, "b": {**model, **(b or {})}}})
    return simulate(replace(base, arrivals=tuple(trace), control=replace(IDEAL_CONTROL, **control), resident_at_start=("a",)), "cost-aware")


def test_a_simulated_worker_counts_the_served_models_line_before_it_leaves_it() -> None:
    """As live (policy/interest.py): the line of the model whose batches it serves is not
    listened to, so a decision to load another is made again after one count of it, which the
    simulated worker pays (``count_line_s``)."""
    trace = [(0.0, "a"), (0.0, "a"), (0.001, "b")]
    quick = _two_models_trace(trace, count_line_s=0.0)
    slow = _two_models_trace(trace, count_line_s=0.2)
    quick_start, slow_start = (next(s for s, _, m in r.load_log if m == "b") for r in (quick, slow))
    assert slow_start == pytest.approx(quick_start + 0.2)
    assert quick.completed == slow.completed == 3


def test_a_simulated_hold_serves_the_served_models_next_request_with_no_decision() -> None:
    """As live: about to idle after a batch of two of a, the worker holds a's next batch open;
    a's request 2 ms after that batch opens it with no decision in between (one costs 1 ms)."""
    held = _two_models_trace([(0.0, "a"), (0.0, "a"), (0.013, "a")], decision_s=0.001)
    assert [round(start, 6) for start, *_ in held.batches] == [0.001, 0.013]
    # Past the hold (from 12 ms, HOLD_S): the worker idled, and the request is served after a decision.
    late = round(0.012 + HOLD_S + 0.008, 6)
    idled = _two_models_trace([(0.0, "a"), (0.0, "a"), (late, "a")], decision_s=0.001)
    assert [round(start, 6) for start, *_ in idled.batches] == [0.001, round(late + 0.001, 6)]
    # After a lone request's batch there is no hold: the worker idles on the arrival events.
    lone = _two_models_trace([(0.0, "a"), (0.013, "a")], decision_s=0.001)
    assert [round(start, 6) for start, *_ in lone.batches] == [0.001, 0.014]
    # After a hold came back empty, a pair is no longer enough to hold again (serves_on): the
    # request 2 ms after the second pair's batch waits for a decision.
    pairs = _two_models_trace([(0.0, "a"), (0.0, "a"), (late, "a"), (late, "a"), (late + 0.014, "a")], decision_s=0.001)
    assert [round(start, 6) for start, *_ in pairs.batches] == [0.001, round(late + 0.001, 6), round(late + 0.015, 6)]


def test_a_simulated_hold_ends_with_another_models_arrival() -> None:
    """As live: b's request 3 ms into a's hold (from 12 ms) ends it at once; the worker counts
    a's line (2 ms) and decides (1 ms) to load b at 18 ms, not after the hold's HOLD_S."""
    trace = [(0.0, "a"), (0.0, "a"), (0.015, "b")]
    cut = _two_models_trace(trace, decision_s=0.001, count_line_s=0.002)
    assert [round(start, 6) for start, _, model in cut.load_log] == [0.018]
    assert 0.018 < 0.012 + HOLD_S


def test_a_simulated_cancel_notice_ends_a_hold_as_an_arrival_does() -> None:
    """As live (``Worker._on_cancel`` wakes the worker, which ends a hold). Two workers: the
    first serves a; b's request comes with a's pair, and the second loads b for it (100 ms), so
    to the first it is known but not its backlog, and it holds a's next batch open after the
    pair's. b's caller cancels 15 ms after its request, 3 ms into the hold: the hold ends, the
    worker counts a's line (1 ms) and idles, and a's request at 25 ms, which the hold would have
    taken at once, waits for a decision (1 ms)."""
    from jetbatch.sidecar.simulator.workloads import IDEAL_CONTROL

    model = {"load_cost_s": 0.1, "batch_cost_s": 0.01, "item_cost_s": 0.0, "max_batch_size": 8, "max_delay_s": 0.0}
    trace = ((0.0, "a"), (0.0, "a"), (0.0, "b"), (0.025, "a"))
    control = replace(IDEAL_CONTROL, decision_s=0.001, count_line_s=0.001)
    starts = []
    for b in (model, {**model, "cancel_after_s": 0.015}):
        base = build_workload({"models": {"a": model, "b": b}, "workers": {"count": 2}})
        result = simulate(replace(base, arrivals=trace, control=control, resident_at_start=("a",)), "cost-aware")
        starts.append([round(start, 6) for start, _, name, *_ in result.batches if name == "a"])
    assert starts == [[0.001, 0.025], [0.001, 0.026]]


def _workload_numbers() -> list[tuple[str, bool]]:
    """Every number of a workload file (seeds left out: any integer is a seed)."""
    from jetbatch.sidecar.simulator.workloads import _ModelSpec, _WorkloadSpec
    from tests.helpers import numeric_keys

    return numeric_keys(_WorkloadSpec, skip=frozenset({"seed"})) + numeric_keys(_ModelSpec, ("models", "m1"), skip=frozenset({"seed"}))


@pytest.mark.parametrize(("key", "is_int"), _workload_numbers(), ids=[k for k, _ in _workload_numbers()])
def test_every_number_in_a_workload_file_is_bounded(key: str, is_int: bool) -> None:
    """The simulator's schema refuses an integer past 64 bits (or past what a batch or a burst
    may hold) and an infinite float, naming the key, as the worker's config does."""
    from jetbatch.sidecar.simulator.workloads import WorkloadError

    raw: dict[str, Any] = {"models": {"m1": {"load_cost_s": 0.1}}}
    *sections, field = key.split(".")
    table = raw
    for part in sections:
        table = table.setdefault(part, {})
    table[field] = 10**30 if is_int else float("inf")
    # A value in a table of its own (arrivals.mix, control.cv) is named by its table.
    named = key if sections[:2] == ["models", "m1"] or len(sections) < 2 else ".".join(sections)
    with pytest.raises(WorkloadError, match=named.replace(".", r"\.")):
        build_workload(raw)


def test_sharded_workers_each_see_and_load_only_their_own_models() -> None:
    """``[workers] shards``: model i is registered by worker i mod count, as worker configs that
    split the models between them. Each worker's core is told only its models, and with room for
    all of them each model is loaded once, by its own worker."""
    from jetbatch.sidecar.simulator.engine import Simulation
    from jetbatch.sidecar.policy import make_policy

    raw: dict[str, Any] = {
        "models": {f"m{i}": {"load_cost_s": 0.2, "batch_cost_s": 0.002, "item_cost_s": 0.0002, "max_batch_size": 16} for i in range(6)},
        "budget": {"max_models": 3},
        "workers": {"count": 2, "shards": True},
        "arrivals": {"kind": "poisson", "rate": 60, "duration_s": 20, "seed": 3},
    }
    workload = build_workload(raw)
    sim = Simulation(workload, lambda: make_policy("cost-aware"), max_events=10_000_000)
    result = sim.run()
    assert result.completed == len(workload.arrivals)
    assert [sorted(w.core.rules) for w in sim.workers] == [["m0", "m2", "m4"], ["m1", "m3", "m5"]]
    assert all(set(w.resident) <= set(w.core.rules) for w in sim.workers)
    assert result.loads == 6
    shared = Simulation(build_workload({**raw, "workers": {"count": 2}}), lambda: make_policy("cost-aware"), max_events=10_000_000)
    assert shared.run().completed == len(workload.arrivals)
    assert [len(w.core.rules) for w in shared.workers] == [6, 6]
