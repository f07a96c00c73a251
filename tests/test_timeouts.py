"""Waits with a timeout on shared timers (sdk/timeouts.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jetbatch.sdk.timeouts import TICK_S, Timeouts

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the SDK is asyncio's


async def test_a_wait_ends_with_its_future_and_is_forgotten() -> None:
    timeouts = Timeouts()
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, "answer")
    assert await timeouts.within(fut, 60.0) == "answer"
    assert timeouts.waiting == 0
    assert timeouts.timers == 0  # the last wait of its tick cancelled the timer: nothing kept


async def test_a_wait_past_its_time_times_out_never_early_and_cancels_the_future() -> None:
    loop = asyncio.get_running_loop()
    timeouts = Timeouts()
    fut = loop.create_future()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await timeouts.within(fut, 0.02)
    assert loop.time() >= started + 0.02
    assert fut.cancelled()
    assert timeouts.waiting == 0


async def test_a_cancelled_caller_stays_cancelled() -> None:
    timeouts = Timeouts()
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(timeouts.within(fut, 60.0))
    await asyncio.sleep(0)  # the wait has begun
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert timeouts.waiting == 0


async def test_a_wait_already_due_times_out_at_once() -> None:
    timeouts = Timeouts()
    with pytest.raises(TimeoutError):
        await timeouts.within(asyncio.get_running_loop().create_future(), -1.0)


async def test_waits_due_in_the_same_tick_share_one_timer_and_each_times_out(monkeypatch: Any) -> None:
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    call_at = loop.call_at

    def counting(when: float, *args: Any) -> Any:
        timers.append(when)
        return call_at(when, *args)

    monkeypatch.setattr(loop, "call_at", counting)
    timeouts = Timeouts()
    # A hundred waits, each due a microsecond apart just before one tick ends, registered at
    # the same instant of the loop's clock (held while they begin).
    now = loop.time()
    monkeypatch.setattr(loop, "time", lambda: now)
    tick_end = (int((now + 0.01) / TICK_S) + 2) * TICK_S
    futures = [loop.create_future() for _ in range(100)]
    waits = [asyncio.ensure_future(timeouts.within(f, tick_end - now - (i + 1) * 1e-6)) for i, f in enumerate(futures)]
    await asyncio.sleep(0)
    assert timeouts.waiting == 100
    monkeypatch.undo()
    assert len(timers) == 1  # a timer each would be 100
    results = await asyncio.gather(*waits, return_exceptions=True)
    assert all(isinstance(r, TimeoutError) for r in results)
    assert timeouts.waiting == 0


async def test_a_finished_wait_leaves_the_others_of_its_tick_waiting() -> None:
    loop = asyncio.get_running_loop()
    timeouts = Timeouts()
    early, late = loop.create_future(), loop.create_future()
    first = asyncio.ensure_future(timeouts.within(early, 60.0))
    second = asyncio.ensure_future(timeouts.within(late, 60.0))
    await asyncio.sleep(0)
    early.set_result(1)
    assert await first == 1
    assert (timeouts.waiting, timeouts.timers) == (1, 1)
    late.set_result(2)
    assert await second == 2
    assert (timeouts.waiting, timeouts.timers) == (0, 0)
