"""The worker's view of its queues (sidecar/worker/queues.py): the counting rules by state, the
arrival feed on hostile headers, and the event-driven backlog against a real nats-server,
including a dead worker's stranded requests."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any, AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg
from hypothesis import given
from hypothesis import strategies as st

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import Headers, Subjects
from jetbatch.sidecar.config import StreamsConfig
from jetbatch.sidecar.streams import ensure_model_consumer, ensure_streams, model_consumer_name
from jetbatch.sidecar.worker.arrivals import ArrivalFeed
from jetbatch.sidecar.worker.counters import Counters
from jetbatch.sidecar.worker.counting import StreamCounts, count_queues
from jetbatch.sidecar.worker.queues import QueueView
from jetbatch.sidecar.worker.stream_facts import LineStored, line_stored, missed_by, parse_stream_timestamp
from jetbatch.sidecar.worker.slots import Slot
from tests.helpers import wait_until


def _slot(name: str = "m1") -> Slot:
    return Slot(name=name, config=SimpleNamespace(), handler=None, window=None)  # type: ignore[arg-type]


def _view(*names: str) -> tuple[QueueView, dict[str, Slot]]:
    slots = {n: _slot(n) for n in names}
    return QueueView(slots), slots


def test_arrivals_count_and_the_oldest_is_the_head() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    for at in (10.0, 11.0, 12.0):
        view.arrived(s, at, None)
    assert s.backlog == 3 and s.oldest_enqueued_at == 10.0 and view.waiting == {"m1"}
    view.fetched(s, 2, pending=1)
    assert s.backlog == 1 and s.oldest_enqueued_at == 12.0  # the head went with the fetch
    view.fetched(s, 1, pending=0)
    assert s.backlog == 0 and s.oldest_enqueued_at is None and view.waiting == set()


def test_each_tenants_waiting_requests_are_counted_until_fetched() -> None:
    """What the advert tells the classifier's tenant quotas (tenancy.py, tenant_backlog)."""
    view, slots = _view("m1", "m2")
    view.arrived(slots["m1"], 10.0, None, key=("a", "r1"), seq=1)
    view.arrived(slots["m1"], 10.1, None, key=("b", "r2"), seq=2)
    view.arrived(slots["m2"], 10.2, None, key=("a", "r3"), seq=1)
    view.arrived(slots["m2"], 10.3, None, seq=2)  # no key (a malformed header): not a tenant's
    assert view.tenant_waiting == {"a": 2, "b": 1}
    view.fetched(slots["m1"], 1, pending=1, last_seq=1)
    assert view.tenant_waiting == {"a": 1, "b": 1}
    view.fetched(slots["m2"], 2, pending=0, last_seq=2)
    view.fetched(slots["m1"], 1, pending=0, last_seq=2)
    assert view.tenant_waiting == {}


def test_an_arrival_stored_after_the_delivery_a_fetch_counts_from_stays_counted() -> None:
    """The consumer's count on a delivery is as of that delivery. A request stored just after it,
    whose arrival event was counted before the fetch's answer was read, is still waiting: the
    count must not erase it (it waited for the next count of the queue, up to a second)."""
    view, slots = _view("m1")
    s = slots["m1"]
    view.arrived(s, 10.0, None, seq=7)  # A
    view.arrived(s, 10.001, None, seq=8)  # B: stored after A was delivered, counted before the fetch was read
    view.fetched(s, 1, pending=0, last_seq=7)  # A, with nothing left undelivered when it went out
    assert s.backlog == 1 and s.oldest_enqueued_at == 10.001 and view.waiting == {"m1"}
    view.fetched(s, 1, pending=0, last_seq=8)  # B
    assert s.backlog == 0 and view.waiting == set()


def test_arrivals_before_the_delivery_or_of_unknown_sequence_leave_the_count_to_the_consumer() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    for seq in (3, 4, 5):
        view.arrived(s, float(seq), None, seq=seq)
    view.fetched(s, 3, pending=0, last_seq=5)  # all three taken
    assert s.backlog == 0
    view.arrived(s, 6.0, None)  # an event without a sequence: not known to come after
    view.arrived(s, 7.0, None, seq=7)
    view.fetched(s, 1, pending=1, last_seq=6)  # the consumer's own count says one is left
    assert s.backlog == 1 and s.oldest_enqueued_at == 7.0
    view.arrived(s, 8.0, None, seq=9)
    view.arrived(s, 9.0, None, seq=10)
    view.fetched(s, 1, pending=0)  # no sequence to go by: the consumer's count stands
    assert s.backlog == 0


def test_two_classes_count_as_two_lines_and_the_interactive_head_is_its_own() -> None:
    """Batch-class requests count in the backlog and in ``bulk``; a fetch from one line leaves
    the other's count and times alone; peers are taken to pull the interactive line first."""
    view, slots = _view("m1")
    s = slots["m1"]
    view.arrived(s, 1.0, None, bulk=True)
    view.arrived(s, 2.0, None, bulk=True)
    view.arrived(s, 3.0, None)
    view.arrived(s, 4.0, None)
    assert (s.backlog, s.bulk, s.interactive) == (4, 2, 2)
    assert s.oldest_enqueued_at == 1.0 and s.interactive_enqueued_at == 3.0
    view.fetched(s, 2, pending=0)  # the interactive line, emptied
    assert (s.backlog, s.bulk, s.interactive, s.interactive_enqueued_at, s.oldest_enqueued_at) == (2, 2, 0, None, 1.0)
    view.arrived(s, 5.0, None)
    view.fetched(s, 1, pending=1, bulk=True)  # one batch-class request taken, one left
    assert (s.backlog, s.bulk, s.oldest_enqueued_at, s.interactive_enqueued_at) == (2, 1, 2.0, 5.0)
    view.peer_took(s, "w2", 2, now=6.0)  # the interactive one first, then the batch one
    assert (s.backlog, s.bulk) == (0, 0)
    # The count: 3 stored on the batch line, 1 of them ours in flight; 1 interactive stored.
    view.reconcile(s, 4, now=7.0, mine=1, not_ours=0, stored_bulk=3, mine_bulk=1)
    assert (s.backlog, s.bulk, s.interactive) == (3, 2, 1)
    # A peer holds 32 of the batch line's: the one interactive request stays interactive (the
    # peers' share is counted against the batch line first).
    view.arrived(s, 8.0, None)
    view.reconcile(s, 133, now=9.0, mine=0, not_ours=32, stored_bulk=132, mine_bulk=0)
    assert (s.backlog, s.bulk, s.interactive, s.interactive_enqueued_at) == (101, 100, 1, 8.0)


def _after_one_by_one(seqs: list[int | None], seq: int) -> int:
    """The newest arrivals stored after ``seq``, counted back until one is not (the rule)."""
    n = 0
    for s in reversed(seqs):
        if s is None or s <= seq:
            break
        n += 1
    return n


@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("arrive"), st.integers(1, 5)),  # the next sequences, some skipped (other lines)
            st.tuples(st.just("forged"), st.one_of(st.none(), st.integers(0, 10**6))),
            st.tuples(st.just("fetch"), st.integers(0, 40)),
        ),
        max_size=60,
    )
)
def test_a_fetch_keeps_counted_what_was_stored_after_it_whatever_events_came(steps: list[tuple[str, Any]]) -> None:
    """In stream order a fetch finds the arrivals stored after it by bisection; a forged or
    unsequenced event among them makes it count back one by one, as the rule says, until that
    event has left the line. Either way the count is the rule's."""
    view, slots = _view("m1")
    s = slots["m1"]
    seq = 0
    for kind, value in steps:
        if kind == "arrive":
            seq += value
            view.arrived(s, float(seq), None, seq=seq)
        elif kind == "forged":
            view.arrived(s, 0.0, None, seq=value)
        else:
            seqs = [entry[3] for entry in s.known_times]
            last = max(0, seq - value)  # the fetched message's sequence: somewhere behind the newest
            expected = _after_one_by_one(seqs, last)
            view.fetched(s, 1, pending=0, last_seq=last)
            assert s.backlog == expected


def test_the_feed_counts_a_batch_line_arrival_as_batch() -> None:
    view, slots = _view("m1")
    subjects = Subjects("jb")
    feed = ArrivalFeed(None, subjects, slots, view, on_arrival=lambda: None)
    feed.note(subjects.arrived("m1", "batch"), {"Nats-Time-Stamp": "2026-12-04T16:07:39.5Z"}, now=2e9)
    feed.note(subjects.arrived("m1"), {}, now=2e9)
    feed.note("jb.arrived.m1.bulk", {}, now=2e9)  # not a class: no model "m1.bulk"
    assert (slots["m1"].backlog, slots["m1"].bulk) == (2, 1)


def test_the_feed_reads_the_stream_sequence_of_an_arrival_and_nothing_forged() -> None:
    view, slots = _view("m1")
    subjects = Subjects("jb")
    feed = ArrivalFeed(None, subjects, slots, view, on_arrival=lambda: None)
    for text in ("41", "-1", "1e3", "４２", "9" * 21, "", " 7"):
        feed.note(subjects.arrived("m1"), {"Nats-Sequence": text}, now=2e9)
    assert [entry[3] for entry in slots["m1"].known_times] == [41, None, None, None, None, None, None]


def test_an_arrival_event_that_lands_after_a_count_holding_its_request_is_not_counted_again() -> None:
    """Events are read on a connection of their own, so one may land after the answer of a count
    (whole, of its line, or a fetch's) that already holds its request: counted again, each such
    event over-counted the line by one until the next count. A stream made again starts its
    sequences over, and the next whole count says so."""
    view, slots = _view("m1")
    subjects = Subjects("p")
    feed = ArrivalFeed(None, subjects, slots, view, on_arrival=lambda: None)
    s = slots["m1"]
    view.counted({"p.model.m1": 2}, 20, 1.0, subjects=subjects, mine={}, not_ours={}, mine_bulk={})
    assert s.backlog == 2
    for seq in ("19", "20"):  # stored before the count's last sequence: in it
        feed.note(subjects.arrived("m1"), {"Nats-Sequence": seq}, now=1.1)
    assert s.backlog == 2
    feed.note(subjects.arrived("m1"), {"Nats-Sequence": "21"}, now=1.1)  # stored after it
    feed.note(subjects.arrived("m1"), {}, now=1.1)  # no sequence: a hint, counted as before
    assert s.backlog == 4
    # A fetch of the batch line says what its consumer held when it delivered sequence 30.
    view.fetched(s, 1, 0, bulk=True, last_seq=30)
    feed.note(subjects.arrived("m1", "batch"), {"Nats-Sequence": "30"}, now=1.2)
    assert s.bulk == 0
    feed.note(subjects.arrived("m1"), {"Nats-Sequence": "30"}, now=1.2)  # the other line: not in that count
    assert s.interactive == 5
    # The stream was made again: a whole count at sequence 3 replaces what the counts held.
    view.counted({}, 3, 2.0, subjects=subjects, mine={}, not_ours={}, mine_bulk={})
    before = s.backlog
    feed.note(subjects.arrived("m1"), {"Nats-Sequence": "4"}, now=2.1)
    assert s.backlog == before + 1


def _delivery(delivered: int, seq: int, *, stored_s: float = 5.0, headers: dict[str, str] | None = None) -> Msg:
    """A delivery of the models stream: its ack subject says how often it was delivered, its
    stream sequence, and when it was stored."""
    reply = f"$JS.ACK.S.C.{delivered}.{seq}.{seq}.{int(stored_s * 1e9)}.0"
    return Msg(None, subject="p.model.m1", reply=reply, data=b"", headers=headers)  # type: ignore[arg-type]


def test_a_count_missed_the_deliveries_it_had_made_and_the_redeliveries() -> None:
    """``missed_by``: a consumer count (its last delivered stream sequence 10) left out what it
    had delivered by then (still on its way to the puller) and redeliveries (unacked while they
    waited); a first delivery after it was undelivered then, and is in it. A message with no
    JetStream ack subject is no request."""
    before, again = missed_by(SimpleNamespace(delivered=SimpleNamespace(stream_seq=10)))
    assert before(_delivery(1, 9)) is True and before(_delivery(1, 10)) is True
    # A later first delivery was made after the count, so after every earlier one: none later can be missed.
    assert before(_delivery(1, 11)) is None
    assert before(_delivery(2, 9)) is False and again(_delivery(2, 9)) and again(_delivery(3, 11))
    assert not again(_delivery(1, 9))
    forged = Msg(None, subject="p.model.m1", reply="$JS.ACK.S.C.x.9.9.0.0", data=b"")  # type: ignore[arg-type]
    for message in (forged, Msg(None, subject="x", reply="", data=b"")):  # type: ignore[arg-type]
        assert before(message) is False and not again(message)


def test_a_delivery_a_count_missed_is_counted_as_its_arrival_event_would_be() -> None:
    view, slots = _view("m1")
    woken: list[int] = []
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: woken.append(1))
    s = slots["m1"]
    feed.missed(s, _delivery(1, 9, stored_s=4.0, headers={Headers.DEADLINE: "7000"}), bulk=False, now=5.0)
    feed.missed(s, _delivery(1, 12, headers={Headers.DEADLINE: "not a deadline"}), bulk=True, now=5.0)
    assert (s.backlog, s.bulk, s.interactive) == (2, 1, 1) and woken == [1, 1]
    assert s.oldest_enqueued_at == 4.0 and s.known_times[0][1] == 7.0  # stored at 4 s, its deadline 7 s
    assert [entry[3] for entry in s.known_times] == [9] and [entry[3] for entry in s.known_bulk] == [12]
    feed.missed(s, Msg(None, subject="p.model.m1", reply="", data=b""), bulk=False, now=6.0)  # type: ignore[arg-type]
    assert s.backlog == 3 and s.known_times[-1][0] == 6.0  # no ack subject: counted as stored now


def test_an_arrival_stored_after_the_count_was_taken_stays_counted() -> None:
    """The stream's count is as of its last sequence. An arrival counted while the count was on
    its way, stored after it, is not in it: the count must not erase it (it waited for the next
    count, a poll interval, or a second when idle)."""
    view, slots = _view("m1")
    s = slots["m1"]
    view.arrived(s, 5.0, None, seq=11)
    view.arrived(s, 5.1, None, bulk=True, seq=12)
    view.reconcile(s, 0, now=5.2, mine=0, not_ours=0, last_seq=10)
    assert (s.backlog, s.bulk, s.interactive) == (2, 1, 1)
    assert s.oldest_enqueued_at == 5.0
    view.reconcile(s, 0, now=5.3, mine=0, not_ours=0, last_seq=12)  # both gone by then (a peer took them)
    assert s.backlog == 0


def test_requests_stored_while_a_line_was_not_listened_to_are_not_held_back_as_anothers() -> None:
    """A fetch found nothing where the count said 5 (delivered elsewhere): held back. Three
    requests were then stored while the worker did not listen to the line; no event counted them.
    Listening again ends the hold: the count after it shows them (the hold spared only arrivals
    seen since, so it masked all three until it ended and the next count came)."""
    view, slots = _view("m1")
    s = slots["m1"]
    for seq in range(1, 6):
        view.arrived(s, float(seq), None, seq=seq)
    view.found_empty(s, now=100.0, ack_wait_s=30.0)
    assert s.backlog == 0 and s.unfetchable == 5
    view.listened_again(s)
    view.reconcile(s, 3, now=100.1, mine=0, not_ours=0)
    assert s.backlog == 3 and view.waiting == {"m1"}


def test_a_line_listened_to_again_counts_its_consumers_undelivered_or_the_arrivals_since() -> None:
    """The line's consumer said 3 wait undelivered; 5 arrival events were counted while it was
    asked: at least 5 wait. The other line's count is left as it was."""
    view, slots = _view("m1")
    s = slots["m1"]
    view.arrived(s, 1.0, None, bulk=True, seq=1)
    view.line_counted(s, 3, 0)
    assert (s.interactive, s.bulk) == (3, 1)
    view.line_counted(s, 3, 5)
    assert (s.interactive, s.bulk) == (5, 1)
    view.line_counted(s, 0, 0, bulk=True)
    assert (s.interactive, s.bulk) == (5, 0) and view.waiting == {"m1"}


def test_a_line_listened_to_again_counts_what_the_stream_stores_when_its_consumers_count_lags() -> None:
    """nats-server adds a stored message to its consumers' undelivered count from another
    goroutine: asked just after the store, the consumer can say 0 where the stream already
    stores the request. The stream's count of the line, less what the consumer has delivered
    unacked, plus what this worker's puller holds for its next fetch, is a lower bound too; the
    known arrivals stored after the stream's count are added (that count is older)."""
    view, slots = _view("m1")
    s = slots["m1"]
    view.line_counted(s, 0, 0, stored=LineStored(1, 10))
    assert s.interactive == 1 and view.waiting == {"m1"}
    # 5 stored: 3 delivered unacked (one of them in our puller), and 2 undelivered.
    view.line_counted(s, 0, 0, stored=LineStored(5, 10), unacked=3, missed=1)
    assert s.interactive == 3
    # An arrival stored after the stream's count (sequence 11) is not in it: added.
    view.arrived(s, 1.0, None, seq=11)
    view.line_counted(s, 0, 0, stored=LineStored(2, 10), unacked=0)
    assert s.interactive == 3
    # The consumer's count, when it is ahead (an event seen since), stays the floor.
    view.line_counted(s, 4, 0, stored=LineStored(2, 10), unacked=0, missed=1)
    assert s.interactive == 5
    # Nothing stored and nothing pending: the line is empty, the other line kept.
    view.arrived(s, 2.0, None, bulk=True, seq=12)
    view.line_counted(s, 0, 0, stored=LineStored(0, 12))
    assert (s.interactive, s.bulk) == (0, 1)


def test_line_stored_reads_a_filtered_stream_info_and_never_raises() -> None:
    ok = SimpleNamespace(state=SimpleNamespace(subjects={"p.model.m1": 3, "p.model.m1.batch": 9}, last_seq=41))
    assert line_stored(ok, "p.model.m1") == LineStored(3, 41)
    assert line_stored(SimpleNamespace(state=SimpleNamespace(subjects=None, last_seq=41)), "p.model.m1") == LineStored(0, 41)
    for odd in (None, SimpleNamespace(state=None), SimpleNamespace(state=SimpleNamespace(subjects=["x"], last_seq="7"))):
        assert line_stored(odd, "p.model.m1") == LineStored(0, None)


def test_a_reconcile_sets_the_count_and_subtracts_what_workers_hold() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    for at in (1.0, 2.0, 3.0, 4.0):
        view.arrived(s, at, None)
    # 4 stored, 1 in flight here, 1 at a live peer: 2 are ours to chase, the newest two.
    view.reconcile(s, 4, now=5.0, mine=1, not_ours=1)
    assert s.backlog == 2 and s.oldest_enqueued_at == 3.0


def test_stranded_requests_count_until_a_fetch_finds_them_gone_then_wait_one_ack_wait() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    # A dead worker left 3 delivered-unacked requests nobody advertises: they count as backlog.
    view.reconcile(s, 3, now=0.0, mine=0, not_ours=0)
    assert s.backlog == 3 and s.stranded == 3
    view.found_empty(s, now=1.0, ack_wait_s=30.0)
    assert s.backlog == 0 and s.unfetchable == 3
    view.reconcile(s, 3, now=2.0, mine=0, not_ours=0)
    assert s.backlog == 0  # held back: not fetchable until they are redelivered
    # A new request is not masked by the held-back ones.
    view.arrived(s, 3.0, None)
    view.reconcile(s, 4, now=3.5, mine=0, not_ours=0)
    assert s.backlog == 1 and s.oldest_enqueued_at == 3.0
    # After one ack wait every stranded request is due again: all count.
    view.reconcile(s, 4, now=31.5, mine=0, not_ours=0)
    assert s.backlog == 4 and s.unfetchable == 0


def test_a_hold_ends_one_ack_wait_after_the_requests_were_first_seen_stranded() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    view.reconcile(s, 1, now=0.0, mine=0, not_ours=0)  # a lost ack: stranded from t = 0
    view.found_empty(s, now=20.0, ack_wait_s=30.0)  # found by a fetch for another model's load
    assert s.hold_until == 30.0  # due again by then, not at 20 + 30
    view.reconcile(s, 1, now=30.5, mine=0, not_ours=0)
    assert s.backlog == 1
    view.found_empty(s, now=30.6, ack_wait_s=30.0)  # not redelivered yet: look again soon
    assert s.hold_until == pytest.approx(31.6)


def test_a_resident_models_stranded_requests_are_looked_for_every_second() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    s.place.tier = "resident"  # a fetch costs no load: look again soon, the redelivery may be due now
    view.reconcile(s, 1, now=0.0, mine=0, not_ours=0)
    view.found_empty(s, now=5.0, ack_wait_s=30.0)
    assert s.hold_until == pytest.approx(6.0) and s.backlog == 0
    view.reconcile(s, 1, now=6.5, mine=0, not_ours=0)
    assert s.backlog == 1


def test_requests_no_consumer_will_deliver_are_held_back_until_they_are_gone() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    s.place.tier = "resident"
    view.reconcile(s, 1, now=0.0, mine=0, not_ours=0)  # left behind in the stream after a leader loss
    view.found_empty(s, now=1.0, ack_wait_s=30.0, unreachable=True)
    view.reconcile(s, 1, now=1000.0, mine=0, not_ours=0)
    assert s.backlog == 0  # never chased again
    view.arrived(s, 1001.0, None)
    view.reconcile(s, 2, now=1002.0, mine=0, not_ours=0)
    assert s.backlog == 1  # a real arrival is not masked


def test_held_back_requests_shrink_as_they_are_acked() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    view.reconcile(s, 5, now=0.0, mine=0, not_ours=0)
    view.found_empty(s, now=0.0, ack_wait_s=30.0)
    view.reconcile(s, 2, now=1.0, mine=0, not_ours=0)  # a peer acked 3 of them
    assert s.unfetchable == 2 and s.backlog == 0


def test_arrivals_after_a_hold_are_never_masked_by_it() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    view.reconcile(s, 5, now=0.0, mine=0, not_ours=0)
    view.found_empty(s, now=0.0, ack_wait_s=30.0)  # 5 held back (a peer had them, unadvertised)
    view.arrived(s, 1.0, None)
    view.arrived(s, 1.5, None)
    view.reconcile(s, 2, now=2.0, mine=0, not_ours=0)  # the peer acked its 5; two new ones wait
    assert s.backlog == 2 and s.unfetchable == 0 and s.oldest_enqueued_at == 1.0


def test_an_unknown_head_is_read_once() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    view.reconcile(s, 2, now=10.0, mine=0, not_ours=0)  # stored before we listened
    assert view.needs_head(s)
    view.set_unknown_head(s, 4.0, 99.0)
    assert not view.needs_head(s) and s.oldest_enqueued_at == 4.0 and s.head_deadline == 99.0
    view.arrived(s, 11.0, None)
    assert s.oldest_enqueued_at == 4.0  # the older head stays the head


@given(st.text(max_size=60))
def test_a_forged_timestamp_never_raises(text: str) -> None:
    at = parse_stream_timestamp(text)
    assert at is None or isinstance(at, float)


def _timestamp_as_before(text: str) -> float | None:
    """The parser before its per-minute shortcut: a datetime for every timestamp."""
    from datetime import datetime, timezone

    if not text or len(text) > 40 or not text.endswith("Z"):
        return None
    base, _, frac = text[:-1].partition(".")
    if frac and not frac.isdigit():
        return None
    try:
        seconds = datetime.fromisoformat(base).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
    return seconds + (float(f"0.{frac}") if frac else 0.0)


_DIGITS = st.sampled_from("0123456789") | st.sampled_from(["٣", "²", " ", ":", "T", "-", "6", "9"])


@given(st.datetimes(), st.lists(_DIGITS, min_size=0, max_size=3), st.integers(min_value=0, max_value=18), st.text("0123456789", max_size=10))
def test_a_timestamp_reads_as_it_did_before_the_shortcut(at: Any, noise: list[str], where: int, frac: str) -> None:
    """Valid timestamps, and ones with a character or three forged into them."""
    text = at.strftime("%Y-%m-%dT%H:%M:%S")
    forged = text[:where] + "".join(noise) + text[where + len(noise):] if noise else text
    for candidate in (text, forged):
        full = candidate + (f".{frac}" if frac else "") + "Z"
        assert parse_stream_timestamp(full) == _timestamp_as_before(full)


def test_stream_timestamps_parse_to_unix_seconds() -> None:
    assert parse_stream_timestamp("1970-01-01T00:00:01.5Z") == 1.5
    assert parse_stream_timestamp("2026-12-04T16:07:39.458084362Z") == pytest.approx(1796400459.458084362)
    assert parse_stream_timestamp("2026-12-04T16:07:39Z") == 1796400459.0
    assert parse_stream_timestamp("2026-12-04T16:07:39.x5Z") is None
    assert parse_stream_timestamp("9" * 41 + "Z") is None


def test_the_feed_ignores_unknown_models_and_reads_bad_headers_safely() -> None:
    view, slots = _view("m1")
    woken: list[int] = []
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: woken.append(1))
    feed.note("p.arrived.ghost", {"Nats-Time-Stamp": "1970-01-01T00:00:01Z"}, now=5.0)
    feed.note("q.arrived.m1", None, now=5.0)
    assert slots["m1"].backlog == 0 and not woken
    feed.note("p.arrived.m1", {"Nats-Time-Stamp": "garbage", Headers.DEADLINE: "not a number"}, now=5.0)
    feed.note("p.arrived.m1", {"Nats-Time-Stamp": "1970-01-01T00:00:09Z"}, now=5.0)  # from the future: capped
    assert slots["m1"].backlog == 2 and slots["m1"].oldest_enqueued_at == 5.0 and slots["m1"].head_deadline is None
    assert len(woken) == 2


async def _published(js: Any, subject: str, n: int) -> None:
    for i in range(n):
        await js.publish(subject, f"r{i}".encode())


@contextlib.asynccontextmanager
async def _streams(nats_url: str, prefix: str, models: list[str]) -> AsyncIterator[tuple[Any, Any, Subjects]]:
    """A connection, its JetStream context and the subjects of ``prefix``, with the streams made."""
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, subjects, StreamsConfig(), models)
        yield nc, js, subjects
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_a_batch_acked_while_the_count_is_on_its_way_is_not_subtracted_twice(nats_url: str, prefix: str) -> None:
    """What this worker holds is read once the stream's count is back. A batch acked and settled
    while the count was on its way is gone from the count already; read before it and subtracted
    again, it hid as many waiting requests until the next count (a poll interval)."""
    async with _streams(nats_url, prefix, ["m1"]) as (_nc, js, subjects):
        view, slots = _view("m1")
        await _published(js, subjects.model("m1"), 3)
        await ensure_model_consumer(js, subjects, StreamsConfig(), "m1")
        psub = await js.pull_subscribe_bind(durable=model_consumer_name("m1"), stream=subjects.models_stream)
        batch = await psub.fetch(2, timeout=5)
        held = {"m1": len(batch)}  # this worker's in-flight record

        class AckedDuringTheCount:
            """The real JetStream context, with the batch acked (confirmed) and settled between
            the count's request and its answer."""

            async def stream_info(self, *args: Any, **kwargs: Any) -> Any:
                for msg in batch:
                    await msg.ack_sync()
                held["m1"] = 0
                return await js.stream_info(*args, **kwargs)

            def __getattr__(self, name: str) -> Any:
                return getattr(js, name)

        assert await count_queues(view, AckedDuringTheCount(), subjects, now=time.time(), mine=lambda: dict(held), not_ours={})
        assert slots["m1"].backlog == 1


@pytest.mark.anyio
async def test_stream_counts_read_what_the_stream_info_says_without_its_configuration(nats_url: str, prefix: str) -> None:
    """``StreamCounts`` asks the stream-info API itself and reads only the stored counts (the
    configuration lists two subjects a registered model); what it reads is what nats-py's
    ``stream_info`` reads, and an API error is nats-py's exception for it."""
    async with _streams(nats_url, prefix, ["m1", "m2"]) as (nc, js, subjects):
        await _published(js, subjects.model("m1"), 3)
        await _published(js, subjects.model("m2", "batch"), 2)
        counts = StreamCounts(nc)
        for subject_filter in (subjects.models_wildcard, subjects.model("m1"), subjects.model("m2")):
            ours = await counts.stream_info(subjects.models_stream, subjects_filter=subject_filter)
            theirs = await js.stream_info(subjects.models_stream, subjects_filter=subject_filter)
            assert ours.state is not None and ours.state.last_seq == theirs.state.last_seq
            assert (ours.state.subjects or {}) == (theirs.state.subjects or {})
        assert line_stored(await counts.stream_info(subjects.models_stream, subjects_filter=subjects.model("m1")), subjects.model("m1")).messages == 3
        with pytest.raises(failures.NOT_FOUND):
            await counts.stream_info(f"{subjects.models_stream}_NONE")
        view, slots = _view("m1", "m2")
        assert await count_queues(view, js, subjects, now=time.time(), mine={}, not_ours={}, counts=counts)
        assert (slots["m1"].backlog, slots["m2"].backlog, slots["m2"].bulk) == (3, 2, 2)


@pytest.mark.anyio
async def test_the_backlog_comes_from_events_and_one_count_with_stranded_requests(nats_url: str, prefix: str) -> None:
    async with _streams(nats_url, prefix, ["m1", "m2"]) as (nc, js, subjects):
        cfg = StreamsConfig()
        view, slots = _view("m1", "m2")
        feed = ArrivalFeed(nc, subjects, slots, view, on_arrival=lambda: None)
        await feed.start()
        await _published(js, subjects.model("m1"), 3)
        # No consumer exists (they are made on demand): the stream's republished headers count.
        await wait_until(lambda: slots["m1"].backlog == 3, timeout_s=10, what="three arrival events")
        assert slots["m2"].backlog == 0 and view.waiting == {"m1"}
        assert await count_queues(view, js, subjects, now=time.time(), mine={}, not_ours={})
        assert slots["m1"].backlog == 3
        # A worker that fetches two and dies without acking leaves them stranded: still backlog.
        await ensure_model_consumer(js, subjects, cfg, "m1")
        dead = await js.pull_subscribe_bind(durable=model_consumer_name("m1"), stream=subjects.models_stream)
        assert len(await dead.fetch(2, timeout=5)) == 2
        assert await count_queues(view, js, subjects, now=time.time(), mine={}, not_ours={})
        assert slots["m1"].backlog == 3
        # A live peer that advertises the two as in flight takes them off our backlog.
        assert await count_queues(view, js, subjects, now=time.time(), mine={}, not_ours={"m1": 2})
        assert slots["m1"].backlog == 1
        await feed.stop()


@pytest.mark.anyio
async def test_a_quiet_line_s_arrivals_are_not_sent_and_listening_again_counts_them(nats_url: str, prefix: str) -> None:
    """Quiet on m1's interactive line: its events stop at the server (not sent, not just not
    counted), its batch line's and other models' keep coming; listening again counts the next.
    The batch line goes quiet the same way, on its own."""
    async with _streams(nats_url, prefix, ["m1", "m2"]) as (nc, js, subjects):
        view, slots = _view("m1", "m2")
        feed = ArrivalFeed(nc, subjects, slots, view, on_arrival=lambda: None)
        await feed.start()
        assert await feed.quiet("m1")
        assert feed.quiet_lines == {("m1", False)}
        # The publishes go out after the unsubscription, on the same connection: none is evented.
        await _published(js, subjects.model("m1"), 3)
        await _published(js, subjects.model("m1", "batch"), 1)
        await _published(js, subjects.model("m2"), 1)
        await wait_until(lambda: slots["m1"].bulk == 1 and slots["m2"].backlog == 1, timeout_s=10, what="the other lines' events")
        assert await feed.listen("m1")
        assert await feed.quiet("m1", bulk=True)
        assert feed.quiet_lines == {("m1", True)}
        await _published(js, subjects.model("m1", "batch"), 2)
        await _published(js, subjects.model("m1"), 1)
        await wait_until(lambda: slots["m1"].interactive == 1, timeout_s=10, what="the arrival after listening")
        assert slots["m1"].bulk == 1  # the two batch requests after its line went quiet: not evented
        assert feed.seen == 3  # the batch line's first, m2's and the last interactive one
        # A stream count after listening sees what the events missed.
        assert await feed.listen("m1", bulk=True)
        assert await count_queues(view, js, subjects, now=time.time(), mine={}, not_ours={})
        assert slots["m1"].interactive == 4 and slots["m1"].bulk == 3
        await feed.stop()


# --- the workers' take events -------------------------------------------------------------------


def test_a_peers_take_leaves_the_backlog_at_once_and_counts_as_its_until_settled() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    for at in (10.0, 11.0, 12.0):
        view.arrived(s, at, None)
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me")
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"+2", now=12.5)
    assert s.backlog == 1 and s.oldest_enqueued_at == 12.0  # the oldest two went to the peer
    # Until it settles them, a count that still stores them does not make them stranded.
    assert view.peers_hold("m1", now=12.6) == 2
    view.reconcile(s, 3, 12.6, mine=0, not_ours=view.peers_hold("m1", 12.6))
    assert s.backlog == 1 and s.stranded == 0
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"-2", now=12.7)
    assert view.peers_hold("m1", now=12.7) == 0
    # An unsettled take counts only for peer_event_s: then the peer's advert tells.
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"+1", now=13.0)
    assert view.peers_hold("m1", now=13.0 + view.peer_event_s + 0.1) == 0


def test_a_departed_peers_takes_are_forgotten_though_its_successor_keeps_its_id_busy() -> None:
    """A killed worker never settles what it took; restarted under the same id, its successor's
    take events kept that hold alive past peer_event_s. Forgotten when it departs (the caller
    sees it leave, or its process replaced), its requests count again as stranded."""
    view, slots = _view("m1")
    s = slots["m1"]
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me")
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "w1"}, b"+4", now=1.0)  # then killed
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "w1"}, b"+1", now=1.0 + view.peer_event_s)  # its successor
    now = 1.5 + view.peer_event_s
    view.reconcile(s, 5, now, mine=0, not_ours=view.peers_hold("m1", now))
    assert s.backlog == 0  # all 5 taken for the live peer's
    view.forget_peers(["w1"])
    view.reconcile(s, 5, now, mine=0, not_ours=view.peers_hold("m1", now))
    assert s.backlog == 5


def test_a_worker_with_no_peer_in_view_ignores_take_events() -> None:
    """Forged at full speed on an open server, ``+100000`` under a made-up id hid a lone worker's
    requests until each check of its consumers (issue 52). A peer sends takes only once it has
    advertised, so a worker that hears no peer counts none, until one is in view."""
    view, slots = _view("m1")
    for at in (10.0, 11.0):
        view.arrived(slots["m1"], at, None)
    heard = False
    counters = Counters()
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me", counters=counters, audience=lambda: heard)
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "evil"}, b"+100000", now=11.5)
    assert slots["m1"].backlog == 2 and view.peers_hold("m1", 11.5) == 0
    assert counters.snapshot()["takes_unheard"] == 1
    heard = True
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"+1", now=11.6)
    assert slots["m1"].backlog == 1 and view.peers_hold("m1", 11.6) == 1


@pytest.mark.parametrize(
    ("subject", "headers", "data"),
    [
        ("p.taken.m1", {"Jetbatch-Worker": "me"}, b"+1"),  # our own event: counted when fetched
        ("p.taken.m1", None, b"+1"),  # no worker: not a worker's event
        ("p.taken.m1", {"Jetbatch-Worker": "x" * 129}, b"+1"),
        ("p.taken.ghost", {"Jetbatch-Worker": "peer"}, b"+1"),
        ("q.taken.m1", {"Jetbatch-Worker": "peer"}, b"+1"),
        ("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"+0"),
        ("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"1"),
        ("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"+1e3"),
        ("p.taken.m1", {"Jetbatch-Worker": "peer"}, b"+" + b"9" * 20),
        ("p.taken.m1", {"Jetbatch-Worker": "peer"}, b""),
    ],
)
def test_malformed_take_events_change_nothing(subject: str, headers: dict[str, str] | None, data: bytes) -> None:
    view, slots = _view("m1")
    view.arrived(slots["m1"], 10.0, None)
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me")
    feed.note_taken(subject, headers, data, now=11.0)
    assert slots["m1"].backlog == 1 and view.peers_hold("m1", 11.0) == 0


@given(st.binary(max_size=40), st.text(max_size=200))
def test_a_forged_take_event_never_raises_nor_counts_below_zero(data: bytes, peer: str) -> None:
    view, slots = _view("m1")
    view.arrived(slots["m1"], 10.0, None)
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me")
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": peer}, data, now=11.0)
    assert slots["m1"].backlog in (0, 1) and view.peers_hold("m1", 11.0) >= 0


def test_take_events_under_ever_new_ids_keep_a_bounded_table() -> None:
    """Found by an attack on a running worker: ``+1`` under a new ``Jetbatch-Worker`` id each
    time, on a model that never waited, left 460 800 entries (137 MB) for good. At most
    ``MAX_PEERS_A_MODEL`` peers a model are kept; a new one past that is not counted, and old
    ones make room once their events are old."""
    from jetbatch.sidecar.worker.queues import MAX_PEERS_A_MODEL

    view, slots = _view("m1")
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me")
    for i in range(MAX_PEERS_A_MODEL + 1000):
        feed.note_taken("p.taken.m1", {"Jetbatch-Worker": f"ghost{i}"}, b"+1", now=11.0)
    assert view.peers_hold("m1", 11.0) == MAX_PEERS_A_MODEL
    later = 11.0 + view.peer_event_s + 2.0
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "real"}, b"+2", now=later)
    assert view.peers_hold("m1", later) == 2


@pytest.mark.anyio
async def test_a_peers_fetch_reaches_the_other_workers_count_through_the_server(nats_url: str, prefix: str) -> None:
    async with _streams(nats_url, prefix, ["m1"]) as (nc, js, subjects):
        mine, my_slots = _view("m1")
        theirs, their_slots = _view("m1")
        me = ArrivalFeed(nc, subjects, my_slots, mine, on_arrival=lambda: None, worker_id="w-me")
        peer = ArrivalFeed(nc, subjects, their_slots, theirs, on_arrival=lambda: None, worker_id="w-peer")
        await me.start()
        await peer.start()
        await _published(js, subjects.model("m1"), 3)
        await wait_until(lambda: my_slots["m1"].backlog == 3 and their_slots["m1"].backlog == 3, timeout_s=10, what="arrivals")
        await peer.took("m1", 2)  # the peer fetched two
        await wait_until(lambda: my_slots["m1"].backlog == 1, timeout_s=10, what="the take event")
        assert their_slots["m1"].backlog == 3  # a worker's own event is not counted twice
        await peer.settled("m1", 2)
        await wait_until(lambda: mine.peers_hold("m1", time.time()) == 0, timeout_s=10, what="the settle event")
        await me.stop()
        await peer.stop()


@pytest.mark.anyio
async def test_a_worker_nobody_hears_sends_no_take_events(nats_url: str, prefix: str) -> None:
    async with _streams(nats_url, prefix, ["m1"]) as (nc, js, subjects):
        heard = False
        view, slots = _view("m1")
        feed = ArrivalFeed(nc, subjects, slots, view, on_arrival=lambda: None, worker_id="w-me", audience=lambda: heard)
        sub = await nc.subscribe(subjects.taken_wildcard)
        await feed.took("m1", 2)
        await feed.settled("m1", 2)
        heard = True
        await feed.took("m1", 3)
        first = await sub.next_msg(timeout=10)  # one connection: the server keeps its order
        assert first.data == b"+3"
        await sub.unsubscribe()


@pytest.mark.anyio
async def test_a_worker_subscribes_to_take_events_only_while_a_peer_is_in_view(nats_url: str, prefix: str) -> None:
    """A forged take flood at full speed, read on the data connection, had nats-server cut it as a
    slow consumer (bench.reliability.forged_events): a worker alone, which ignores takes anyway,
    is not subscribed, so the server drops them before they reach it."""
    async with _streams(nats_url, prefix, ["m1"]) as (nc, _js, subjects):
        heard = False
        view, slots = _view("m1")
        view.arrived(slots["m1"], time.time(), None)
        view.arrived(slots["m1"], time.time(), None)
        feed = ArrivalFeed(nc, subjects, slots, view, on_arrival=lambda: None, worker_id="w-me", audience=lambda: heard)
        await feed.start()
        try:
            assert not feed.listening_to_takes
            events = feed.connection  # where the events are read (not the data connection)
            await nc.publish(subjects.taken("m1"), b"+1", headers={"Jetbatch-Worker": "w-peer"})
            await nc.flush()
            await events.flush()
            received = events.stats["in_msgs"]
            await nc.publish(subjects.taken("m1"), b"+1", headers={"Jetbatch-Worker": "w-peer"})
            await nc.flush()
            await events.flush()  # the PONG after it: had it been delivered, it would be in by now
            assert events.stats["in_msgs"] == received
            heard = True  # a peer's advert read
            await feed.follow_takes()
            assert feed.listening_to_takes
            await nc.publish(subjects.taken("m1"), b"+1", headers={"Jetbatch-Worker": "w-peer"})
            await wait_until(lambda: slots["m1"].backlog == 1, timeout_s=10, what="the peer's take counted")
            heard = False  # the peer left the view
            await feed.follow_takes()
            assert not feed.listening_to_takes
        finally:
            await feed.stop()


def test_a_forged_hour_with_an_offset_reads_as_the_full_parse_does() -> None:
    """``T00-00:01`` is an hour with a UTC offset to ``fromisoformat``: the per-minute shortcut
    read it as minute ``00-00`` plus a second (found by the property above)."""
    for text in ("2000-01-01T00-00:01Z", "2026-12-04T16:07+01Z", "2026-12-04T16-07:39.5Z"):
        assert parse_stream_timestamp(text) == _timestamp_as_before(text)


@pytest.mark.parametrize(
    ("pending", "ack_pending", "missed_before", "in_our_puller", "why"),
    [
        (8, 0, False, False, "fetch again"),
        (8, 0, False, True, "fetch again"),
        # Missed twice with requests still undelivered: a recheck, never "unreachable" (it was, on
        # ack pending 0 alone, and a model's 8 requests waited a minute on a 3-node cluster).
        (8, 0, True, False, "delivered elsewhere"),
        (0, 3, False, False, "delivered elsewhere"),
        (0, 3, False, True, "in our puller"),
        (8, 0, True, True, "in our puller"),
        (0, 0, False, False, "unreachable"),
        (0, 0, True, False, "unreachable"),
    ],
)
def test_why_a_fetch_came_back_empty(pending: int, ack_pending: int, missed_before: bool, in_our_puller: bool, why: str) -> None:
    from jetbatch.sidecar.worker.stream_facts import empty_fetch

    assert empty_fetch(pending=pending, ack_pending=ack_pending, missed_before=missed_before, in_our_puller=in_our_puller) == why


def test_requests_a_consumer_still_has_to_deliver_are_fetched_again_after_a_recheck() -> None:
    """Two empty fetches in a row while the consumer says requests are undelivered: they are held
    back for a recheck, after which the next count shows them again (held back for good, the
    model's queue looked empty to its worker and served to its peers)."""
    from jetbatch.sidecar.worker.queues import RECHECK_S
    from jetbatch.sidecar.worker.stream_facts import empty_fetch

    view, slots = _view("m1")
    s = slots["m1"]
    s.place.tier = "resident"
    view.reconcile(s, 8, now=0.0, mine=0, not_ours=0)
    why = empty_fetch(pending=8, ack_pending=0, missed_before=True, in_our_puller=False)
    view.found_empty(s, now=1.0, ack_wait_s=30.0, unreachable=why == "unreachable")
    assert s.backlog == 0
    view.reconcile(s, 8, now=1.0 + RECHECK_S, mine=0, not_ours=0)
    assert s.backlog == 8


def test_a_fetch_of_redeliveries_keeps_the_rest_of_them_counted() -> None:
    """A dead peer's 8 requests, found by a count: a fetch of 4 of them says 0 undelivered (the
    consumer counts requests due for redelivery as unacked until it delivers them), yet 4 more
    are due. The count keeps them; a fetch of first deliveries takes the consumer's word."""
    view, slots = _view("m1")
    s = slots["m1"]
    view.reconcile(s, 8, now=0.0, mine=0, not_ours=0)
    view.fetched(s, 4, pending=0, redelivered=True)
    assert s.backlog == 4
    view.fetched(s, 4, pending=0, redelivered=False)
    assert s.backlog == 0


@pytest.mark.anyio
async def test_a_worker_connection_without_echo_hears_its_peers_take_events_and_not_its_own(nats_url: str, prefix: str) -> None:
    """The worker's connection is made with ``no_echo`` (``jetbatch worker``): its own take and
    settle events, which it would only drop (``note_taken``), are not sent back to it, while a
    peer's still come. The peer publishes after the worker's own event reached the server (a
    flush), so the peer's arriving first would mean the worker's own was delivered too."""
    from jetbatch.sidecar.config import NatsConfig
    from jetbatch.sidecar.transport import connect

    subjects = Subjects(prefix)
    heard: list[bytes] = []
    worker_nc = await connect(NatsConfig(), nats_url, name="jetbatch-worker", no_echo=True)
    peer_nc = await nats.connect(nats_url)
    try:

        async def on_taken(msg: Any) -> None:
            heard.append(msg.data)

        await worker_nc.subscribe(subjects.taken_wildcard, cb=on_taken)
        await worker_nc.flush()
        await worker_nc.publish(subjects.taken("m1"), b"+3", headers={"Jetbatch-Worker": "me"})
        await worker_nc.flush()
        await peer_nc.publish(subjects.taken("m1"), b"+5", headers={"Jetbatch-Worker": "peer"})
        await peer_nc.flush()
        await wait_until(lambda: bool(heard), timeout_s=10, what="the peer's take event")
        await worker_nc.flush()  # anything else the server sent before is in by now
        assert heard == [b"+5"]
    finally:
        await worker_nc.close()
        await peer_nc.close()


# --- events are hints: checked against the stream ----------------------------------------------


def test_a_refuted_queue_doubts_its_arrival_events_until_the_stream_stores_some() -> None:
    """A look found nothing stored (``Lines.look``): the count is zero, forged arrivals are not
    counted, and a count that finds requests stored makes the events count again."""
    view, slots = _view("m1")
    s = slots["m1"]
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me")
    for _ in range(3):
        feed.note("p.arrived.m1", {"Nats-Sequence": "999999"}, now=5.0)
    assert s.backlog == 3
    view.refuted(s)
    assert s.backlog == 0 and s.known == 0 and "m1" not in view.waiting
    feed.note("p.arrived.m1", {"Nats-Sequence": "1000000"}, now=5.1)
    assert s.backlog == 0
    view.reconcile(s, 0, 5.2, mine=0, not_ours=0)
    feed.note("p.arrived.m1", None, now=5.3)
    assert s.backlog == 0  # still nothing stored: still doubted
    view.reconcile(s, 2, 5.4, mine=0, not_ours=0)
    assert s.backlog == 2 and not s.doubted
    feed.note("p.arrived.m1", None, now=5.5)
    assert s.backlog == 3


def test_takes_cannot_hide_what_a_consumer_delivered_to_nobody() -> None:
    view, slots = _view("m1")
    s = slots["m1"]
    feed = ArrivalFeed(None, Subjects("p"), slots, view, on_arrival=lambda: None, worker_id="me")
    view.arrived(s, 1.0, None)
    feed.note_taken("p.taken.m1", {"Jetbatch-Worker": "evil"}, b"+100000", now=1.1)
    view.counted({"p.model.m1": 1}, None, 1.2, subjects=Subjects("p"), mine={}, not_ours={}, mine_bulk={})
    assert s.backlog == 0 and view.hidden_by_takes == ["m1"]  # stored, yet zero by a take alone
    view.undelivered(s, 1, bulk=False)
    assert s.backlog == 1
    # A peer's advert that says it holds them is believed: nothing for the consumers to check.
    view.counted({"p.model.m1": 1}, None, 1.3, subjects=Subjects("p"), mine={}, not_ours={"m1": 1}, mine_bulk={})
    assert view.hidden_by_takes == []
