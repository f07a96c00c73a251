"""Awaiting a future for at most a while, on timers shared by every wait.

A request waits twice (for its PubAck, then for its answer). A timer of its own for each wait
(``loop.call_at``) makes a ``TimerHandle`` in Python and pushes it on the loop's heap, where its
``cancel`` leaves it until the heap is next rebuilt: about 2.5 µs a wait, a tenth of the SDK's
own time a request in the producer's samples (docs/benchmarks.md, "Shared timers"). Here a wait
joins the set of futures due in the same :data:`TICK_S`: one timer a tick however many waits
share it, and a wait that ends only leaves its set.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, TypeVar

__all__ = ["TICK_S", "Timeouts"]

T = TypeVar("T")

# How late a timeout may end (never early): a request's timeouts are seconds long.
TICK_S = 0.005


class Timeouts:
    """The waits of one event loop (the one running at the first :meth:`within`), grouped by
    the tick they are due in."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due: dict[int, set[asyncio.Future[Any]]] = {}

    @property
    def waiting(self) -> int:
        """Waits not yet ended (the sets of ticks still to come)."""
        return sum(len(s) for s in self._due.values())

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
            due = self._due[tick] = set()
            loop.call_at(tick * TICK_S, self._expire, tick)
        due.add(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fut.cancelled() and not (task is not None and task.cancelling() > 0):
                raise TimeoutError from None
            raise
        finally:
            due.discard(fut)

    def _expire(self, tick: int) -> None:
        # Cancelling a future wakes its waiter, which turns that into a TimeoutError.
        for fut in self._due.pop(tick, ()):
            if not fut.done():
                fut.cancel()
