"""Awaiting a future for at most a while, on timers shared by every wait.

A request waits twice (for its PubAck, then for its answer). A timer of its own for each wait
(``loop.call_at``) makes a ``TimerHandle`` in Python and pushes it on the loop's heap, where its
``cancel`` leaves it until the heap is next rebuilt: in the producer's samples that wait was 6-8%
of its busy time (docs/benchmarks.md, "Shared timers"). Here a wait joins the set of futures due
in the same :data:`TICK_S`: one timer a tick however many waits share it. A wait that ends
leaves its set, and the last to leave cancels the tick's timer, so what is kept is bounded by
the waits in progress, not by the longest timeout.
"""
from __future__ import annotations

import asyncio
import math
from typing import Any, TypeVar

__all__ = ["TICK_S", "Timeouts"]

T = TypeVar("T")

# How late a timeout may end (never early): a request's timeouts are seconds long.
TICK_S = 0.005


class _Tick:
    __slots__ = ("timer", "waits")

    def __init__(self, timer: asyncio.TimerHandle) -> None:
        self.timer = timer
        self.waits: set[asyncio.Future[Any]] = set()


class Timeouts:
    """The waits of one event loop (the one running at the first :meth:`within`), grouped by
    the tick they are due in."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due: dict[int, _Tick] = {}

    @property
    def waiting(self) -> int:
        """Waits in progress."""
        return sum(len(t.waits) for t in self._due.values())

    @property
    def timers(self) -> int:
        """Timers scheduled (one a tick that has waits)."""
        return len(self._due)

    async def within(self, fut: asyncio.Future[T], timeout_s: float) -> T:
        """Await ``fut`` for at most ``timeout_s`` (ending up to :data:`TICK_S` later): its
        result, or ``TimeoutError`` once the time is up (``fut`` is then cancelled). A cancelled
        caller stays cancelled."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + max(timeout_s, 0.0)) / TICK_S)
        due = self._due.get(tick)
        if due is None:
            due = self._due[tick] = _Tick(loop.call_at(tick * TICK_S, self._expire, tick))
        due.waits.add(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fut.cancelled() and not (task is not None and task.cancelling() > 0):
                raise TimeoutError from None
            raise
        finally:
            due.waits.discard(fut)
            if not due.waits and self._due.get(tick) is due:
                del self._due[tick]
                due.timer.cancel()

    def _expire(self, tick: int) -> None:
        due = self._due.pop(tick, None)
        if due is None:
            return
        # Cancelling a future wakes its waiter, which turns that into a TimeoutError.
        for fut in due.waits:
            if not fut.done():
                fut.cancel()
