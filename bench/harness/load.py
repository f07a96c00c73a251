"""The client side's load: a closed burst at a concurrency (:func:`gather`), or an open-loop trace
sent each request at its time (:func:`replay`, the arrivals a simulator workload was built from)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from jetbatch import sdk

__all__ = ["Gathered", "Replayed", "gather", "replay"]

T = TypeVar("T")


@dataclass(frozen=True)
class Gathered(Generic[T]):
    """``n`` calls' results, in completion order, and the burst's wall time."""

    results: list[T]
    elapsed_s: float

    @property
    def rate(self) -> float:
        return len(self.results) / self.elapsed_s if self.elapsed_s > 0 else 0.0


async def gather(call: Callable[[], Awaitable[T]], n: int, concurrency: int) -> Gathered[T]:
    """Run ``call()`` ``n`` times, at most ``concurrency`` at once; time the whole burst."""
    gate = asyncio.Semaphore(concurrency)
    results: list[T] = []

    async def one() -> None:
        async with gate:
            results.append(await call())

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return Gathered(results, time.perf_counter() - started)


@dataclass
class Replayed:
    """An open-loop replay: the answered requests' latencies (seconds from their trace time), by
    priority class, and the counts of timed-out and failed ones."""

    latencies_s: list[float]
    by_class: dict[str, list[float]]
    timed_out: int = 0
    failed: int = 0


async def replay(
    url: str, prefix: str, arrivals: tuple[tuple[float, str], ...], timeout_s: float, *,
    classes: tuple[str, ...] | None = None, payload: bytes = b"x", lead_s: float = 0.5,
) -> Replayed:  # fmt: skip
    """Send each ``(at, model)`` request at ``lead_s + at`` from now (open loop: a late answer
    delays no later request); ``classes``: each request's priority class, in the same order."""
    out = Replayed([], {})
    async with sdk.Client.connect(url, prefix=prefix) as client:
        start = time.monotonic() + lead_s

        async def one(at: float, model: str, priority: str | None) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            try:
                if priority is None:
                    await client.infer(payload, model=model, timeout=timeout_s)
                else:
                    await client.infer(payload, model=model, timeout=timeout_s, priority=priority)
            except sdk.RequestTimeout:
                out.timed_out += 1
                return
            except sdk.JetbatchError:
                out.failed += 1
                return
            latency = time.monotonic() - (start + at)
            out.latencies_s.append(latency)
            out.by_class.setdefault(priority or "", []).append(latency)

        priorities = classes if classes is not None else (None,) * len(arrivals)
        await asyncio.gather(*(one(at, m, p) for (at, m), p in zip(arrivals, priorities)))
    return out
