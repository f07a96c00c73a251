"""The batch window's timing against a queue whose fetches return late (worker/batching.py).

A stand-in subscription plays the JetStream pull on a fake clock: it returns one queued message
at once, then times out ``overrun`` after the timeout it was given, as fetches on a loaded host
do. What is checked is the batcher's own arithmetic, exactly: it learns the overrun and aims its
last fetch early, so a batch closes near ``max_delay`` instead of an overrun late.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import nats.errors
import pytest
from nats.aio.msg import Msg

from jetbatch.sidecar.policy import BatchWindow
from jetbatch.sidecar.worker.batching import Batcher

pytestmark = pytest.mark.anyio


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _delivered(at_ns: int, pending: int, headers: dict[str, str] | None = None) -> Msg:
    """A JetStream delivery as a pull returns it: stored at ``at_ns``, ``pending`` left after it."""
    return Msg(None, subject="m", reply=f"$JS.ACK.S.C.1.1.1.{at_ns}.{pending}", data=b"", headers=headers)  # type: ignore[arg-type]


class LateQueue:
    def __init__(self, clock: FakeClock, overrun_s: float, headers: dict[str, str] | None = None) -> None:
        self.clock = clock
        self.overrun_s = overrun_s
        self.headers = headers
        self.queued = 0
        self.timeouts: list[float] = []

    async def fetch(self, batch: int, timeout: float) -> list[Any]:
        await anyio.sleep(0)
        if self.queued:
            self.queued -= 1
            at_ns = round(self.clock() * 1e9)
            self.clock.now = at_ns / 1e9  # on the ack subject's nanosecond grid: stored "now" exactly
            return [_delivered(at_ns, 0, self.headers)]
        self.timeouts.append(timeout)
        self.clock.now += timeout + self.overrun_s
        raise nats.errors.TimeoutError


def _slot(queue: Any, max_delay_s: float) -> Any:
    config = SimpleNamespace(max_concurrent_batches=1)
    return SimpleNamespace(psub=queue, window=BatchWindow(64, max_delay_s), in_flight=0, computing=0, config=config, backlog=0, bulk=0, bulk_psub=None, interactive=0, interactive_run=0)


async def test_the_batcher_learns_how_late_fetches_return_and_closes_batches_near_max_delay() -> None:
    clock = FakeClock()
    queue = LateQueue(clock, overrun_s=0.04)
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock)
    slot = _slot(queue, max_delay_s=0.2)
    closes = []
    for _ in range(12):
        queue.queued = 1
        started = clock()
        msgs = await batcher.gather(slot, 64)
        closes.append(clock() - started)
        assert len(msgs) == 1
    assert 0.035 <= batcher.late_s <= 0.04  # learnt (a moving mean from 1 ms): the 40 ms overrun
    # The first batch, aimed on time, closed the whole overrun late; aimed early by what it
    # learnt, the last ones close at the 200 ms window, within what is left to learn.
    assert closes[0] == pytest.approx(0.2 - 0.001 + 0.04)  # aimed 1 ms early (the initial guess), 40 ms late
    assert all(a > b for a, b in zip(closes, closes[1:])), closes  # each closer to the window
    assert 0.2 <= closes[-1] < 0.205, closes
    assert queue.timeouts[-1] == pytest.approx(0.2 - batcher.late_s, abs=0.003)


async def test_a_deadline_closes_the_window_early_enough_to_compute_in_time() -> None:
    from jetbatch.sdk.protocol import Headers

    clock = FakeClock()
    due = clock() + 0.05
    queue = LateQueue(clock, overrun_s=0.0, headers={Headers.DEADLINE: str(int(due * 1000))})
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25, clock=clock)
    slot = _slot(queue, max_delay_s=0.2)
    queue.queued = 1
    msgs = await batcher.gather(slot, 64, compute_s=0.01)
    # Closed by the deadline less the batch's 10 ms (aimed a fetch's lateness early), not at 200 ms.
    assert len(msgs) == 1
    assert due - 0.01 - 0.002 <= clock() <= due - 0.01
    # A malformed deadline is no deadline: the window runs its full length.
    queue.headers = {Headers.DEADLINE: "soon"}
    queue.queued = 1
    started = clock()
    await batcher.gather(slot, 64, compute_s=0.01)
    assert clock() - started >= 0.2 - 0.002


class ShortQueue:
    """Requests queued long ago; each fetch hands over at most ``per_fetch`` of them and reports
    how many are left, as a JetStream pull split by the server (or a loaded host) does."""

    def __init__(self, queued: int, per_fetch: int, enqueued_at: float) -> None:
        self.queued, self.per_fetch, self.enqueued_at = queued, per_fetch, enqueued_at

    async def fetch(self, batch: int, timeout: float) -> list[Any]:
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
    batcher = Batcher(anyio.Event(), poll_interval_s=0.25)
    sizes = [len(await batcher.gather(slot, 16)) for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert queue.queued == 0 and slot.backlog == 0
