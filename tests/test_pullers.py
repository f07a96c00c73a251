"""The worker's pull subscriptions (sidecar/worker/pullers.py) against a real nats-server: what a
puller holds goes back to the queue when the worker stops fetching from it, not after its ack
wait."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import nats
import pytest

from jetbatch.sdk.protocol import Priority
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.pulling import Puller
from jetbatch.sidecar.streams import ensure_streams, model_consumer_name
from jetbatch.sidecar.worker.counters import Counters
from jetbatch.sidecar.worker.pullers import Pullers
from jetbatch.sidecar.worker.slots import Slot
from tests.helpers import make_config, pull_waiting, sleep_model, wait_until

pytestmark = pytest.mark.anyio


async def _a_leftover(js: Any, stream: str, consumer: str, psub: Any, subject: str) -> None:
    """A request delivered to ``psub`` that no fetch takes: its fetch was cancelled while its
    pull request waited at the server (as a stop or a window closing early leaves one)."""
    fetch = asyncio.ensure_future(psub.fetch(1, timeout=30.0))
    await pull_waiting(js, stream, consumer)
    fetch.cancel()
    await js.publish(subject, b"left over")
    await wait_until(lambda: psub.buffered == 1, timeout_s=10, what="the delivery in the puller's buffer")


async def _given_back(nc: Any, stream: str, consumer: str) -> None:
    """The request is back in the queue: the next fetch gets it again now, not after its ack
    wait (five minutes in these tests)."""
    again = await Puller(nc, stream, consumer).start()
    got = await again.fetch(1, timeout=10.0)
    assert [(m.data, m.metadata.num_delivered) for m in got] == [(b"left over", 2)]
    await again.unsubscribe()


@contextlib.asynccontextmanager
async def _both_lines(url: str, prefix: str, **streams: Any) -> AsyncIterator[tuple[Any, Config, Pullers, Slot]]:
    """A connection, model m1's streams (a five-minute ack wait: a request left in a puller
    nobody fetches from would wait all of it), its slot with batch requests counted, and its
    pullers made for both lines."""
    config = make_config(prefix, {"m1": sleep_model()}, streams={"ack_wait_s": 300.0, **streams})
    nc = await nats.connect(url)
    try:
        await ensure_streams(nc.jetstream(), config.subjects, config.streams, ["m1"])
        pullers = Pullers(nc, config.subjects, config.streams, on_late=lambda slot: None, counters=Counters())
        slot = Slot(name="m1", config=SimpleNamespace(), handler=None, window=None)  # type: ignore[arg-type]
        slot.bulk = 1  # batch requests seen: the batch line gets a puller
        assert await pullers.ready(slot)
        yield nc, config, pullers, slot
    finally:
        await nc.close()


async def test_a_quiet_batch_line_keeps_its_puller_while_it_holds_a_delivery_then_loses_it(nats_url: str, prefix: str) -> None:
    """A batch line with no request counted loses its puller once its consumer was made sure of
    half the idle limit ago, but not while the puller holds a delivery no fetch took: the next
    fetch takes that first (dropped with it, it used to wait out its ack wait, five minutes
    here)."""
    async with _both_lines(nats_url, prefix, consumers="on-demand") as (nc, config, pullers, slot):
        js, subjects, streams = nc.jetstream(), config.subjects, config.streams
        bulk_consumer = model_consumer_name("m1", Priority.BATCH)
        psub = slot.bulk_psub
        assert psub is not None
        await _a_leftover(js, subjects.models_stream, bulk_consumer, psub, subjects.model("m1", Priority.BATCH))

        slot.bulk = 0
        assert await pullers.ready(slot) and slot.bulk_psub is psub  # recently made: kept
        slot.lines.bulk_consumer_ready_at = time.time() - streams.consumer_idle_s  # long ago
        assert await pullers.ready(slot) and slot.bulk_psub is psub and psub.buffered == 1  # holds one: kept
        (msg,) = await psub.fetch(1, timeout=5.0)  # the next fetch's, from the buffer
        assert msg.data == b"left over"
        await msg.ack()
        assert await pullers.ready(slot)
        assert slot.bulk_psub is None and slot.psub is not None  # nothing held: gone
        assert pullers.counts()["pull_requests"] == 2  # the dropped puller's still count


async def test_a_stop_hands_back_what_each_line_held(nats_url: str, prefix: str) -> None:
    async with _both_lines(nats_url, prefix) as (nc, config, pullers, slot):
        subjects, js = config.subjects, nc.jetstream()
        for priority, psub in ((Priority.INTERACTIVE, slot.psub), (Priority.BATCH, slot.bulk_psub)):
            await _a_leftover(js, subjects.models_stream, model_consumer_name("m1", priority), psub, subjects.model("m1", priority))
        await pullers.close([slot])
        for priority in Priority:
            await _given_back(nc, subjects.models_stream, model_consumer_name("m1", priority))
        # The status counters: each line's cancelled fetch sent a no_wait request (ended by its
        # 404: nothing was stored) and one that waited (ended by the delivery it asked for).
        assert pullers.counts() == {"pull_requests": 4, "pull_ends": 2, "forged_deliveries": 0}


@pytest.mark.anyio
async def test_the_models_stream_takes_two_consumers_for_each_of_a_thousand_models(nats_url: str, prefix: str) -> None:
    """Found by an attack: with `streams.consumers = "eager"` and 1000 models every worker exited
    at start-up: nats-server 2.15 caps a stream that leaves its consumer limit unset at 1 000
    consumers, and each model has two (its interactive and batch lines). The models stream says
    its limit, and one made by an earlier release is updated to it."""
    from nats.js.api import StreamConfig

    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.config import StreamsConfig
    from jetbatch.sidecar.streams import MAX_MODEL_CONSUMERS, ensure_model_consumers, ensure_streams, models_stream_config

    subjects = Subjects(prefix)
    models = [f"m{i}" for i in range(510)]
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        old = models_stream_config(subjects, StreamsConfig())
        old.max_consumers = None  # as an earlier release made it: the server's default
        await js.add_stream(StreamConfig.from_response(old.as_dict()))
        assert (await js.stream_info(subjects.models_stream)).config.max_consumers == -1
        await ensure_streams(js, subjects, StreamsConfig(), models)
        assert (await js.stream_info(subjects.models_stream)).config.max_consumers == MAX_MODEL_CONSUMERS
        await ensure_model_consumers(js, subjects, StreamsConfig(), models, priorities=tuple(Priority))
        assert (await js.stream_info(subjects.models_stream)).state.consumer_count == 1020
        await js.delete_stream(subjects.models_stream)
    finally:
        await nc.close()


async def test_a_consumer_made_with_the_old_30_s_ack_wait_is_updated_to_the_configured_one(nats_url: str, prefix: str) -> None:
    """The ack wait is what a killed worker's requests wait before a peer may take them: it went
    from 30 s to 5 s, and a deployment's existing consumers (made with 30 s) must follow, or its
    recovery stays 30 s. Ensuring a consumer updates it in place, pending requests kept."""
    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.config import StreamsConfig
    from jetbatch.sidecar.streams import ensure_model_consumer, progress_interval_s

    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, subjects, StreamsConfig(), ["m1"])
        await ensure_model_consumer(js, subjects, StreamsConfig(ack_wait_s=30.0), "m1")
        await js.publish(subjects.model("m1", Priority.INTERACTIVE), b"x")
        name = model_consumer_name("m1")
        assert (await js.consumer_info(subjects.models_stream, name)).config.ack_wait == 30.0
        await ensure_model_consumer(js, subjects, StreamsConfig(), "m1")
        info = await js.consumer_info(subjects.models_stream, name)
        assert info.config.ack_wait == StreamsConfig().ack_wait_s == 5.0
        assert info.num_pending == 1
        assert progress_interval_s(info.config.ack_wait) < info.config.ack_wait / 2  # two progress acks may be lost
        await js.delete_stream(subjects.models_stream)
    finally:
        await nc.close()
