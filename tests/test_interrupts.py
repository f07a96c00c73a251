"""sidecar/interrupts.py: signals that come while an event loop is built wait for it, and reach
the handlers they would have reached; ignored signals stay ignored."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
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


def _sigint_default() -> None:
    # In the child: Ctrl-C as at a terminal (a background job inherits SIGINT ignored).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(argv: list[str], tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out, "wb") as out_file, open(err, "wb") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "jetbatch", *argv], stdout=out_file, stderr=err_file, env=env, preexec_fn=_sigint_default
        )
    return proc, out, err


def test_ctrl_c_at_any_point_of_a_sidecars_start_exits_130_without_a_traceback(
    nats_url: str, examples_dir: Path, tmp_path: Path
) -> None:
    """Ctrl-C while `jetbatch worker` or `classifier` starts: during the imports it printed a
    KeyboardInterrupt traceback (or torch's import aborted, status -6); while the event loop
    started, asyncio's interrupt was swallowed and the worker ran on (a hang); once ready the
    classifier exited 0. Now every point exits 130, quietly. Points: the imports, torch's import
    and the connecting, and once ready (each process is interrupted once, all in parallel)."""
    worker = ["worker", "--config", str(examples_dir / "models.toml"), "--nats-url", nats_url, "--http-port", "0"]
    classifier = ["classifier", "--config", str(examples_dir / "classifier.toml"), "--nats-url", nats_url, "--http-port", "0"]
    runs = [("w0.15", worker, 0.15), ("w0.6", worker, 0.6), ("c1.2", classifier, 1.2), ("w-ready", worker, None), ("c-ready", classifier, None)]
    started = [(name, *_start(argv, tmp_path, name), delay) for name, argv, delay in runs]
    t0 = time.monotonic()
    pending = {name for name, *_ in started}
    deadline = t0 + 90
    try:
        while pending and time.monotonic() < deadline:
            for name, proc, out, err, delay in started:
                if name not in pending:
                    continue
                due = time.monotonic() - t0 >= delay if delay is not None else b" ready" in out.read_bytes()
                if due or proc.poll() is not None:
                    proc.send_signal(signal.SIGINT)
                    pending.discard(name)
            time.sleep(0.02)
        assert not pending, f"never ready: {pending}"
        for name, proc, out, err, delay in started:
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                proc.wait(timeout=30)
                pytest.fail(f"{name} did not end after Ctrl-C:\n{err.read_text(errors='replace')[-6000:]}")
            text = err.read_text(errors="replace")
            assert "Traceback" not in text and "Exception ignored" not in text, (name, text[-3000:])
            assert code == 130, (name, code, text[-3000:])
    finally:
        for _, proc, *_rest in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
