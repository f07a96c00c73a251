"""What every live benchmark shares: a server, the sidecars (in this process or each in its own),
the client side's gather, and one JSON record per run.

- :func:`server` / :func:`cluster`: an embedded nats-server with JetStream (or 3 nodes).
- :func:`config`: a :class:`Config` from sections, under a fresh subject prefix per call, so runs
  on one server never see each other's streams.
- :func:`in_process`: a worker (and a classifier) on this process's event loop, ready on entry,
  stopped on exit; :func:`processes`: the same config as separate ``jetbatch`` processes
  (:class:`Deployment`, as ``jetbatch up`` runs them).
- :func:`gather`: ``n`` calls at a concurrency, timed as one burst.
- :func:`emit` (``bench.records``): the run's record, printed and appended to ``--json``.

Benchmarks run as modules from the repository root: ``python -m bench.overhead ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from bench.records import emit
from jetbatch.sidecar.classifier import Classifier
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.dev.deployment import Deployment
from jetbatch.sidecar.dev.natsserver import EmbeddedNats, NatsCluster
from jetbatch.sidecar.transport import connect
from jetbatch.sidecar.worker import Worker

__all__ = ["Gathered", "cluster", "config", "emit", "gather", "in_process", "processes", "server"]

T = TypeVar("T")


@contextlib.contextmanager
def server(**kwargs: Any) -> Iterator[EmbeddedNats]:
    """One embedded nats-server with JetStream (a free port, a temporary store)."""
    with EmbeddedNats(**kwargs) as s:
        yield s


@contextlib.contextmanager
def cluster(**kwargs: Any) -> Iterator[NatsCluster]:
    """A 3-node JetStream cluster (``.url`` lists every node)."""
    with NatsCluster(**kwargs) as c:
        yield c


def config(sections: dict[str, Any], *, tag: str = "bn") -> Config:
    """``sections`` as a :class:`Config`, with ``nats.prefix`` set to a fresh ``<tag><hex>``."""
    raw = dict(sections)
    raw["nats"] = {**raw.get("nats", {}), "prefix": f"{tag}{uuid.uuid4().hex[:6]}"}
    return msgspec.convert(raw, Config)


@contextlib.asynccontextmanager
async def in_process(cfg: Config, url: str, *, classifier: bool = False, ready_timeout_s: float = 60.0) -> AsyncIterator[Worker]:
    """A worker (and, with ``classifier``, a classifier on its own connection) running on this
    event loop: the cheapest layout, where producer, sidecars and client share one loop. Yields
    the worker (its ``stats`` are the run's counters)."""
    nc = await connect(cfg.nats, url)
    nc2 = await connect(cfg.nats, url) if classifier else None
    try:
        worker = Worker(cfg, nc)
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


@contextlib.contextmanager
def processes(config_path: str | os.PathLike[str], url: str, **kwargs: Any) -> Iterator[Deployment]:
    """The sidecars of the config at ``config_path`` as separate ``jetbatch`` processes against
    ``url`` (the layout of ``compose.yaml``), ready on entry and stopped on exit."""
    with Deployment(Path(config_path), nats_url=url, **kwargs) as deployment:
        yield deployment


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
