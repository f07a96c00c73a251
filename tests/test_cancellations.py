"""Cancel notices (sidecar/worker/cancellations.py) and the rule that no load is paid for a queue
whose callers are gone (policy.Driver.callers_gone): by state, with a fake clock, and on hostile
input; the live paths are in test_worker_scheduling.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.policy import BatchCost, CostEstimator, Driver, make_policy
from jetbatch.sidecar.worker.cancellations import Cancellations
from jetbatch.sidecar.worker.control import RateBound, RatesByKey
from jetbatch.sidecar.worker.counters import Counters
from jetbatch.sidecar.worker.queues import QueueView
from jetbatch.sidecar.worker.slots import Slot

SUBJECTS = Subjects("jb")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cancel_reaches_only_requests_of_the_tenant_of_its_subject() -> None:
    heard: list[tuple[str, str]] = []
    cancels = Cancellations(None, SUBJECTS, on_cancel=heard.append)
    assert cancels.note("jb.cancel.app1", b"r1")
    assert cancels.note("jb.cancel", b"r2")
    assert cancels.cancelled("app1", "r1") and not cancels.cancelled("app2", "r1") and not cancels.cancelled(None, "r1")
    assert cancels.cancelled(None, "r2") and not cancels.cancelled("app1", "r2")
    assert heard == [("app1", "r1"), ("", "r2")]


def test_notices_are_forgotten_after_their_ttl_and_beyond_the_bound() -> None:
    clock = Clock()
    cancels = Cancellations(None, SUBJECTS, max_entries=3, ttl_s=10.0, clock=clock)
    for rid in (b"a", b"b", b"c", b"d"):
        cancels.note("jb.cancel", rid)
    assert len(cancels) == 3 and not cancels.cancelled(None, "a")  # the oldest went first
    clock.now += 10.0
    assert not cancels.cancelled(None, "d")  # expired
    cancels.note("jb.cancel", b"e")
    assert len(cancels) == 1  # the expired ones are dropped on the next notice


def test_a_tenant_past_its_rate_is_dropped_and_counted_while_another_is_heard() -> None:
    clock = Clock()
    counters = Counters()
    cancels = Cancellations(None, SUBJECTS, per_tenant_per_s=3.0, counters=counters, clock=clock)
    assert [cancels.note("jb.cancel.a", b"r%d" % i) for i in range(5)] == [True] * 3 + [False] * 2
    assert counters["cancels_dropped"] == 2 and counters["cancels_heard"] == 3
    assert cancels.note("jb.cancel.b", b"r1") and cancels.cancelled("b", "r1")  # b's own budget
    assert not cancels.cancelled("a", "r4")
    clock.now += 1.0
    assert cancels.note("jb.cancel.a", b"r5")  # a second later, a's budget is back


def test_a_rate_bound_pauses_a_reader_for_what_it_read_past_its_rate() -> None:
    clock = Clock()
    bound = RateBound(100.0, 10.0, clock=clock)
    assert [bound.wait_s() for _ in range(10)] == [0.0] * 10  # the burst
    assert bound.wait_s(5) == pytest.approx(0.05)  # 5 units owed at 100 a second
    clock.now += 0.05
    assert bound.wait_s() == pytest.approx(0.01)  # never shorter than one pause
    assert not bound.take()  # still owed
    clock.now += 1.0
    assert bound.take()


def test_rates_by_key_keep_a_bounded_table() -> None:
    rates = RatesByKey(1.0, max_keys=2, clock=Clock())
    assert rates.take("a") and rates.take("b") and not rates.take("a")
    assert rates.take("c")  # "b" was the least recently used: forgotten
    assert rates.take("b")  # a fresh budget, since it was forgotten


@given(st.text(max_size=80), st.binary(max_size=200))
def test_a_hostile_notice_never_raises_and_names_only_a_request_id(subject: str, data: bytes) -> None:
    cancels = Cancellations(None, SUBJECTS)
    if cancels.note(subject, data):
        assert subject == "jb.cancel" or subject.startswith("jb.cancel.")
        assert 1 <= len(data) <= 64 and data.decode().replace("_", "").replace("-", "").isalnum()


def _slot(name: str = "m1") -> Slot:
    return Slot(name=name, config=SimpleNamespace(), handler=None, window=None)  # type: ignore[arg-type]


def test_a_cancelled_waiting_request_is_marked_in_its_queue_until_it_leaves() -> None:
    slot = _slot()
    view = QueueView({"m1": slot})
    view.arrived(slot, 1.0, None, key=("", "r1"))
    view.arrived(slot, 2.0, None, key=("", "r2"))
    assert view.cancel(("", "r1")) and not view.cancel(("", "elsewhere"))
    assert slot.cancelled_keys == {("", "r1")} and slot.backlog == 2  # still to be answered
    view.fetched(slot, 1, pending=1)
    assert slot.cancelled_keys == set()  # it left with the fetch
    assert not view.cancel(("", "r1"))


def _driver(load_cost_s: float = 1.0, batch_s: float = 0.1) -> Driver:
    costs = CostEstimator()
    costs.seed("m1", load_cost_s=load_cost_s, batch_cost=BatchCost(batch_s, 0.0), memory_bytes=1)
    return Driver(make_policy("cost-aware"), costs)


def test_callers_are_gone_when_cancelled_or_due_before_the_load_and_a_batch_end() -> None:
    driver = _driver()
    now = 100.0
    # Cancelled, passed, due within the load (1 s) and a batch (0.1 s): nobody to serve.
    gone, horizon = driver.callers_gone("m1", "cold", [(None, True), (99.0, False), (101.05, False)], now)
    assert gone and horizon == 1.1
    # One caller can still be answered: the load goes ahead.
    assert not driver.callers_gone("m1", "cold", [(None, True), (101.2, False)], now)[0]
    assert not driver.callers_gone("m1", "cold", [(None, False)], now)[0]  # no deadline: wanted
    assert not driver.callers_gone("m1", "cold", [], now)[0]  # nothing known waits: not this rule's call
    # A probe counts only deadlines already passed, so an inflated estimate cannot lock a model out.
    assert not driver.callers_gone("m1", "cold", [(101.05, False)], now, probe=True)[0]
    assert driver.callers_gone("m1", "cold", [(99.0, False), (None, True)], now, probe=True) == (True, 0.0)


def test_a_cancel_heard_before_the_arrival_event_still_counts() -> None:
    """A tenant's request reaches the workers through the classifier, its cancel straight: the
    arrival of a request already cancelled is marked at once (no load for it)."""
    from jetbatch.sidecar.worker.arrivals import ArrivalFeed

    slot = _slot()
    view = QueueView({"m1": slot})
    cancels = Cancellations(None, SUBJECTS, on_cancel=lambda key: view.cancel(key))
    feed = ArrivalFeed(None, SUBJECTS, {"m1": slot}, view, on_arrival=lambda: None, cancelled=cancels.cancelled)
    cancels.note("jb.cancel.t1", b"r1")
    feed.note("jb.arrived.m1", {"Nats-Msg-Id": "t1.r1", "Jetbatch-Tenant": "t1"}, now=5.0)
    feed.note("jb.arrived.m1", {"Nats-Msg-Id": "r2"}, now=5.0)
    assert slot.cancelled_keys == {("t1", "r1")} and slot.backlog == 2
    assert not cancels.note("jb.cancel", b"r3\n")  # a trailing newline is no request id
