"""Test helpers: configs and an in-process worker running inside the test's event loop."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import anyio
import msgspec

from jetbatch import sdk
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.classifier import Classifier
from jetbatch.sidecar.config import Config, parse_config
from jetbatch.sidecar.status import StatusReport, collect_status
from jetbatch.sidecar.transport import connect, connect_replies
from jetbatch.sidecar.worker import BatchReport, Worker


@contextlib.contextmanager
def ring_worker_process(nats_url: str, prefix: str, config_text: str, tmp_path: Any, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A real `jetbatch worker --ring-minutes 0.01` (``args`` added) on ``config_text``, ready and
    fed 20 requests of model ``m1``, so its ring holds events; terminated on the way out."""
    config = tmp_path / "worker.toml"
    config.write_text(config_text)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetbatch", "worker", "--config", str(config), "--nats-url", nats_url, "--http-port", "off",
         "--ring-minutes", "0.01", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "JETBATCH_READY_LINE": "1"}, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and " ready" in proc.stdout.readline()

        async def traffic() -> None:
            async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                for i in range(20):
                    assert await client.infer(f"x{i}".encode(), model="m1", timeout=20) == f"x{i}".encode()

        anyio.run(traffic)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=60)


def make_config(prefix: str, models: dict[str, dict[str, Any]], **sections: dict[str, Any]) -> Config:
    """A Config from plain dicts (as a TOML file would give), under a test-unique prefix."""
    raw: dict[str, Any] = {"nats": {"prefix": prefix}, "models": models}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    raw.setdefault("worker", {}).setdefault("poll_interval_ms", 50)
    return msgspec.convert(raw, Config)


def sleep_model(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"handler": "sleep", "max_batch_size": 8, "max_delay_ms": 20, "options": {"load_cost_s": 0.0, "batch_cost_s": 0.001, "item_cost_s": 0.0}}
    base.update(overrides)
    return base


@contextlib.asynccontextmanager
async def _running(make: Callable[[Any], Any], config: Config, url: str) -> AsyncIterator[Any]:
    """Run a sidecar (worker or classifier) in this event loop until the block ends."""
    nc = await connect(config.nats, url)
    reply_nc = await connect_replies(config.nats, url)
    sidecar = make(nc, reply_nc)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sidecar.run)
            with anyio.fail_after(20):
                await sidecar.ready.wait()
            yield sidecar
            sidecar.stop()
    finally:
        await nc.close()
        if reply_nc is not None:
            await reply_nc.close()


@contextlib.asynccontextmanager
async def running_worker(
    config: Config, url: str, *, on_batch: Callable[[BatchReport], None] | None = None, **kw: Any
) -> AsyncIterator[Worker]:
    async with _running(lambda nc, rnc: Worker(config, nc, on_batch=on_batch, reply_nc=rnc, **kw), config, url) as worker:
        yield worker


@contextlib.asynccontextmanager
async def running_classifier(config: Config, url: str) -> AsyncIterator[Classifier]:
    async with _running(lambda nc, rnc: Classifier(config, nc, reply_nc=rnc), config, url) as classifier:
        yield classifier


@contextlib.asynccontextmanager
async def worker_and_jetstream(prefix: str, url: str) -> AsyncIterator[tuple[Worker, Any]]:
    """A worker serving one sleep model ``m1`` under ``prefix``, and a plain nats-py JetStream
    context on its own connection, for tests that look at or change the streams themselves."""
    async with running_worker(make_config(prefix, {"m1": sleep_model()}), url) as worker:
        nc = await connect_nats(url)
        try:
            yield worker, nc.jetstream()
        finally:
            await nc.close()


async def worker_reports(url: str, prefix: str, *, wait_s: float = 0.3) -> list[StatusReport]:
    """The status reports of every worker on the bus under ``prefix``."""
    nc = await connect_nats(url)
    try:
        return [r for r in await collect_status(nc, Subjects(prefix), wait_s=wait_s) if r.role == "worker"]
    finally:
        await nc.close()


async def first_worker_resident(url: str, prefix: str) -> bool:
    """A worker has loaded a model (with a slow sleep handler: its first batch is running)."""
    reports = await worker_reports(url, prefix, wait_s=0.2)
    return bool(reports and reports[0].resident)


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await anyio.sleep(0.01)


__all__ = [
    "first_worker_resident",
    "make_config",
    "parse_config",
    "running_classifier",
    "running_worker",
    "sleep_model",
    "wait_until",
    "worker_reports",
]


async def pull_waiting(js: Any, stream: str, durable: str = "c") -> None:
    """Until a pull request of ``durable`` waits at the server (a fetch is listening)."""

    async def waiting() -> bool:
        return bool((await js.consumer_info(stream, durable)).num_waiting)

    await wait_until(waiting, timeout_s=10, what="a pull request waiting at the server")


def numeric_keys(struct: type, path: tuple[str, ...] = (), *, skip: frozenset[str] = frozenset()) -> list[tuple[str, bool]]:
    """Every number a file read into ``struct`` can hold, as a dotted key (a table of tables as
    ``m1``, or its first literal key; a list as ``[]``), and whether it is an int; leaf names in
    ``skip`` left out. Walked from the types, so a key added later is covered."""
    import msgspec.inspect as mi

    keys: list[tuple[str, bool]] = []

    def walk(t: object, at: tuple[str, ...]) -> None:
        if isinstance(t, mi.StructType):
            for f in t.fields:
                walk(f.type, (*at, f.encode_name))
        elif isinstance(t, mi.UnionType):
            for member in t.types:
                walk(member, at)
        elif isinstance(t, mi.DictType):
            key_type = t.key_type
            walk(t.value_type, (*at, key_type.values[0] if isinstance(key_type, mi.LiteralType) else "m1"))
        elif isinstance(t, mi.ListType):
            walk(t.item_type, (*at, "[]"))
        elif isinstance(t, (mi.IntType, mi.FloatType)) and at[-1] not in skip:
            keys.append((".".join(at), isinstance(t, mi.IntType)))

    walk(mi.type_info(struct), path)
    return keys
