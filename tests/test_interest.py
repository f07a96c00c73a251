"""Whether a worker listens to the arrivals of the model it drains (sidecar/policy/interest.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jetbatch.sidecar.policy import HOLD_S, LISTEN_BELOW_BATCHES, MIN_HOLD_S, QUIET_FROM_BATCHES, SERVING_AGAIN_FROM, hold_s, listens, serves_on
from jetbatch.sidecar.policy import scheduling as sched


def test_a_model_the_worker_does_not_drain_is_always_listened_to() -> None:
    for listening in (True, False):
        assert listens(listening=listening, draining=False, waiting=10_000, max_batch_size=8)


def test_the_drained_model_goes_quiet_from_three_batches_and_listens_again_below_two() -> None:
    q = 8
    assert listens(listening=True, draining=True, waiting=QUIET_FROM_BATCHES * q - 1, max_batch_size=q)
    assert not listens(listening=True, draining=True, waiting=QUIET_FROM_BATCHES * q, max_batch_size=q)
    # Between the two thresholds it keeps what it does: no subscription change per batch.
    assert not listens(listening=False, draining=True, waiting=LISTEN_BELOW_BATCHES * q, max_batch_size=q)
    assert listens(listening=True, draining=True, waiting=LISTEN_BELOW_BATCHES * q, max_batch_size=q)
    assert listens(listening=False, draining=True, waiting=LISTEN_BELOW_BATCHES * q - 1, max_batch_size=q)


def test_a_batch_size_below_one_counts_as_one() -> None:
    assert not listens(listening=True, draining=True, waiting=QUIET_FROM_BATCHES, max_batch_size=0)


@given(
    max_batch=st.integers(1, 64),
    start=st.integers(0, 1_000),
    steps=st.lists(st.tuples(st.integers(0, 64), st.integers(0, 200)), max_size=60),
)
def test_fetches_alone_never_leave_a_quiet_worker_with_requests_it_does_not_count(
    max_batch: int, start: int, steps: list[tuple[int, int]]
) -> None:
    """A worker drains one queue: each fetch takes at most a batch of what is stored and says
    what is left, and requests keep arriving, counted by events only while it listens. Whenever it
    listens again, what its last fetch counted is at least one: the next fetch, sent after the
    subscription, sees the requests stored meanwhile. Its count of zero is never wrong."""
    stored = start
    counted = start
    listening = True
    for take, arrived in steps:
        stored += arrived
        if listening:
            counted += arrived
        taken = min(take, max_batch, stored)
        stored -= taken
        if taken:
            counted = stored  # the fetch's num_pending
        now = listens(listening=listening, draining=True, waiting=counted, max_batch_size=max_batch)
        if now and not listening:
            assert counted >= 1
        listening = now
        if listening:
            assert counted == stored
        else:
            assert 1 <= counted <= stored


def test_the_line_a_served_model_fills_its_batches_from_is_not_listened_to_at_any_depth() -> None:
    for waiting in (0, 1, 10_000):
        for listening in (True, False):
            assert not listens(listening=listening, draining=True, waiting=waiting, max_batch_size=8, filled=True)
    # A model it no longer drains (another is served, or it left the device): listened to again.
    assert listens(listening=False, draining=False, waiting=0, max_batch_size=8, filled=True)


def _state(**backlogs: tuple[int, bool]) -> sched.SchedulerState:
    """Models by name: (backlog, resident)."""
    models = {
        name: sched.ModelState(
            name=name, backlog=n, oldest_enqueued_at=0.0 if n else None, resident=resident, load_cost_s=1.0,
            batch_cost=sched.BatchCost(0.005, 0.0001), memory_bytes=1, max_batch_size=8,
        )
        for name, (n, resident) in backlogs.items()
    }  # fmt: skip
    return sched.SchedulerState(models, None, sched.Budget())


def test_a_worker_about_to_idle_holds_the_served_models_next_batch_open() -> None:
    state = _state(a=(0, True), b=(0, False))
    assert hold_s(state, "a", until=100.0, now=0.0) == HOLD_S
    # Never past what the idle was for (a timer the policy set), nor a hold too short to pay.
    assert hold_s(state, "a", until=0.002, now=0.0) == 0.002
    assert hold_s(state, "a", until=MIN_HOLD_S / 2, now=0.0) == 0.0


def test_no_hold_when_it_would_keep_anything_else_waiting_or_nothing_is_served() -> None:
    assert hold_s(_state(a=(0, True), b=(3, False)), "a", until=100.0, now=0.0) == 0.0
    assert hold_s(_state(a=(0, True)), None, until=100.0, now=0.0) == 0.0
    assert hold_s(_state(a=(0, False)), "a", until=100.0, now=0.0) == 0.0  # left the device
    assert hold_s(_state(b=(0, True)), "a", until=100.0, now=0.0) == 0.0  # not in view


def test_a_batch_of_more_than_one_request_has_the_worker_serve_from_held_pulls_and_a_lone_one_not() -> None:
    assert not serves_on(1, 64)
    assert serves_on(2, 64) and serves_on(64, 64)
    assert not serves_on(1, 1)  # a model that batches nothing never does


def test_after_a_hold_came_back_empty_it_takes_a_bigger_batch_to_serve_from_held_pulls_again() -> None:
    """Requests in pairs with pauses just past the hold: each pair would pay a hold, a count and
    a subscription change. After an empty hold, a batch of SERVING_AGAIN_FROM (or a full one)
    says the traffic is dense enough."""
    assert not serves_on(2, 64, missed=True)
    assert not serves_on(SERVING_AGAIN_FROM - 1, 64, missed=True)
    assert serves_on(SERVING_AGAIN_FROM, 64, missed=True)
    assert serves_on(4, 4, missed=True)  # a full batch of a small model
    assert not serves_on(1, 1, missed=True)
