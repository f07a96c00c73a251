"""Forged coordination events on an open server (docs/security.md): arrival and take events are
core messages anyone allowed to publish there can send. A worker checks them against the stream
before it pays a load, and a forged take cannot hide real requests from it for long."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from jetbatch import sdk
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Subjects
from tests.helpers import make_config, running_worker, sleep_model, wait_until

pytestmark = pytest.mark.anyio

# Full speed, in bursts each flushed to the server (a bound on the test, not a pacing).
_BURST = 200


async def _flood(nc: Any, subject: str, data: bytes, headers: Any, *, until: anyio.Event, limit: int) -> int:
    """Publish ``data`` to ``subject`` as fast as the connection takes it, up to ``limit``
    messages or until ``until`` is set; how many were sent."""
    sent = 0
    while sent < limit and not until.is_set():
        for _ in range(_BURST):
            await nc.publish(subject, data, headers=headers(sent) if callable(headers) else headers)
            sent += 1
        await nc.flush()
    return sent


async def test_forged_arrival_events_cost_a_look_never_a_load(nats_url: str, prefix: str) -> None:
    # One model slot: every load of "ghost" would evict "real" and reload it for the next request.
    config = make_config(
        prefix,
        {"real": sleep_model(options={"load_cost_s": 0.02, "batch_cost_s": 0.001, "item_cost_s": 0.0}),
         "ghost": sleep_model(options={"load_cost_s": 0.02, "batch_cost_s": 0.001, "item_cost_s": 0.0})},
        worker={"max_resident_models": 1},
    )  # fmt: skip
    subjects = Subjects(prefix)
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="real", timeout=10)
            loads_before = worker.stats["loads"]
            nc = await connect_nats(nats_url)
            try:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime(time.time() - 5))
                done = anyio.Event()
                answered: list[float] = []

                async def real_traffic() -> None:
                    try:
                        for i in range(20):
                            started = time.monotonic()
                            await client.infer(f"r{i}".encode(), model="real", timeout=10)
                            answered.append(time.monotonic() - started)
                    finally:
                        done.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(real_traffic)
                    # An old timestamp and a sequence far ahead of the stream: the most urgent-looking
                    # queue there is, and one no count could place before its answer.
                    sent = await _flood(
                        nc, subjects.arrived("ghost"), b"", lambda i: {"Nats-Time-Stamp": stamp, "Nats-Sequence": str(10**15 + i)},
                        until=done, limit=20_000,
                    )  # fmt: skip
                    await done.wait()
            finally:
                await nc.close()
            # The worker has taken turns after the last forged event (a real request after it is answered).
            await client.infer(b"after", model="real", timeout=10)
        assert sent >= _BURST
        assert len(answered) == 20 and max(answered) < 5.0, answered
        assert worker.stats["loads"] == loads_before, f"{worker.stats['loads'] - loads_before} loads for {sent} forged arrival events"
        assert not worker.slots["ghost"].resident


async def test_forged_take_events_cannot_hide_real_requests(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model()})
    subjects = Subjects(prefix)
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            nc = await connect_nats(nats_url)
            try:
                stop = anyio.Event()
                async with anyio.create_task_group() as tg:
                    # Every take says a peer (one of a few made-up ids) took all there is.
                    tg.start_soon(lambda: _flood(
                        nc, subjects.taken("m1"), b"+100000", lambda i: {"Jetbatch-Worker": f"evil-{i % 4}"}, until=stop, limit=10**7,
                    ))  # fmt: skip
                    # Past the served model's hold: its next requests need a decision on the count.
                    await wait_until(lambda: worker.core.serving is None, timeout_s=10, what="the hold of m1 over")
                    took: list[float] = []
                    try:
                        for i in range(5):
                            started = time.monotonic()
                            await client.infer(f"x{i}".encode(), model="m1", timeout=15)
                            took.append(time.monotonic() - started)
                    finally:
                        stop.set()
            finally:
                await nc.close()
        # The bound: a count (idle_refresh_s, 1 s) and a check of the consumer, well under the timeout.
        assert len(took) == 5 and max(took) < 4.0, took
        # A lone worker does not even subscribe to take events (no peer in view sends one): none
        # reached it, none hid a request.
        assert not worker.arrivals.listening_to_takes
        assert worker.stats["takes_unheard"] == 0 and worker.stats["takes_refuted"] == 0, worker.stats.snapshot()
