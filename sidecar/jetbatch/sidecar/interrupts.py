"""Ctrl-C and SIGTERM in the commands that start processes and run event loops (``jetbatch
demo``, ``jetbatch bench``, the embedded deployment they start).

Python raises ``KeyboardInterrupt`` from a signal handler at whatever bytecode runs. Inside the
constructor of an event loop that leaves half an object, whose finalizer prints a traceback
(``'_UnixSelectorEventLoop' object has no attribute '_thread_id'``) on the way out. So the loops
these commands run are built while the signals wait; they are delivered right after.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from typing import Any, Coroutine, Iterator, TypeVar

__all__ = ["run_interruptible", "signals_deferred", "sigterm_as_interrupt"]

T = TypeVar("T")
_DEFERRED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (``kill``, ``docker stop``, a CI timeout) ends the command as
    Ctrl-C does, so what it started (an embedded nats-server, sidecar processes) is stopped on the
    way out instead of left running without a parent."""

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that come inside the block reach the handlers they would have reached,
    once it ends. Signals the process ignores stay ignored; off the main thread (where handlers
    cannot be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    previous: dict[int, Any] = {}
    for signum in _DEFERRED:
        handler = signal.getsignal(signum)
        if handler is signal.SIG_IGN or handler is None:  # None: a handler not set from Python
            continue
        previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


def run_interruptible(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` for code a signal may interrupt at any moment: its event loop is
    built while SIGINT and SIGTERM wait, and a coroutine that never started is closed (no
    "never awaited" warning when the interrupt came first)."""
    runner = asyncio.Runner()
    try:
        with signals_deferred():
            runner.get_loop()
        return runner.run(coro)
    finally:
        coro.close()
        runner.close()
