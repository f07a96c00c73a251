"""The open window's wait (wakeup.py): woken early, or ended at its deadline on a timerfd."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from jetbatch.sidecar.wakeup import Wakeup

pytestmark = pytest.mark.anyio


async def test_a_wake_ends_the_wait_early() -> None:
    wakeup = Wakeup()
    asyncio.get_running_loop().call_soon(wakeup.wake)
    assert await wakeup.wait(60.0) is True


async def test_the_wait_ends_at_its_deadline_not_before() -> None:
    wakeup = Wakeup()
    started = time.monotonic()
    assert await wakeup.wait(0.003) is False
    assert time.monotonic() - started >= 0.003


async def test_a_wake_with_nobody_waiting_is_not_kept() -> None:
    wakeup = Wakeup()
    wakeup.wake()
    assert await wakeup.wait(0.001) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")
async def test_waits_end_on_a_timerfd_and_leave_no_descriptor_behind() -> None:
    assert Wakeup.precise
    before = len(os.listdir("/proc/self/fd"))
    wakeup = Wakeup()
    for _ in range(50):
        await wakeup.wait(0.0001)
    waiter = asyncio.ensure_future(wakeup.wait(60.0))
    await asyncio.sleep(0)
    waiter.cancel()  # a cancelled wait cleans up too
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(os.listdir("/proc/self/fd")) == before


async def test_a_timeout_that_is_no_positive_number_ends_the_wait_at_once() -> None:
    wakeup = Wakeup()
    for timeout_s in (float("nan"), -1.0, 0.0):
        assert await wakeup.wait(timeout_s) is False
    asyncio.get_running_loop().call_soon(wakeup.wake)
    assert await wakeup.wait(float("inf")) is True  # cut to a day, not an overflow
