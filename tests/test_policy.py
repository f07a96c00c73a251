"""The pure policy parts besides scheduling: the batch window, the cost estimator and the cluster
share. No clock, no I/O: times go in as numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jetbatch.sidecar.policy import BatchCost, BatchWindow, CostEstimator, cannot_finish, effective_backlog

# --- the batch window ---------------------------------------------------------------------------


def test_window_closes_on_size_before_the_delay() -> None:
    w = BatchWindow(max_batch_size=3, max_delay_s=1.0)
    close_at = w.close_at(first_enqueued_at=10.0, first_seen_at=10.0)
    assert close_at == 11.0
    assert not w.should_close(2, close_at, now=10.1)  # two requests: pending
    assert w.should_close(3, close_at, now=10.1)  # the third releases the batch
    assert w.wait_s(2, close_at, now=10.1) == pytest.approx(0.9)
    assert w.wait_s(3, close_at, now=10.1) == 0.0


def test_window_counts_from_the_enqueue_time_and_honours_deadlines() -> None:
    w = BatchWindow(max_batch_size=16, max_delay_s=0.5)
    # A request that already waited in the queue does not wait again once fetched.
    assert w.close_at(first_enqueued_at=9.0, first_seen_at=10.0) == 9.5
    assert w.should_close(1, w.close_at(9.0, 10.0), now=10.0)
    # An earlier deadline closes the window sooner.
    assert w.close_at(10.0, 10.0, earliest_deadline=10.2) == 10.2


def test_window_keeps_filling_while_the_device_is_busy() -> None:
    w = BatchWindow(max_batch_size=8, max_delay_s=0.01)
    close_at = w.close_at(10.0, 10.0)
    assert w.should_close(2, close_at, now=11.0)
    assert not w.should_close(2, close_at, now=11.0, device_busy=True)
    assert w.should_close(8, close_at, now=11.0, device_busy=True)  # full closes anyway
    assert w.wait_s(0, None, now=11.0, idle_wait_s=0.3) == 0.3


def test_cannot_finish_uses_the_predicted_batch_time() -> None:
    assert not cannot_finish(None, 100.0, 5.0)
    assert not cannot_finish(101.0, 100.0, 0.5)
    assert cannot_finish(101.0, 100.0, 1.5)
    assert cannot_finish(99.0, 100.0, 0.0)


def test_the_batch_line_goes_first_once_in_every_few_batches_while_both_wait() -> None:
    from jetbatch.sidecar.policy import BATCH_LINE_EVERY, batch_line_first

    assert not batch_line_first(5, 0, 100)  # nothing on the batch line
    assert batch_line_first(0, 3, 0)  # only batch work waits
    assert [batch_line_first(5, 3, run) for run in range(BATCH_LINE_EVERY)] == [False] * (BATCH_LINE_EVERY - 1) + [True]


@given(st.integers(0, 64), st.floats(0, 5), st.floats(0, 5), st.floats(0, 10))
def test_window_never_holds_a_full_batch(count: int, delay: float, enqueued: float, now: float) -> None:
    w = BatchWindow(max_batch_size=16, max_delay_s=delay)
    close_at = w.close_at(enqueued, enqueued)
    if count >= 16:
        assert w.should_close(count, close_at, now) and w.wait_s(count, close_at, now) == 0.0
    if count == 0:
        assert not w.should_close(count, close_at, now)


def test_a_windows_close_leads_by_the_median_lateness_of_its_recent_starts_within_its_caps() -> None:
    """The lead is what batches started after their timer's aim, typically: a stall or two do
    not move it, and it never takes more than its share of a window nor its absolute cap."""
    from jetbatch.sidecar.policy import MAX_CLOSE_LEAD_S, CloseLead

    window = BatchWindow(64, 0.002)
    lead = CloseLead()
    assert lead.lead_s(window) == 0.0  # nothing measured: the window closes when due
    for _ in range(10):
        lead.note(0.0002)
    lead.note(0.05)  # a stall (a GC pause, a descheduled process)
    lead.note(-0.001)  # a clock stepped back
    assert lead.lead_s(window) == pytest.approx(0.0002)
    assert lead.lead_s(BatchWindow(64, 0.0004)) == pytest.approx(0.0001)  # a quarter of a short window
    for _ in range(40):
        lead.note(0.003)  # a host that wakes late every time: the old samples are gone
    assert lead.lead_s(window) == pytest.approx(min(MAX_CLOSE_LEAD_S, 0.0005))


@given(st.lists(st.floats(-1.0, 1.0) | st.sampled_from([math.nan, math.inf, -math.inf]), max_size=80), st.floats(0.0, 5.0))
def test_a_close_lead_is_never_negative_nor_beyond_its_caps(late: list[float], delay: float) -> None:
    from jetbatch.sidecar.policy import MAX_CLOSE_LEAD_S, CloseLead

    lead = CloseLead()
    for x in late:
        lead.note(x)
    window = BatchWindow(64, delay)
    assert 0.0 <= lead.lead_s(window) <= min(MAX_CLOSE_LEAD_S, delay / 4)


# --- the cost estimator -------------------------------------------------------------------------


def test_estimator_starts_from_the_configuration_and_learns() -> None:
    c = CostEstimator(alpha=0.5)
    c.seed("m", load_cost_s=2.0, batch_cost=BatchCost(0.01, 0.001), memory_bytes=100)
    assert c.load_cost_s("m") == 2.0
    assert c.load_cost_s("m", "resident") == 0.0
    assert c.load_cost_s("m", "warm") == pytest.approx(0.6)  # a prior share of the cold load until measured
    c.observe_load("m", 1.0)
    assert c.load_cost_s("m") == pytest.approx(1.5)
    c.observe_load("m", 0.1, "warm")
    assert c.load_cost_s("m", "warm") == pytest.approx(0.1)
    for _ in range(30):
        c.observe_batch("m", 10, 0.05 + 0.002 * 10)
    assert c.batch_cost("m").seconds(10) == pytest.approx(0.07, rel=0.05)
    c.observe_memory("m", 0)  # a zero reading (nothing measured) keeps the estimate
    assert c.memory_bytes("m") == 100
    assert c.host_memory_bytes("m") == 100  # the device size until a host copy is measured


def test_estimator_rejects_a_bad_alpha() -> None:
    with pytest.raises(ValueError):
        CostEstimator(alpha=0.0)


@given(st.lists(st.tuples(st.integers(1, 64), st.floats(0.0, 2.0)), min_size=1, max_size=40))
def test_estimator_stays_within_what_it_saw(observations: list[tuple[int, float]]) -> None:
    c = CostEstimator()
    c.seed("m", load_cost_s=1.0, batch_cost=BatchCost(0.0, 0.0))
    for n, seconds in observations:
        c.observe_batch("m", n, seconds)
        cost = c.batch_cost("m")
        assert cost.batch_cost_s >= 0 and cost.item_cost_s >= 0
    longest = max(s for _, s in observations)
    assert c.batch_cost("m").seconds(1) <= longest + 1e-9


# --- the cluster share --------------------------------------------------------------------------


def test_share_leaves_what_peers_would_not_drain_within_our_load() -> None:
    # Peers drain 100 req/s; our load takes 2 s: of 500 waiting, 300 are ours to justify a load.
    assert effective_backlog(500, 100.0, 2.0, resident_here=False) == 300
    assert effective_backlog(150, 100.0, 2.0, resident_here=False) == 0
    # Resident here: the whole queue is ours too (serving it costs no load).
    assert effective_backlog(150, 100.0, 2.0, resident_here=True) == 150
    assert effective_backlog(150, 0.0, 2.0, resident_here=False) == 150  # nobody else serves it


@given(st.integers(0, 10_000), st.floats(0, 1e4), st.floats(0, 100), st.booleans())
def test_share_is_between_zero_and_the_backlog(backlog: int, rps: float, horizon: float, resident: bool) -> None:
    share = effective_backlog(backlog, rps, horizon, resident_here=resident)
    assert 0 <= share <= backlog


def test_visible_models_are_all_of_a_few_and_the_active_ones_of_thousands() -> None:
    from jetbatch.sidecar.policy import visible_models

    few = {f"m{i}": None for i in range(10)}
    assert visible_models(few, 0.0, waiting=[], on_device=[], current=None, last_used={}) is few
    many = {f"m{i}": None for i in range(1000)}
    demand = {"m5": 3.0, "m6": 0.5}
    shown = visible_models(
        many, 1000.0, waiting=["m1"], on_device=["m2"], current="m3",
        last_used={"m5": 990.0, "m6": 995.0, "m7": 10.0},
        demand=lambda name, now: demand.get(name, 0.0),
    )  # fmt: skip
    # m6: used recently but its demand no longer counts; m7: used long ago.
    assert list(shown) == ["m1", "m2", "m3", "m5"]


def test_a_queue_peers_serve_is_never_overdue_for_a_worker_that_does_not_hold_it() -> None:
    from jetbatch.sidecar.policy import join_horizon_s, shared_head

    assert shared_head(10.0, 100.0, 50.0, resident_here=False) == 100.0  # age 0: not overdue
    assert shared_head(10.0, 100.0, 50.0, resident_here=True) == 10.0  # ours: its true age
    assert shared_head(10.0, 100.0, 0.0, resident_here=False) == 10.0  # nobody serves it
    # Cheap warm reloads do not shrink the peers' drain to a few requests.
    assert join_horizon_s(0.05) == 0.25 and join_horizon_s(2.0) == 2.0


def test_a_queue_counted_as_fully_served_is_never_ours_to_join() -> None:
    import math

    assert effective_backlog(10_000, math.inf, 0.25, resident_here=False, min_share=16) == 0
    assert effective_backlog(10_000, math.inf, 0.25, resident_here=True, min_share=16) == 10_000
    assert effective_backlog(100, 100.0, 0.25, resident_here=False, min_share=16) == 75
    assert effective_backlog(40, 100.0, 0.25, resident_here=False, min_share=16) == 0  # 15 left: under a batch


# --- the first taker of a queue nobody holds ----------------------------------------------------

_names = st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=12)


@given(model=_names, workers=st.sets(_names, min_size=1, max_size=8), warm=st.sets(_names, max_size=8), room=st.sets(_names, max_size=8))
def test_every_worker_agrees_on_one_first_taker(model: str, workers: set[str], warm: set[str], room: set[str]) -> None:
    from jetbatch.sidecar.policy import first_taker_rank

    def rank(w: str) -> int:
        return first_taker_rank(model, w, workers, has_warm=lambda x: x in warm, has_room=lambda x: x in room)

    # Each worker computes its rank alone, yet the ranks are exactly 0..n-1: one first taker.
    assert sorted(rank(w) for w in workers) == list(range(len(workers)))
    first = next(w for w in workers if rank(w) == 0)
    if workers & room:
        assert first in room  # a worker that evicts nothing goes first
    elif workers & warm:
        assert first in warm  # then a warm copy: its reload is the cheap one


def test_room_counts_model_slots_and_bytes() -> None:
    from jetbatch.sidecar.policy import Budget, has_room

    assert has_room(Budget(max_models=2), resident=1, used_bytes=0, model_bytes=0)
    assert not has_room(Budget(max_models=1), resident=1, used_bytes=0, model_bytes=0)
    assert not has_room(Budget(max_bytes=100, max_models=None), resident=3, used_bytes=60, model_bytes=50)
    assert has_room(Budget(max_bytes=100, max_models=None), resident=3, used_bytes=50, model_bytes=50)


def test_first_takers_spread_over_the_workers_and_later_ranks_wait_a_load_each() -> None:
    from jetbatch.sidecar.policy import MIN_DEFER_STEP_S, deferred_until, first_taker_rank

    workers = ["w0", "w1", "w2", "w3"]
    firsts = [next(w for w in workers if first_taker_rank(f"m{i}", w, workers, has_warm=lambda _: False) == 0) for i in range(400)]
    assert all(60 <= firsts.count(w) <= 140 for w in workers)  # about 100 each: no hot worker
    assert deferred_until(0, 10.0, 0.5) == 10.0
    assert deferred_until(2, 10.0, 0.5) == 11.0
    assert deferred_until(1, 10.0, 0.001) == 10.0 + MIN_DEFER_STEP_S
