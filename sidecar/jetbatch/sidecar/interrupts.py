"""Ctrl-C and SIGTERM in the ``jetbatch`` commands.

Python raises ``KeyboardInterrupt`` from a signal handler at whatever bytecode runs: inside an
import (torch's C++ initialisers then abort the process), a finalizer ("Exception ignored in"),
or the constructor of an event loop (half an object, whose finalizer prints a traceback). So a
command exits at once with status 130 while it has started nothing (:func:`exits_at_once`);
a command that starts processes says so (:func:`sigterm_as_interrupt`) and builds its loops
while the signals wait (:func:`run_interruptible`); a sidecar handles them in its event loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Coroutine, Iterator, TypeVar

__all__ = ["EXIT_INTERRUPTED", "exits_at_once", "run_interruptible", "signals_deferred", "sigterm_as_interrupt"]

EXIT_INTERRUPTED = 130

T = TypeVar("T")
_DEFERRED = (signal.SIGINT, signal.SIGTERM)


def _exit_now(signum: int, frame: object) -> None:
    os._exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def exits_at_once() -> Iterator[None]:
    """Within the block, Ctrl-C ends the process at once with status 130, without a traceback:
    for the part of a command that has started nothing to stop (imports, reading arguments and
    configs). Python's own start, before any of this runs, is out of reach. Off the main thread
    (where handlers cannot be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGINT, _exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, Ctrl-C raises ``KeyboardInterrupt`` (also inside :func:`exits_at_once`),
    and SIGTERM (``kill``, ``docker stop``, a CI timeout) ends the command as Ctrl-C does, so
    what it started (an embedded nats-server, sidecar processes) is stopped on the way out
    instead of left running without a parent."""

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is _exit_now:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is _exit_now:
            signal.signal(signal.SIGINT, previous_int)


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
    import asyncio

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
    import asyncio

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
