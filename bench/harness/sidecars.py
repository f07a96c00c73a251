"""The sidecars of a run: on this process's event loop (:func:`in_process`, the cheapest layout,
where producer, sidecars and client share one loop) or each in a process of its own
(:func:`processes`, as ``jetbatch up`` and ``compose.yaml`` run them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import nats
from jetbatch.sidecar.classifier import Classifier
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.dev.deployment import Deployment
from jetbatch.sidecar.transport import connect
from jetbatch.sidecar.recording import FlightRecorder
from jetbatch.sidecar.worker import Worker

__all__ = ["classifier_in_process", "cli_processes", "in_process", "processes"]

ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def in_process(
    cfg: Config, url: str, *, classifier: bool = False, ready_timeout_s: float = 60.0, record: FlightRecorder | None = None
) -> AsyncIterator[Worker]:
    """A worker (and, with ``classifier``, a classifier on its own connection) running on this
    event loop, ready on entry, stopped on exit. Yields the worker (its ``stats`` are the run's
    counters). ``record``: the worker's core is recorded there (``jetbatch worker --record``)."""
    nc = await connect(cfg.nats, url)
    nc2 = await connect(cfg.nats, url) if classifier else None
    try:
        worker = Worker(cfg, nc, record=record)
        sidecar = Classifier(cfg, nc2) if nc2 is not None else None
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            if sidecar is not None:
                tg.start_soon(sidecar.run)
            with anyio.fail_after(ready_timeout_s):
                await worker.ready.wait()
                if sidecar is not None:
                    await sidecar.ready.wait()
            try:
                yield worker
            finally:
                worker.stop()
                if sidecar is not None:
                    sidecar.stop()
    finally:
        await nc.close()
        if nc2 is not None:
            await nc2.close()


@contextlib.asynccontextmanager
async def classifier_in_process(cfg: Config, url: str, *, ready_timeout_s: float = 60.0) -> AsyncIterator[Classifier]:
    """A classifier alone on this event loop (no worker: what it forwards stays queued), ready on
    entry, stopped on exit."""
    nc = await connect(cfg.nats, url)
    try:
        sidecar = Classifier(cfg, nc)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sidecar.run)
            with anyio.fail_after(ready_timeout_s):
                await sidecar.ready.wait()
            try:
                yield sidecar
            finally:
                sidecar.stop()
    finally:
        await nc.close()


@contextlib.contextmanager
def processes(config_path: str | os.PathLike[str], url: str | None = None, *, ready_timeout_s: float = 60.0, **kwargs: Any) -> Iterator[Deployment]:
    """The sidecars of the config at ``config_path`` (:func:`bench.harness.write_config`) as
    separate ``jetbatch`` processes against ``url`` (an embedded server of their own when None),
    ready on entry and stopped on exit. ``kwargs`` go to :class:`Deployment` (``workers``,
    ``classifier``, ``store_dir``, ``http_port``, ``extra_env``...); the deployment yielded can
    stop, kill and restart each process (``stop_process``, ``start_worker``). ``ready_timeout_s``:
    how long the sidecars have to report ready."""
    deployment = Deployment(Path(config_path), nats_url=url, **kwargs)
    with contextlib.ExitStack() as stack:
        stack.push(deployment.__exit__)
        yield deployment.start(ready_timeout_s)


@contextlib.contextmanager
def cli_processes(
    config_path: str | os.PathLike[str], url: str, roles: Sequence[str], *, wrap: Callable[[str], list[str]] | None = None,
    env: dict[str, str] | None = None, ready_timeout_s: float = 60.0,
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Each ``jetbatch <role>`` of ``roles`` (``worker``, ``classifier``) as ``python <wrap(role)>
    -m jetbatch <role>``: ``wrap`` puts the scenario's own tool in front (``["-m", "cProfile",
    "-o", path]``), which :func:`processes` cannot. Ready once their streams exist; on exit each
    gets SIGINT (the CLI exits cleanly, and a profiler writes its file) and is waited for."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for role in roles:
            procs[role] = subprocess.Popen(
                [sys.executable, *(wrap(role) if wrap else []), "-m", "jetbatch", role, "--config", str(config_path), "--nats-url", url,
                 "--http-port", "off"],
                env=env, cwd=ROOT,
            )  # fmt: skip
        streams = ("JETBATCH_MODELS", "JETBATCH_IN") if "classifier" in roles else ("JETBATCH_MODELS",)
        asyncio.run(_wait_for_streams(url, streams, ready_timeout_s))
        yield procs
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            proc.wait(60)


async def _wait_for_streams(url: str, streams: tuple[str, ...], timeout_s: float) -> None:
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # The streams (consumers are made on demand, at the first request's load).
                for stream in streams:
                    await nc.jetstream().stream_info(stream)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await nc.close()
