"""The scheduling policies, driven by the simulator: deterministic, no clock, no I/O."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jetbatch.sidecar.policy import scheduling as sched
from jetbatch.sidecar.simulator import SimModel, Workload, build_workload, lower_bound, simulate


def model(name: str, **kw: float) -> SimModel:
    base = dict(load_cost_s=0.5, batch_cost_s=0.005, item_cost_s=0.0001, max_batch_size=16, max_wait_s=2.0, memory_bytes=1)
    base.update(kw)
    return SimModel(name=name, **base)  # type: ignore[arg-type]


def state(models: list[sched.ModelState], current: str | None = None, **budget: int) -> sched.SchedulerState:
    return sched.SchedulerState({m.name: m for m in models}, current, sched.Budget(**budget) if budget else sched.Budget())


def ms(name: str, backlog: int, *, resident: bool = False, oldest: float | None = 0.0, load: float = 0.5, **kw: float) -> sched.ModelState:
    return sched.ModelState(
        name=name, backlog=backlog, oldest_enqueued_at=oldest if backlog else None, resident=resident,
        load_cost_s=load, batch_cost=sched.BatchCost(0.005, 0.0001), memory_bytes=int(kw.get("memory_bytes", 1)),
        max_batch_size=int(kw.get("max_batch_size", 16)), max_wait_s=kw.get("max_wait_s", 2.0),
    )  # fmt: skip


def test_interleaved_requests_make_one_batch_per_model() -> None:
    """The motivating case: [m1, m2, m1, m2, m1, m2], max batch 3, one slot."""
    models = {n: model(n, max_batch_size=3) for n in ("m1", "m2")}
    workload = Workload(models=models, arrivals=tuple((0.0, n) for n in ["m1", "m2"] * 3), closed=True)
    result = simulate(workload, "cost-aware")
    assert [(b[2], b[3]) for b in result.batches] == [("m1", 3), ("m2", 3)]
    assert result.loads == 2
    fifo = simulate(workload, "fifo")
    assert [(b[2], b[3]) for b in fifo.batches] == [("m1", 1), ("m2", 1)] * 3
    assert fifo.loads == 6


def test_closed_burst_meets_the_lower_bound_and_fifo_collapses() -> None:
    workload = build_workload({"models": {f"m{i}": {"load_cost_s": 0.5} for i in range(4)}, "arrivals": {"kind": "burst", "per_model": 64}})
    bound = lower_bound(workload)
    cost_aware = simulate(workload, "cost-aware")
    fifo = simulate(workload, "fifo")
    assert cost_aware.makespan_s <= 1.15 * bound
    assert fifo.makespan_s >= 10 * cost_aware.makespan_s


def test_resident_model_is_served_in_bursts_not_interrupted_after_one_batch() -> None:
    """The thrash trap: every queue is past its wait bound, yet a just-loaded model drains the
    backlog that justified its load before the policy moves on."""
    policy = sched.make_policy("cost-aware")
    first = policy.decide(state([ms("a", 64), ms("b", 64)], None, max_models=1), now=10.0)
    assert isinstance(first, sched.Load)
    policy.on_loaded(first.model, 10.5, 64)
    other = "b" if first.model == "a" else "a"
    served = 0
    while served < 64:
        d = policy.decide(state([ms(first.model, 64 - served, resident=True), ms(other, 64)], first.model, max_models=1), now=11.0)
        assert isinstance(d, sched.Serve) and d.model == first.model, d
        policy.on_batch_done(first.model, 16, 11.0, 0.0066)
        served += 16


def test_urgent_model_comes_next_once_the_burst_is_paid_for() -> None:
    policy = sched.make_policy("cost-aware", amortize=0.0)
    policy.on_loaded("a", 0.0)
    # a is resident with a long backlog; b has only 2 requests but they waited past half max_wait.
    d = policy.decide(state([ms("a", 500, resident=True, oldest=9.9), ms("b", 2, oldest=8.0)], "a", max_models=1), now=10.0)
    assert isinstance(d, sched.Load) and d.model == "b" and d.evict == ("a",)
    assert d.reason == "urgent"


def test_hysteresis_keeps_the_resident_model_against_a_slightly_better_one() -> None:
    policy = sched.make_policy("cost-aware", amortize=0.0, urgency=1.0)
    policy.on_loaded("a", 0.0)
    d = policy.decide(state([ms("a", 40, resident=True, oldest=9.9), ms("b", 48, oldest=9.9)], "a", max_models=1), now=10.0)
    assert isinstance(d, sched.Serve) and d.model == "a"


def test_two_busy_models_do_not_ping_pong() -> None:
    """Open arrivals to two equally busy models: bursts, not a switch after every batch."""
    workload = build_workload(
        {"models": {"a": {"load_cost_s": 0.5, "max_wait_s": 10.0}, "b": {"load_cost_s": 0.5, "max_wait_s": 10.0}},
         "arrivals": {"kind": "poisson", "utilization": 0.6, "duration_s": 30, "seed": 4}}
    )  # fmt: skip
    result = simulate(workload, "cost-aware")
    assert len(result.batches) / result.loads >= 10


def test_cost_eviction_keeps_the_expensive_popular_model() -> None:
    policy = sched.make_policy("cost-aware")
    for _ in range(20):
        policy.on_batch_done("big", 16, 5.0)  # big is popular ...
    policy.on_batch_done("small", 1, 9.0)  # ... small was used more recently
    s = state([ms("big", 0, resident=True, load=5.0), ms("small", 0, resident=True, load=0.1), ms("new", 4, oldest=9.0)], "small", max_models=2)
    d = policy.decide(s, now=10.0)
    assert isinstance(d, sched.Load) and d.model == "new" and d.evict == ("small",)
    lru = sched.make_policy("cost-aware-lru")
    for _ in range(20):
        lru.on_batch_done("big", 16, 5.0)
    lru.on_batch_done("small", 1, 9.0)
    d = lru.decide(s, now=10.0)
    assert isinstance(d, sched.Load) and d.evict == ("big",)  # LRU throws away the expensive model


def test_memory_budget_in_bytes_evicts_enough() -> None:
    policy = sched.make_policy("cost-aware")
    s = sched.SchedulerState(
        {"a": ms("a", 0, resident=True, memory_bytes=6), "b": ms("b", 0, resident=True, memory_bytes=3), "c": ms("c", 5, memory_bytes=8)},
        None, sched.Budget(max_bytes=10, max_models=None),
    )  # fmt: skip
    d = policy.decide(s, now=1.0)
    assert isinstance(d, sched.Load) and d.model == "c" and set(d.evict) == {"a", "b"}


def test_gather_window_waits_for_enough_requests_or_the_delay() -> None:
    policy = sched.make_policy("cost-aware", gather_size=32, gather_delay_s=0.1)
    few = state([ms("a", 5, resident=True, oldest=10.0), ms("b", 6, oldest=10.02)], max_models=1)
    d = policy.decide(few, now=10.05)
    assert isinstance(d, sched.Idle) and d.until == pytest.approx(10.1) and d.reason == "gather"
    assert isinstance(policy.decide(few, now=10.1), sched.Serve)  # the delay passed
    many = state([ms("a", 20, resident=True, oldest=10.0), ms("b", 20, oldest=10.0)], max_models=1)
    assert not isinstance(policy.decide(many, now=10.01), sched.Idle)  # N reached (N > max batch)


def test_round_robin_visits_every_model_in_turn() -> None:
    models = {n: model(n, load_cost_s=0.0) for n in ("a", "b", "c")}
    workload = Workload(models=models, arrivals=tuple((0.0, n) for n in ["a", "b", "c"] * 32), closed=True)
    result = simulate(workload, "round-robin")
    assert [b[2] for b in result.batches[:6]] == ["a", "b", "c", "a", "b", "c"]


def test_unknown_policy_and_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        sched.make_policy("psychic")
    with pytest.raises(ValueError):
        sched.make_policy("cost-aware", urgency=0.0)
    with pytest.raises(TypeError):
        sched.make_policy("fifo", urgency=0.5)


# --- properties on random traces ---------------------------------------------------------------

traces = st.lists(st.tuples(st.floats(0, 20, allow_nan=False), st.sampled_from(["a", "b", "c", "d"])), min_size=1, max_size=120)


def random_workload(trace: list[tuple[float, str]], loads: tuple[float, ...], slots: int, max_bytes: int | None) -> Workload:
    names = ["a", "b", "c", "d"]
    models = {n: model(n, load_cost_s=loads[i], memory_bytes=i + 1, max_wait_s=3.0) for i, n in enumerate(names)}
    return Workload(
        models=models,
        arrivals=tuple(sorted(trace)),
        budget=sched.Budget(max_bytes=max_bytes, max_models=slots),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    traces,
    st.tuples(*[st.floats(0.0, 1.0)] * 4),
    st.integers(1, 3),
    st.one_of(st.none(), st.integers(4, 8)),
    st.sampled_from(sched.POLICIES),
)
def test_every_request_served_once_within_the_memory_budget(
    trace: list[tuple[float, str]], loads: tuple[float, ...], slots: int, max_bytes: int | None, policy: str
) -> None:
    workload = random_workload(trace, loads, slots, max_bytes)
    result = simulate(workload, policy)
    assert sorted(result.served_ids) == list(range(len(trace)))  # each exactly once
    assert result.max_resident_seen <= slots
    if max_bytes is not None:
        assert result.max_bytes_seen <= max_bytes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.floats(0, 60, allow_nan=False), st.sampled_from(["a", "b", "c", "d"])), min_size=1, max_size=60),
    st.tuples(*[st.floats(0.0, 0.3)] * 4),
)
def test_bounded_waiting_when_capacity_is_spare(trace: list[tuple[float, str]], loads: tuple[float, ...]) -> None:
    """Spare capacity: at most 60 requests over 60 s, loads ≤ 0.3 s and batches ≤ 7 ms, so even a
    load for every request uses under a third of the device. Then no request waits longer than its
    max_wait (3 s) plus one load plus one batch."""
    workload = random_workload(trace, loads, 1, None)
    result = simulate(workload, "cost-aware")
    assert result.late_beyond_bound == 0, max(result.waits_s)
