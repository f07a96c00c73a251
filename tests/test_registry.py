"""The models stream's two wildcards and the model registry behind ``UnknownModel``
(sidecar/jetbatch/sidecar/registry.py, sdk/jetbatch/sdk/registry.py), on real nats-servers: one
with the default configuration, as compose's, where the old layout stopped fitting."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.js.api import StreamConfig

from jetbatch import sdk
from jetbatch.sdk.protocol import Priority, SidecarReport, Subjects
from jetbatch.sidecar.config import StreamsConfig
from jetbatch.sidecar.dev.natsserver import EmbeddedNats
from jetbatch.sidecar.registry import register_models
from jetbatch.sidecar.streams import ensure_streams, models_stream_config
from tests.helpers import make_config, running_worker, sleep_model


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """nats-server with its default configuration (``max_payload`` 1 MiB), JetStream on."""
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("default-store"), max_payload=None) as server:
        yield server


@contextlib.asynccontextmanager
async def _connected(url: str) -> AsyncIterator[Any]:
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.close()


async def _stored(js: object, subjects: Subjects) -> int:
    return (await js.stream_info(subjects.models_stream)).state.messages  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_more_models_than_the_listed_layout_allowed_register_on_a_default_server(default_server: EmbeddedNats, prefix: str) -> None:
    """12 000 models of 40 characters: the stream that listed each model's two lines took a
    1.5 MB create request here, past the default 1 MiB max_payload (refused at about 10 000)."""
    subjects = Subjects(prefix)
    models = [f"team-{i:05d}-".ljust(40, "v") for i in range(12_000)]
    listed = sum(len(subjects.model(m, p)) + 3 for m in models for p in Priority)
    assert listed > 1024 * 1024  # what the old create would have carried in its subjects alone
    async with _connected(default_server.url) as nc:
        js = nc.jetstream()
        await ensure_streams(js, subjects, StreamsConfig(), models)
        info = await js.stream_info(subjects.models_stream)
        assert sorted(info.config.subjects or []) == sorted(subjects.queue_wildcards)
        kv = await js.key_value(subjects.registry_bucket)
        assert len(await kv.keys()) == 12_000
        assert await register_models(js, subjects, StreamsConfig(), models) == 0  # a restart writes nothing

        async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
            with pytest.raises(sdk.UnknownModel, match="no-such-model"):
                await client.infer(b"x", model="no-such-model", timeout=5)
            assert await _stored(js, subjects) == 0  # refused before it was sent
            with pytest.raises(sdk.RequestTimeout):  # registered, and no worker runs here
                await client.infer(b"x", model=models[-1], timeout=0.5)
            assert await _stored(js, subjects) == 1


@pytest.mark.anyio
async def test_a_stream_listing_its_models_is_upgraded_with_what_waits_on_it(nats_url: str, prefix: str) -> None:
    """A models stream from before the wildcards (each model's lines by name) keeps its stored
    requests, and the models it listed stay servable: they go into the registry first."""
    subjects = Subjects(prefix)
    old = models_stream_config(subjects, StreamsConfig())
    old.subjects = sorted(subjects.model(m, p) for m in ("m1", "gone") for p in Priority)
    async with _connected(nats_url) as nc:
        js = nc.jetstream()
        await js.add_stream(StreamConfig.from_response(old.as_dict()))
        await js.publish(subjects.model("m1"), b"a")
        await js.publish(subjects.model("gone", Priority.BATCH), b"b")
        await ensure_streams(js, subjects, StreamsConfig(), ["m1", "new"])
        info = await js.stream_info(subjects.models_stream)
        assert sorted(info.config.subjects or []) == sorted(subjects.queue_wildcards)
        assert info.state.messages == 2
        kv = await js.key_value(subjects.registry_bucket)
        assert sorted(await kv.keys()) == ["gone", "m1", "new"]


@pytest.mark.anyio
async def test_a_deleted_key_is_unknown_and_an_unreadable_registry_refuses_nothing(nats_url: str, prefix: str) -> None:
    subjects = Subjects(prefix)
    async with _connected(nats_url) as nc:
        js = nc.jetstream()
        await js.add_stream(models_stream_config(subjects, StreamsConfig()))  # the stream, no registry yet
        async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
            # No registry (a deployment whose workers predate it): the request is sent.
            with pytest.raises(sdk.RequestTimeout):
                await client.infer(b"x", model="m1", timeout=0.5)
            assert await _stored(js, subjects) == 1
        await register_models(js, subjects, StreamsConfig(), ["m1", "m2"])
        kv = await js.key_value(subjects.registry_bucket)
        await kv.delete("m2")
        async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
            with pytest.raises(sdk.UnknownModel):
                await client.infer(b"x", model="m2", timeout=5)
            with pytest.raises(sdk.RequestTimeout):
                await client.infer(b"x", model="m1", timeout=0.5)
        assert await _stored(js, subjects) == 2


@pytest.mark.anyio
async def test_a_worker_serves_more_models_than_its_server_could_list(tmp_path: Path) -> None:
    """Found by an attack: 1 000 models of 40 characters on a server whose max_payload (32 KiB,
    standing for a default server's 1 MiB at thirty times the models) the stream's subject list
    outgrew: the worker exited at start. It now starts, and serves any of them; its advert, whose
    names no longer fit either, still goes out every heartbeat, without the names."""
    prefix = "big"
    models = {f"model-{i:04d}".ljust(40, "x"): sleep_model() for i in range(1000)}
    with EmbeddedNats(store_dir=tmp_path / "store", max_payload=32_768) as server:
        config = make_config(prefix, models)
        async with running_worker(config, server.url) as worker:
            async with _connected(server.url) as nc:
                async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                    result = await client.infer_result(b"x", model=sorted(models)[-1], timeout=30)
                    assert result.batch is not None and result.batch.model == sorted(models)[-1]
                entry = await (await nc.jetstream().key_value(Subjects(prefix).kv_bucket)).get(worker.worker_id)
                advert = msgspec.json.decode(entry.value, type=SidecarReport)
                assert advert.models_count == 1000 and advert.models == []


@pytest.mark.anyio
async def test_a_batch_of_models_is_looked_up_together_and_an_invalid_name_is_left_to_the_caller(nats_url: str, prefix: str) -> None:
    from jetbatch.sdk.registry import RegisteredModels

    subjects = Subjects(prefix)
    async with _connected(nats_url) as nc:
        js = nc.jetstream()
        await register_models(js, subjects, StreamsConfig(), ["m1", "m2"])
        registry = RegisteredModels(js, subjects)
        assert await registry.unregistered(["m1", "ghost", "not a name", "m2"], 1.0) == {"ghost"}
        assert registry.remembers("m1") and registry.remembers("m2") and not registry.remembers("ghost")
        await (await js.key_value(subjects.registry_bucket)).delete("m1")
        assert await registry.unregistered(["m1"], 1.0) == set()  # remembered for the client's life
