"""sidecar/interrupts.py: signals that come while an event loop is built wait for it, and reach
the handlers they would have reached; ignored signals stay ignored."""

from __future__ import annotations

import asyncio
import gc
import signal
import warnings
from typing import Any, Iterator

import pytest

from jetbatch.sidecar.interrupts import run_interruptible, signals_deferred, sigterm_as_interrupt


@pytest.fixture
def term_handler() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_inside_the_block_reaches_its_handler_when_the_block_ends(term_handler: None) -> None:
    seen: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("handled"))
    with signals_deferred():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # one delivery for both, as the kernel coalesces them
        seen.append("block ends")
    assert seen == ["block ends", "handled"]


def test_an_ignored_signal_stays_ignored(term_handler: None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with signals_deferred():
        signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # and the process is still here


def test_sigterm_while_the_loop_is_built_interrupts_after_it(term_handler: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kill` at the moment `jetbatch demo` starts its event loop: a KeyboardInterrupt raised inside
    the loop's constructor left half a loop, whose finalizer printed a traceback. Now the loop is
    whole and closed, the coroutine never started is closed, and the interrupt comes after."""
    made: list[asyncio.AbstractEventLoop] = []
    policy = asyncio.get_event_loop_policy()
    original = policy.new_event_loop

    def new_event_loop() -> asyncio.AbstractEventLoop:
        signal.raise_signal(signal.SIGTERM)  # as if `kill` came now
        loop = original()
        made.append(loop)
        return loop

    monkeypatch.setattr(policy, "new_event_loop", new_event_loop)
    ran: list[bool] = []

    async def work() -> int:
        ran.append(True)
        return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
            run_interruptible(work())
        gc.collect()
    assert len(made) == 1 and made[0].is_closed()
    assert ran == []
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_without_a_signal_it_runs_the_coroutine() -> None:
    async def work(x: Any) -> Any:
        await asyncio.sleep(0)
        return x

    assert run_interruptible(work(7)) == 7
