"""The scheduler on the live system: real NATS, real worker, batches read from reply headers."""

from __future__ import annotations

import asyncio

import anyio
import nats
import pytest

from jetbatch import sdk
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.streams import ensure_model_consumer, ensure_streams
from tests.helpers import make_config, running_worker, sleep_model, wait_until

pytestmark = pytest.mark.anyio


async def _prepare_streams(config: Config, url: str) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, config.subjects, config.streams, config.models)
        for model in config.models:
            await ensure_model_consumer(js, config.subjects, config.streams, model)
    finally:
        await nc.close()


async def _queued(client: sdk.Client, n: int) -> None:
    js = client.nats.jetstream()
    await wait_until(lambda: _count(js, client.subjects.models_stream, n), timeout_s=10, what=f"{n} queued requests")


async def _count(js: object, stream: str, n: int) -> bool:
    info = await js.stream_info(stream)  # type: ignore[attr-defined]
    return bool(info.state.messages >= n)


async def test_interleaved_requests_become_one_batch_per_model(nats_url: str, prefix: str) -> None:
    """[m1, m2, m1, m2, m1, m2], max batch 3, one resident slot, all queued before the worker
    picks: exactly two batches, [m1 x3] and [m2 x3], one load each."""
    model = sleep_model(max_batch_size=3, max_delay_ms=50, load_cost_s=0.5, options={"load_cost_s": 0.05, "batch_cost_s": 0.001, "item_cost_s": 0.0})
    config = make_config(prefix, {"m1": model, "m2": model}, worker={"max_resident_models": 1})
    await _prepare_streams(config, nats_url)
    order = ["m1", "m2", "m1", "m2", "m1", "m2"]
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        results: list[sdk.Result] = []

        async def send(i: int, m: str) -> None:
            results.append(await client.infer_result(f"{m}-{i}".encode(), model=m, timeout=20))

        async with anyio.create_task_group() as tg:
            for i, m in enumerate(order):
                tg.start_soon(send, i, m)
            await _queued(client, len(order))  # every request waits in JetStream before the worker starts
            async with running_worker(config, nats_url) as worker:
                await wait_until(lambda: len(results) == len(order), timeout_s=20, what="all replies")
    batches: dict[str, list[sdk.Result]] = {}
    for r in results:
        batches.setdefault(r.batch.batch_id, []).append(r)
    assert len(batches) == 2
    assert sorted(tuple(sorted(r.batch.model for r in b)) for b in batches.values()) == [("m1",) * 3, ("m2",) * 3]
    assert all(b[0].batch.batch_size == 3 and b[0].batch.model_loaded for b in batches.values())
    assert worker.stats["loads"] == 2


async def test_every_request_answered_once_under_mixed_load(nats_url: str, prefix: str) -> None:
    """Three models, one slot, a burst of interleaved requests: every request gets exactly one
    answer from the model it asked for, and models are switched far fewer times than requests."""
    model = sleep_model(max_batch_size=8, max_delay_ms=5, options={"load_cost_s": 0.02, "batch_cost_s": 0.002, "item_cost_s": 0.0})
    config = make_config(prefix, {"a": model, "b": model, "c": model}, worker={"max_resident_models": 1})
    names = ["a", "b", "c"] * 20
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            results = await asyncio.gather(*(client.infer_result(f"{m}{i}".encode(), model=m, timeout=30) for i, m in enumerate(names)))
    assert [r.output for r in results] == [f"{m}{i}".encode() for i, m in enumerate(names)]
    assert [r.batch.model for r in results] == names
    assert worker.stats["requests"] == len(names)
    assert worker.stats["loads"] < len(names) // 4
