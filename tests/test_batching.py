"""The batch window's timing on a fake clock (worker/batching.py).

A stand-in subscription plays the JetStream pull: it hands over what is queued, and a fetch of
an empty queue that may wait runs its whole timeout. A stand-in :class:`Wakeup` plays the open
window's wait: it advances the clock to the wait's end, or to an arrival the test scripts. What
is checked is the batcher's own arithmetic, exactly: a batch closes at ``max_delay`` after its
first request was stored, with no pull request held open for later arrivals; an arrival event
during the window brings its request in with one fetch of what is stored.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable

import anyio
import nats.errors
import pytest
from nats.aio.msg import Msg

from jetbatch.sidecar.policy import BatchWindow
from jetbatch.sidecar.worker.batching import Batcher
from jetbatch.sidecar.worker.queues import QueueView
from jetbatch.sidecar.worker.slots import Slot

pytestmark = pytest.mark.anyio


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _delivered(at_ns: int, pending: int, headers: dict[str, str] | None = None) -> Msg:
    """A JetStream delivery as a pull returns it: stored at ``at_ns``, ``pending`` left after it."""
    return Msg(None, subject="m", reply=f"$JS.ACK.S.C.1.1.1.{at_ns}.{pending}", data=b"", headers=headers)  # type: ignore[arg-type]


class Queue:
    """Requests stored "now" on the fake clock; each fetch records how it was asked."""

    buffered = 0  # delivered after their fetch gave up (``Puller.buffered``): none unless a test says

    def __init__(self, clock: FakeClock, headers: dict[str, str] | None = None) -> None:
        self.clock = clock
        self.headers = headers
        self.queued = 0
        self.fetches: list[tuple[int, float, bool]] = []  # (batch, timeout, stored_only)
        # A request stored this long into the next fetch that waits: a request asking for
        # ``linger`` gets it then; one asking for a whole batch runs its whole timeout first.
        self.arrives_in: float | None = None
        self.holds: list[float] = []  # how long each hold's one request stays open (``Puller.fetch``)

    async def fetch(
        self, batch: int, timeout: float, stored_only: bool = False, linger: int | None = None, hold_open_s: float | None = None
    ) -> list[Any]:
        await anyio.sleep(0)
        self.fetches.append((batch, timeout, stored_only))
        if hold_open_s is not None:
            self.holds.append(hold_open_s)
        if not self.queued and not stored_only and self.arrives_in is not None and self.arrives_in < timeout:
            self.clock.now += self.arrives_in
            stored_ns = round(self.clock() * 1e9)
            self.arrives_in = None
            if not linger and hold_open_s is None:
                self.clock.now += timeout  # the rest of its wait (the real one ends at its expiry)
            return [_delivered(stored_ns, 0, self.headers)]
        if self.queued:
            n = min(batch, self.queued)
            self.queued -= n
            at_ns = round(self.clock() * 1e9)
            self.clock.now = at_ns / 1e9  # on the ack subject's nanosecond grid: stored "now" exactly
            return [_delivered(at_ns, self.queued + n - 1 - k, self.headers) for k in range(n)]
        if not stored_only:
            self.clock.now += timeout  # a waiting request runs out
        raise nats.errors.TimeoutError


class HeldQueue(Queue):
    """:class:`Queue` with the held pull of a line that is not listened to (``Puller.fill``):
    ``stored_in`` maps seconds into the fill to how many requests are stored then; the fill
    returns at a full batch or at its wait's end, as the real one does on its own clock.
    ``ends_early``: the server ends the request at once (its consumer went away)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.fills: list[tuple[int, float]] = []
        self.fills_open: list[float | None] = []  # how long each fill's request stays open
        self.stored_in: dict[float, int] = {}
        self.ends_early = False

    async def fill(self, batch: int, wait_s: float, open_s: float | None = None) -> list[Any]:
        await anyio.sleep(0)
        self.fills.append((batch, wait_s))
        self.fills_open.append(open_s)
        if self.ends_early:
            return []
        got: list[Any] = []
        start = self.clock()
        for after, n in sorted(self.stored_in.items()):
            if after >= wait_s or len(got) >= batch:
                break
            self.clock.now = start + after
            got += [_delivered(round(self.clock() * 1e9), 0) for _ in range(min(n, batch - len(got)))]
        self.stored_in = {}
        if len(got) < batch:
            self.clock.now = start + wait_s
        return got


class FakeWakeup:
    """The open window's wait on the fake clock: ``on_wait`` may script an arrival (return the
    seconds into the wait it comes, or None for none)."""

    def __init__(self, clock: FakeClock, on_wait: Callable[[int], float | None] = lambda i: None) -> None:
        self.clock = clock
        self.on_wait = on_wait
        self.waits: list[float] = []
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1

    async def wait(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        after = self.on_wait(len(self.waits))
        if after is not None and after < timeout_s:
            self.clock.now += after
            return True
        self.clock.now += timeout_s
        return False


def _counted(slot: Any, n: int = 1) -> None:
    """``n`` arrival events counted for ``slot``'s model, as the worker's feed counts them."""
    slot.backlog += n
    slot.arrivals += n


_SLOTS: dict[str, Any] = {}


def _slot(queue: Any, max_delay_s: float) -> Any:
    config = SimpleNamespace(max_concurrent_batches=1)
    slot = SimpleNamespace(
        name=f"fake{len(_SLOTS)}", psub=queue, window=BatchWindow(64, max_delay_s), computing=0, config=config,
        backlog=0, arrivals=0, bulk=0, bulk_psub=None, interactive=0, interactive_run=0,
    )  # fmt: skip
    _SLOTS[slot.name] = slot
    return slot


def _computing(model: str) -> int:
    """The forward passes under way of a fake slot here (the worker's core counts them live)."""
    slot = _SLOTS.get(model)
    return slot.computing if slot is not None else 0


def _frees_device_at(slot: Any, wait: int) -> Callable[[int], float | None]:
    """A :class:`FakeWakeup` script: the device ``slot``'s batch computes on is free from its
    ``wait``-th wait on (no arrival comes)."""

    def on_wait(i: int) -> float | None:
        if i == wait:
            slot.computing = 0
        return None

    return on_wait


def _count_fetch(slot: Any, n: int, pending: int | None, bulk: bool, seq: int | None, again: bool) -> None:
    """What the worker's queue view does with a fetch, for the fake slots here: the count follows."""
    slot.backlog = max(0, slot.backlog - n) if pending is None else pending


def _viewed_slot(max_delay_s: float) -> tuple[Slot, QueueView]:
    """A real slot counted by a real queue view (the worker's wiring, no server)."""
    slot = Slot(name="m", config=SimpleNamespace(max_concurrent_batches=1), handler=None, window=BatchWindow(64, max_delay_s))  # type: ignore[arg-type]
    return slot, QueueView({"m": slot})


def _viewed_batcher(clock: FakeClock, view: QueueView) -> Batcher:
    """A batcher whose fetches update ``view``, as the worker wires them."""
    return Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=FakeWakeup(clock),  # type: ignore[arg-type]
                   on_fetched=lambda s, n, pending, bulk, seq, again: view.fetched(s, n, pending, bulk=bulk, last_seq=seq, redelivered=again))  # fmt: skip


async def test_a_lone_request_closes_its_batch_at_max_delay_with_no_pull_held_open() -> None:
    clock = FakeClock()
    queue = Queue(clock)
    wakeup = FakeWakeup(clock)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    slot = _slot(queue, max_delay_s=0.002)
    queue.queued = 1
    stored_at = clock()
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 1
    assert clock() == stored_at + 0.002  # exactly the window: no fetch ran past it
    assert len(queue.fetches) == 1  # the first fetch only: the window waited on arrival events
    assert wakeup.waits == [pytest.approx(0.002)]


async def test_a_window_closed_on_its_timer_learns_how_late_its_batch_started_and_later_ones_aim_that_much_earlier() -> None:
    """Each lone batch started 0.2 ms after its window's timer (the wake-up, the gather's end, the
    batch handed on): the next windows aim that much before their close, so their batches start
    when due instead of 0.2 ms past it."""
    clock = FakeClock()
    queue = Queue(clock)
    wakeup = FakeWakeup(clock)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    slot = _slot(queue, max_delay_s=0.002)
    started_after_due = []
    for _ in range(3):
        queue.queued = 1
        stored_at = clock()
        assert len(await batcher.gather(slot, 64)) == 1
        clock.now += 0.0002  # the wake-up and hand-on after the timer
        batcher.started()
        started_after_due.append(clock() - (stored_at + 0.002))
        clock.now += 0.01
    assert wakeup.waits == [pytest.approx(0.002), pytest.approx(0.0018), pytest.approx(0.0018)]
    assert started_after_due == [pytest.approx(0.0002), pytest.approx(0.0, abs=1e-9), pytest.approx(0.0, abs=1e-9)]


async def test_a_batch_that_did_not_close_on_its_timer_teaches_the_lead_nothing() -> None:
    """A full batch, or one that kept filling while the device was busy and closed when it was
    free, closed on no timer of its own: how late it started says nothing of the timer's
    wake-up, and the next lone window still closes when due."""
    clock = FakeClock()
    queue = Queue(clock)
    slot = _slot(queue, max_delay_s=0.002)
    wakeup = FakeWakeup(clock, _frees_device_at(slot, 2))
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    queue.queued = 64
    assert len(await batcher.gather(slot, 64)) == 64
    clock.now += 0.005
    batcher.started()
    queue.queued = 1
    slot.computing = 1  # the device busy: the window rechecks instead of closing
    assert len(await batcher.gather(slot, 64)) == 1
    assert len(wakeup.waits) == 2  # two rechecks while busy, then closed with the device free
    clock.now += 0.005
    batcher.started()
    queue.queued = 1
    stored_at = clock()
    assert len(await batcher.gather(slot, 64)) == 1
    assert clock() == stored_at + 0.002
    assert wakeup.waits[-1] == pytest.approx(0.002)


async def test_an_arrival_during_the_window_joins_the_batch_with_one_fetch_of_what_is_stored() -> None:
    clock = FakeClock()
    queue = Queue(clock)
    batcher: Batcher
    slot = _slot(queue, max_delay_s=0.01)

    def arrival(i: int) -> float | None:
        if i > 1:
            return None
        queue.queued += 2  # two stored 4 ms into the window; their events counted
        _counted(slot, 2)
        return 0.004

    wakeup = FakeWakeup(clock, arrival)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    queue.queued = 1
    opened = clock()
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 3
    assert queue.fetches[1] == (2, pytest.approx(0.02), True)  # what the count said, stored only
    assert len(queue.fetches) == 2
    assert wakeup.waits == [pytest.approx(0.01), pytest.approx(0.006)]  # then the rest of the window
    assert clock() == pytest.approx(opened + 0.01, abs=1e-9)
    assert slot.backlog == 0


async def test_a_count_ahead_of_the_queue_costs_one_fetch_until_the_next_arrival() -> None:
    """The count says a request is stored that is not (a peer took it, or its event came after
    the fetch that took it): one fetch finds nothing, and the window waits for the next arrival
    instead of fetching again and again."""
    clock = FakeClock()
    queue = Queue(clock)
    slot = _slot(queue, max_delay_s=0.01)

    def arrival(i: int) -> float | None:
        if i == 1:
            _counted(slot)  # counted, yet nothing more is stored
            return 0.001
        if i == 2:
            _counted(slot)  # a real one this time
            queue.queued += 1
            return 0.002
        return None

    wakeup = FakeWakeup(clock, arrival)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    slot.backlog = 0
    queue.queued = 1
    opened = clock()
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 2
    assert [f[2] for f in queue.fetches] == [False, True, True]  # the first, the phantom, the real one
    assert len(wakeup.waits) == 3
    assert clock() == pytest.approx(opened + 0.01, abs=1e-9)


async def test_an_arrival_counted_while_a_fetch_came_back_empty_is_fetched_in_the_window() -> None:
    """The fetch for a count a peer emptied is answered "nothing"; meanwhile another request is
    stored (after that answer) and counted. The window must fetch it, not take the count as
    already looked for."""
    clock = FakeClock()
    slot: Any = None

    class Racy(Queue):
        async def fetch(self, batch: int, timeout: float, stored_only: bool = False, linger: int | None = None) -> list[Any]:
            if stored_only and len(self.fetches) == 1:
                self.fetches.append((batch, timeout, stored_only))
                _counted(slot)  # stored and counted while the empty answer was on its way
                self.queued += 1
                raise nats.errors.TimeoutError
            return await super().fetch(batch, timeout, stored_only)

    queue = Racy(clock)
    slot = _slot(queue, max_delay_s=0.01)

    def phantom(i: int) -> float | None:
        if i == 1:
            _counted(slot)  # counted, and a peer takes it
            return 0.001
        return None

    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=FakeWakeup(clock, phantom), on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    queue.queued = 1
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 2 and queue.queued == 0


async def test_only_an_arrival_for_the_model_in_its_window_wakes_the_window() -> None:
    clock = FakeClock()
    queue = Queue(clock)
    slot, other = _slot(queue, max_delay_s=0.01), _slot(Queue(clock), max_delay_s=0.01)
    batcher: Batcher

    def arrivals(i: int) -> float | None:
        if i == 1:
            other.arrivals += 1  # another model's arrival
            batcher.arrived()
            assert wakeup.woken == 0
            slot.arrivals += 1  # this model's (its request already taken by a peer: no backlog)
            batcher.arrived()
            assert wakeup.woken == 1
            return 0.001
        return None

    wakeup = FakeWakeup(clock, arrivals)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    queue.queued = 1
    await batcher.gather(slot, 64)
    batcher.arrived()  # no window open: nobody to wake
    assert wakeup.woken == 1 and len(wakeup.waits) == 2


async def test_a_busy_device_keeps_the_batch_filling_past_its_window() -> None:
    clock = FakeClock()
    queue = Queue(clock)
    slot = _slot(queue, max_delay_s=0.002)
    slot.computing = 1  # the batch before still computes
    wakeup = FakeWakeup(clock, _frees_device_at(slot, 3))
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    queue.queued = 1
    opened = clock()
    await batcher.gather(slot, 64)
    # Rechecked every 5 ms once past the window (the first wait: the window itself), closed at
    # the first check that found the device free.
    assert wakeup.waits == [pytest.approx(0.005)] * 3
    assert clock() == pytest.approx(opened + 0.015, abs=1e-9)


async def test_a_deadline_closes_the_window_early_enough_to_compute_in_time() -> None:
    from jetbatch.sdk.protocol import Headers

    clock = FakeClock()
    due = clock() + 0.05
    queue = Queue(clock, headers={Headers.DEADLINE: str(int(due * 1000))})
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=FakeWakeup(clock), on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    slot = _slot(queue, max_delay_s=0.2)
    queue.queued = 1
    msgs = await batcher.gather(slot, 64, compute_s=0.01)
    # Closed by the deadline less the batch's 10 ms, not at 200 ms.
    assert len(msgs) == 1
    assert clock() == pytest.approx(due - 0.01, abs=1e-6)
    # A malformed deadline is no deadline: the window runs its full length.
    queue.headers = {Headers.DEADLINE: "soon"}
    queue.queued = 1
    started = clock()
    await batcher.gather(slot, 64, compute_s=0.01)
    assert clock() == pytest.approx(started + 0.2, abs=1e-6)


class ShortQueue:
    """Requests queued long ago; each fetch hands over at most ``per_fetch`` of them and reports
    how many are left, as a JetStream pull split by the server (or a loaded host) does."""

    buffered = 0

    def __init__(self, queued: int, per_fetch: int, enqueued_at: float) -> None:
        self.queued, self.per_fetch, self.enqueued_at = queued, per_fetch, enqueued_at

    async def fetch(self, batch: int, timeout: float, stored_only: bool = False, linger: int | None = None) -> list[Any]:
        if not self.queued:
            raise nats.errors.TimeoutError  # an empty queue: the fetch times out
        n = min(batch, self.per_fetch, self.queued)
        self.queued -= n
        return [_delivered(round(self.enqueued_at * 1e9), self.queued + n - 1 - k) for k in range(n)]


async def test_a_closed_window_still_fills_the_batch_from_the_queued_backlog() -> None:
    """Requests waiting since long before the window: the window has closed when the first fetch
    returns, yet the batch takes what the queue reported waiting, up to the batch size (a live
    test saw a 15 + 1 split under load where the simulator makes one batch of 16)."""
    queue = ShortQueue(queued=40, per_fetch=5, enqueued_at=time.time() - 10)
    slot = _slot(queue, max_delay_s=0.005)  # type: ignore[arg-type]
    slot.window = BatchWindow(16, 0.005)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, on_fetched=_count_fetch, computing=_computing)
    sizes = [len(await batcher.gather(slot, 16)) for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert queue.queued == 0 and slot.backlog == 0


async def test_a_closed_window_stops_topping_up_once_a_peer_takes_what_the_count_promised() -> None:
    """Past its window, a batch tops up from what the count says is stored; when a peer of the
    shared queue wins that race, the batch closes, however many more arrivals are counted."""
    slot: Any = None

    class PeerWins:
        fetches = 0
        buffered = 0

        async def fetch(self, batch: int, timeout: float, stored_only: bool = False, linger: int | None = None) -> list[Any]:
            self.fetches += 1
            assert self.fetches < 10, "still topping up long past the window"
            if self.fetches == 1:  # one request, stored long ago; the server says 3 more wait
                return [_delivered(round((time.time() - 10) * 1e9), 3)]
            _counted(slot)  # another counted meanwhile, and a peer takes it too
            raise nats.errors.TimeoutError

    queue = PeerWins()
    slot = _slot(queue, max_delay_s=0.005)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, on_fetched=_count_fetch, computing=_computing)
    msgs = await batcher.gather(slot, 16)
    assert len(msgs) == 1
    assert queue.fetches == 2


async def test_a_request_stored_during_the_first_fetch_joins_the_batch_though_its_count_came_first() -> None:
    """Request B is stored just after the server delivered A, and B's arrival event is counted
    before the fetch's answer is read. The consumer's count on A (0 left) is as of A's delivery:
    the queue view keeps B counted, so the open window takes B with one fetch of what is stored
    instead of waiting out the window with B left for the next count of the queue."""
    clock = FakeClock()
    slot, view = _viewed_slot(0.05)

    class Racing:
        buffered = 0

        def __init__(self) -> None:
            self.fetches: list[bool] = []

        async def fetch(self, batch: int, timeout: float, stored_only: bool = False, linger: int | None = None) -> list[Any]:
            await anyio.sleep(0)
            self.fetches.append(stored_only)
            at_ns = round(clock() * 1e9)
            if len(self.fetches) == 1:
                view.arrived(slot, clock(), None, seq=2)  # B, counted while A's delivery is on its way
                return [Msg(None, subject="m", reply=f"$JS.ACK.S.C.1.1.1.{at_ns}.0", data=b"")]  # type: ignore[arg-type]
            if len(self.fetches) == 2:
                return [Msg(None, subject="m", reply=f"$JS.ACK.S.C.1.2.2.{at_ns}.0", data=b"")]  # type: ignore[arg-type]
            raise nats.errors.TimeoutError

    slot.lines.psub = Racing()
    batcher = _viewed_batcher(clock, view)
    view.arrived(slot, clock(), None, seq=1)  # A
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 2  # A and B, in one batch
    assert slot.psub.fetches == [False, True]  # B came with one fetch of what is stored
    assert slot.backlog == 0


async def test_the_first_fetch_returns_at_the_first_arrival_and_the_window_runs_from_it() -> None:
    """The count says a request waits but none is stored (a peer took it, or a forged event):
    the first fetch waits, and a request stored meanwhile opens the window at once. A fetch
    waiting for a whole batch held it until that wait's end (20 ms, past its 2 ms window)."""
    clock = FakeClock()
    queue = Queue(clock)
    wakeup = FakeWakeup(clock)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    slot = _slot(queue, max_delay_s=0.002)
    _counted(slot)  # ahead of the queue: nothing is stored
    queue.arrives_in = 0.005
    started = clock()
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 1
    assert clock() == pytest.approx(started + 0.005 + 0.002, abs=1e-9)  # its window, from its arrival


async def test_a_batch_from_one_line_is_topped_up_from_the_other_with_what_is_stored_only() -> None:
    """A batch-class request alone (the count says nothing interactive waits): the interactive
    line is asked for what is stored, in one round trip. A pull that waited there for the rest
    of the batch held this request, and any interactive one arriving meanwhile, 20 ms."""
    clock = FakeClock()
    interactive, batch_line = Queue(clock), Queue(clock)
    wakeup = FakeWakeup(clock)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    slot = _slot(interactive, max_delay_s=0.002)
    slot.bulk_psub = batch_line
    slot.bulk = 1
    _counted(slot)
    batch_line.queued = 1
    stored_at = clock()
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 1
    assert [stored_only for _, _, stored_only in interactive.fetches] == [True]
    assert clock() == pytest.approx(stored_at + 0.002, abs=1e-9)  # its window, and no more


async def test_a_batch_line_arrival_during_an_empty_top_up_keeps_the_line_counted() -> None:
    """The batch line's top-up finds nothing; an arrival counted meanwhile may be one stored on
    that line after the pull was answered, so its count is not reset to nothing."""
    clock = FakeClock()
    slot, view = _viewed_slot(0.002)
    interactive = Queue(clock)

    class BatchLine:
        buffered = 0

        async def fetch(self, batch: int, timeout: float, stored_only: bool = False, linger: int | None = None) -> list[Any]:
            await anyio.sleep(0)
            view.arrived(slot, clock(), None, bulk=True, seq=9)  # stored just after this pull was answered
            raise nats.errors.TimeoutError

    slot.lines.psub, slot.lines.bulk_psub = interactive, BatchLine()
    batcher = _viewed_batcher(clock, view)
    view.arrived(slot, clock(), None, bulk=True, seq=7)  # counted, but a peer took it
    view.arrived(slot, clock(), None, seq=8)
    interactive.queued = 1
    msgs = await batcher.fetch(slot, 64, 0.02, bulk_first=False)
    assert len(msgs) == 1
    assert slot.bulk >= 1  # the one stored meanwhile is still counted


def _held(max_delay_s: float, *, filled: bool = True) -> tuple[FakeClock, HeldQueue, FakeWakeup, Batcher, Any]:
    """A batcher whose slot's line is (``filled``) or is not listened to, with a held-pull queue."""
    clock = FakeClock()
    queue = HeldQueue(clock)
    wakeup = FakeWakeup(clock)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, filled=lambda slot: filled, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    return clock, queue, wakeup, batcher, _slot(queue, max_delay_s)


async def test_a_line_not_listened_to_fills_its_open_window_from_one_held_pull_closed_on_the_batchers_clock() -> None:
    """The worker does not listen to the arrivals of the line whose batches it serves
    (policy/interest.py): once the first fetch took what was stored, the rest of the window is
    one pull held to its close, which the server answers with each request as it is stored. No
    arrival event is waited for, and the window closes at exactly ``max_delay``. Its request is
    asked to stay open a window (and a millisecond) past the close: the next window's, as the
    worker serves this line's batches back to back (``Puller.fill(open_s=...)``)."""
    clock, queue, wakeup, batcher, slot = _held(0.01)
    queue.queued = 1
    queue.stored_in = {0.003: 2, 0.007: 1}
    opened = clock()
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 4
    assert queue.fills == [(63, pytest.approx(0.01))]  # the rest of the batch, to the close
    assert queue.fills_open == [pytest.approx(0.01 + 0.01 + 0.001)]
    assert wakeup.waits == []  # no arrival event waited for
    assert clock() == pytest.approx(opened + 0.01, abs=1e-9)


async def test_a_held_pull_filling_the_batch_closes_the_window_at_once() -> None:
    clock, queue, _, batcher, slot = _held(0.01)
    queue.queued = 1
    queue.stored_in = {0.002: 7}
    opened = clock()
    msgs = await batcher.gather(slot, 8)
    assert len(msgs) == 8
    assert clock() == pytest.approx(opened + 0.002, abs=1e-9)  # full: no wait for the close


async def test_a_held_pull_the_server_ends_early_leaves_the_window_to_its_clock_not_a_spin() -> None:
    clock, queue, wakeup, batcher, slot = _held(0.01)
    queue.ends_early = True
    queue.queued = 1
    opened = clock()
    msgs = await batcher.gather(slot, 64)
    assert len(msgs) == 1
    assert len(queue.fills) == 1  # one request, not one per loop turn
    assert wakeup.waits == [pytest.approx(0.01)]
    assert clock() == pytest.approx(opened + 0.01, abs=1e-9)


async def test_a_listened_line_still_waits_on_its_arrival_events() -> None:
    _, queue, wakeup, batcher, slot = _held(0.01, filled=False)
    queue.queued = 1
    await batcher.gather(slot, 64)
    assert queue.fills == [] and wakeup.waits == [pytest.approx(0.01)]


async def test_a_hold_waits_its_own_time_for_the_first_request_and_its_window_runs_from_it() -> None:
    """A worker about to idle holds the served model's next batch open (policy/interest.py,
    ``hold_s``): the first fetch waits that long for a first arrival, on one pull request for a
    whole batch open through the window that arrival opens (``Puller.fetch(hold_open_s=...)``);
    none: the batch is empty at the hold's end."""
    clock, queue, _, batcher, slot = _held(0.002)
    started = clock()
    assert await batcher.gather(slot, 64, hold_s=0.005) == []
    assert queue.fetches == [(64, 0.005, False)] and queue.holds == [pytest.approx(0.005 + 0.002 + 0.001)]
    assert clock() == pytest.approx(started + 0.005, abs=1e-9)
    queue.arrives_in = 0.003
    started = clock()
    msgs = await batcher.gather(slot, 64, hold_s=0.005)
    assert len(msgs) == 1 and len(queue.holds) == 2
    assert clock() == pytest.approx(started + 0.003 + 0.002, abs=1e-9)  # its window, from its arrival
    queue.queued = 3
    assert len(await batcher.gather(slot, 64)) == 3  # not a hold: the plain fetch
    assert len(queue.holds) == 2


async def test_a_request_delivered_after_its_fetch_gave_up_joins_the_open_window() -> None:
    """A loaded host: the fetch for the request an arrival event counted gives up (20 ms) before
    the server's answer is read, and the answer lands in the puller's buffer while the window
    waits for arrival events. None will come for it (its own came already): its delivery wakes
    the window (``Batcher.late``, which the worker's pullers call) and the batch takes it at once,
    not at the window's close a minute later. Found by forcing the timing: a full suite's run
    once saw a test's third request wait out its window so."""
    clock = FakeClock()

    class Late(Queue):
        def __init__(self, clock: FakeClock) -> None:
            super().__init__(clock)
            self.late: list[Any] = []  # delivered after the fetch that asked for them gave up

        @property
        def buffered(self) -> int:  # type: ignore[override]
            return len(self.late)

        async def fetch(self, batch: int, timeout: float, stored_only: bool = False, linger: int | None = None) -> list[Any]:
            if self.late:  # a fetch hands out what was delivered late first (Puller.fetch)
                got, self.late = self.late[:batch], self.late[batch:]
                return got
            if stored_only and self.queued:
                self.fetches.append((batch, timeout, stored_only))
                self.clock.now += timeout
                raise nats.errors.TimeoutError  # stored, but its answer is still on its way
            return await super().fetch(batch, timeout, stored_only, linger)

    queue = Late(clock)
    slot = _slot(queue, max_delay_s=60.0)

    def script(i: int) -> float | None:
        if i == 1:  # the third request is stored, and its arrival event counted
            queue.queued += 1
            _counted(slot)
            return 0.001
        if i == 2 and queue.queued:  # the given-up fetch's answer arrives while the window waits
            queue.queued -= 1
            queue.late.append(_delivered(round(clock() * 1e9), 0))
            woken = wakeup.woken
            batcher.late(slot)
            return 0.001 if wakeup.woken > woken else None
        return None

    wakeup = FakeWakeup(clock, script)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    start = clock()
    first = [_delivered(round(start * 1e9), 0), _delivered(round(start * 1e9), 0)]
    msgs = await batcher.gather(slot, 3, first)
    assert len(msgs) == 3 and clock() - start < 1.0
    assert queue.late == []


async def test_a_late_delivery_to_another_models_puller_leaves_the_window_waiting() -> None:
    """``Batcher.late`` wakes only a window of the model whose puller it was."""
    clock = FakeClock()
    slot, other = _slot(Queue(clock), max_delay_s=0.05), _slot(Queue(clock), max_delay_s=0.05)

    def script(i: int) -> float | None:
        woken = wakeup.woken
        batcher.late(other)
        return 0.001 if wakeup.woken > woken else None

    wakeup = FakeWakeup(clock, script)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock, wakeup=wakeup, on_fetched=_count_fetch, computing=_computing)  # type: ignore[arg-type]
    start = clock()
    msgs = await batcher.gather(slot, 3, [_delivered(round(start * 1e9), 0)])
    assert len(msgs) == 1 and clock() - start == pytest.approx(0.05, abs=1e-6)  # its whole window
    assert len(wakeup.waits) == 1  # in one wait, not woken
