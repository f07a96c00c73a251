"""Requests for a model no live worker registers (sidecar/worker/orphans.py): the pure rule with
a fake clock, and the worker answering them on a real nats-server."""

from __future__ import annotations

import nats
import pytest

from jetbatch import sdk
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.config import StreamsConfig
from jetbatch.sidecar.streams import ensure_streams
from jetbatch.sidecar.worker.orphans import Orphans
from tests.helpers import make_config, running_worker, sleep_model


def test_a_queue_is_due_only_after_it_has_been_unregistered_for_the_whole_grace() -> None:
    orphans = Orphans(grace_s=60.0)
    assert orphans.due({"m3": 5}, {"m1"}, now=100.0) == []
    assert orphans.due({"m3": 5}, {"m1"}, now=159.9) == []
    assert orphans.due({"m3": 5, "m4": 1}, {"m1"}, now=160.0) == ["m3"]  # m4 only now seen
    # A worker registering it again (a rolling restart ended) starts the clock over.
    assert orphans.due({"m3": 5, "m4": 1}, {"m1", "m3"}, now=161.0) == []
    assert orphans.due({"m3": 5, "m4": 1}, {"m1"}, now=200.0) == []
    assert orphans.due({"m3": 5, "m4": 1}, {"m1"}, now=220.0) == ["m4"]
    assert orphans.due({"m3": 5, "m4": 1}, {"m1"}, now=260.0) == ["m3", "m4"]
    # Answered (nothing stored any more): forgotten, so a later request waits a whole grace again.
    assert orphans.due({}, {"m1"}, now=261.0) == [] and orphans.watched == 0
    assert orphans.due({"m3": 1}, {"m1"}, now=262.0) == []
    # No grace (worker.orphan_grace_s = none): watched, and said, but never due.
    never = Orphans(grace_s=None)
    assert never.due({"m3": 5}, {"m1"}, now=0.0) == [] and never.due({"m3": 5}, {"m1"}, now=1e9) == []
    assert never.unregistered_since() == {"m3": 0.0}


@pytest.mark.anyio
async def test_requests_for_a_model_no_live_worker_registers_are_answered_unknown_model(nats_url: str, prefix: str) -> None:
    """Found by an attack: a worker restarted without one of its models (m3) left that model's
    queue on the models stream (its subjects only grow), so requests for m3 were stored and never
    answered: every caller waited out its timeout, and nothing was in the dead letters or the
    logs. After ``worker.orphan_grace_s`` with no live worker registering m3, a worker answers
    them ``unknown_model``, typed for the caller; its own models are served meanwhile."""
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, subjects, StreamsConfig(), ["m1", "m3"])  # as a worker that registered m3 left them
        config = make_config(prefix, {"m1": sleep_model()}, worker={"orphan_grace_s": 0.5})
        async with running_worker(config, nats_url), sdk.Client.connect(nats_url, prefix=prefix) as client:
            with pytest.raises(sdk.UnknownModel, match="no worker serves model 'm3'"):
                await client.infer(b"lost", model="m3", timeout=30, priority="batch")
            with pytest.raises(sdk.UnknownModel):
                await client.infer(b"lost too", model="m3", timeout=30)
            assert await client.infer(b"served", model="m1", timeout=10) == b"served"
        state = (await js.stream_info(subjects.models_stream, subjects_filter=subjects.model("m3"))).state
        assert state.messages == 0
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_a_model_a_live_peer_registers_is_left_to_it(nats_url: str, prefix: str) -> None:
    """The other side of the rule: m3 is registered by a live peer that takes longer than the
    grace to serve it (its load takes 3 s): the worker without m3 leaves its queue alone, and the
    request is served."""
    slow_load = sleep_model(options={"load_cost_s": 3.0, "batch_cost_s": 0.001, "item_cost_s": 0.0})
    a = make_config(prefix, {"m1": sleep_model()}, worker={"orphan_grace_s": 0.5, "id": "a"})
    b = make_config(prefix, {"m3": slow_load}, worker={"id": "b"})
    async with running_worker(b, nats_url), running_worker(a, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"kept", model="m3", timeout=30) == b"kept"


@pytest.mark.anyio
async def test_a_model_no_worker_ever_registered_is_answered_at_once(nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The models stream takes any model's subject (two wildcards), so a producer that skips the
    model registry's lookup (an older SDK, a bare NATS client; here the SDK with its lookup made
    to say "cannot tell") gets its request for a model nobody ever registered stored. The
    worker finds the registry does not name it and answers it unknown_model at its next count,
    not after the ten-minute grace, though it hears no peers (coordination off)."""
    from jetbatch.sdk.registry import RegisteredModels

    async def cannot_tell(self: RegisteredModels, model: str, timeout_s: float) -> None:
        return None

    monkeypatch.setattr(RegisteredModels, "check", cannot_tell)
    config = make_config(prefix, {"m1": sleep_model()}, worker={"coordinate": False})
    async with running_worker(config, nats_url), sdk.Client.connect(nats_url, prefix=prefix) as client:
        with pytest.raises(sdk.UnknownModel, match="no worker has ever registered it"):
            await client.infer(b"lost", model="ghost", timeout=30)
        assert await client.infer(b"served", model="m1", timeout=10) == b"served"
