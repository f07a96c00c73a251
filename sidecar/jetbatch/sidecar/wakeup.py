"""A wait that ends when it is woken, or at its deadline to within the OS's wake-up time.

The event loop's timers sleep in ``epoll_wait``, whose timeout is whole milliseconds rounded up
(asyncio's selector and libuv alike): a 2.1 ms wait ends after 3 ms plus the wake-up. On the
2-core VM of ``docs/benchmarks.md`` waits of 1-3 ms ended 0.67 ms late at the median, 1.05 ms
at p90. The batch window closes on such a wait, so a lone request waited its ``max_delay`` plus
that. On Linux a timerfd fires at its deadline to the microsecond and makes ``epoll_wait``
return at once: :class:`Wakeup` arms one for each wait, and keeps the loop's own timer as a
backstop. Elsewhere (or if the timerfd cannot be made) the loop's timer alone ends the wait.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
from typing import Any

__all__ = ["Wakeup"]

_CLOCK_MONOTONIC = 1
# O_NONBLOCK | O_CLOEXEC, the flag values of every Linux architecture jetbatch runs on.
_TFD_FLAGS = 0o4000 | 0o2000000
# The loop's timer ends the wait this long after the timerfd should have (a backstop only).
_BACKSTOP_S = 0.002
_MAX_WAIT_S = 86_400.0  # longer waits are cut to a day (the callers' waits are milliseconds)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()


def _timerfd(timeout_s: float) -> int | None:
    """A non-blocking timerfd that becomes readable ``timeout_s`` from now (None when the OS
    gives none)."""
    if _libc is None:
        return None
    fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_FLAGS)
    if fd < 0:
        return None
    ns = max(int(timeout_s * 1e9), 1)  # 0 would disarm it
    spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))
    if _libc.timerfd_settime(fd, 0, ctypes.byref(spec), None) < 0:
        os.close(fd)
        return None
    return fd


class Wakeup:
    """One waiter at a time: :meth:`wait` until :meth:`wake` is called or the timeout passes."""

    # Whether the OS gives a timerfd (Linux): waits end on it unless the loop cannot watch it
    # (a loop without ``add_reader``), and on the loop's timer otherwise.
    precise = _libc is not None

    def __init__(self) -> None:
        self._waiter: asyncio.Future[bool] | None = None

    def wake(self) -> None:
        """End the current wait (if any) early; a wake with nobody waiting is not kept."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    async def wait(self, timeout_s: float) -> bool:
        """Wait until woken (True) or ``timeout_s`` seconds passed (False; at once for a
        timeout that is not a positive number)."""
        timeout_s = min(timeout_s, _MAX_WAIT_S) if timeout_s > 0 else 0.0  # NaN: 0
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter

        def expire() -> None:
            if not waiter.done():
                waiter.set_result(False)

        fd = _timerfd(timeout_s)
        if fd is not None:
            try:
                loop.add_reader(fd, expire)
            except (NotImplementedError, OSError, ValueError):  # a loop without add_reader
                os.close(fd)
                fd = None
        handle = loop.call_later(timeout_s + (_BACKSTOP_S if fd is not None else 0.0), expire)
        try:
            return await waiter
        finally:
            handle.cancel()
            if fd is not None:
                loop.remove_reader(fd)
                os.close(fd)
            if self._waiter is waiter:
                self._waiter = None
