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
    "never awaited" warning when the interrupt came first). While it runs, a SIGTERM that
    :func:`sigterm_as_interrupt` turns into an interrupt cancels it as asyncio cancels on Ctrl-C,
    and ``KeyboardInterrupt`` is raised once it has unwound."""
    runner = asyncio.Runner()
    terminated: list[bool] = []
    main: Coroutine[Any, Any, T] | None = None
    try:
        with signals_deferred():
            runner.get_loop()
        main = _terminable(coro, terminated)
        try:
            return runner.run(main)
        except asyncio.CancelledError:
            if terminated:
                raise KeyboardInterrupt from None
            raise
    finally:
        if main is not None:
            main.close()
        coro.close()
        runner.close()


async def _terminable(coro: Coroutine[Any, Any, T], terminated: list[bool]) -> T:
    """``coro``, cancelled by a SIGTERM that is to interrupt (a Python handler is set for it).
    Raised from the handler at whatever bytecode ran, the interrupt hit the event loop itself:
    ``jetbatch bench`` then printed "coroutine ignored GeneratorExit", no summary, and crashed at
    exit (status 139). Cancelled, it unwinds as after Ctrl-C: finally blocks, partial results."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        return await coro
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_term() -> None:
        terminated.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        return await coro
    finally:
        loop.remove_signal_handler(signal.SIGTERM)  # which leaves SIG_DFL: the handler before goes back
        signal.signal(signal.SIGTERM, previous)
