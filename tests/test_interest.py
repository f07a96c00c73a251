"""Whether a worker listens to the arrivals of the model it drains (sidecar/policy/interest.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jetbatch.sidecar.policy import LISTEN_BELOW_BATCHES, QUIET_FROM_BATCHES, listens


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
