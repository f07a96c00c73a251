"""Backpressure before the caller's deadline: at an overload every caller hears back (its answer,
Overloaded or DeadlineExceeded) before its own timeout, at the default settings
(sdk/jetbatch/sdk/admission.py, docs/reliability.md)."""

from __future__ import annotations

import collections

import anyio
import msgspec
import pytest

from jetbatch import sdk
from jetbatch.sdk.admission import Admission, ModelLoad, wait_estimate_s
from jetbatch.sdk.protocol import SidecarReport
from tests.helpers import make_config, running_classifier, running_worker, sleep_model, wait_until

pytestmark = pytest.mark.timeout(120)

# A slow model: batches of 4 that take 0.2 s each, 20 requests/s at most.
SLOW = sleep_model(max_batch_size=4, max_delay_ms=10, batch_cost_s=0.2, item_cost_s=0.0,
                   options={"load_cost_s": 0.0, "batch_cost_s": 0.2, "item_cost_s": 0.0})  # fmt: skip


def _advert(worker: str, **fields: object) -> bytes:
    return msgspec.json.encode(SidecarReport(role="worker", id=worker, valid_s=5.0, **fields))  # type: ignore[arg-type]


def test_wait_estimate_counts_what_is_ahead_less_what_was_drained() -> None:
    load = ModelLoad(waiting=30, in_flight=10, drain_rps=20.0, heard_at=100.0)
    assert wait_estimate_s(load, 0, 100.0) == 2.0
    assert wait_estimate_s(load, 20, 100.0) == 3.0  # what we sent since the advert is ahead too
    assert wait_estimate_s(load, 0, 101.0) == 1.0  # a second of draining since
    assert wait_estimate_s(load, 0, 200.0) == 0.0  # never below nothing
    assert wait_estimate_s(ModelLoad(5, 0, 0.0, 0.0), 0, 0.0) == float("inf")


def test_admission_refuses_what_its_workers_cannot_reach_in_time() -> None:
    adm = Admission()
    assert adm.refusal("m1", 1.0, now=0.0) is None  # no advert: admitted
    adm.on_advert("w1", _advert("w1", backlog={"m1": 10}, drain_rps={"m1": 20.0}), False, now=0.0)
    adm.on_advert("w2", _advert("w2", backlog={"m1": 12}, in_flight={"m1": 4}, drain_rps={"m1": 20.0}), False, now=0.0)
    # 16 ahead at 40/s: 0.4 s, within half of 1 s; the 5th request admitted finds 0.5 s ahead
    for _ in range(5):
        assert adm.refusal("m1", 1.0, now=0.0) is None
    refused = adm.refusal("m1", 1.0, now=0.0)
    assert refused is not None and "m1" in refused
    assert adm.refusal("m1", 10.0, now=0.0) is None  # a longer timeout fits
    adm.on_advert("w1", b"", True, now=0.1)
    adm.on_advert("w2", b"", True, now=0.1)
    assert adm.refusal("m1", 0.01, now=0.1) is None  # withdrawn: no view, admitted
    adm.on_advert("claim.m1", b"{}", False, now=0.1)  # a load claim is no advert
    adm.on_advert("w3", b"not json", False, now=0.1)
    assert adm.refusal("m1", 0.01, now=0.1) is None


def test_a_fresh_advert_replaces_the_local_count_and_silent_ones_are_forgotten() -> None:
    adm = Admission()
    adm.on_advert("w1", _advert("w1", backlog={"m1": 0}, drain_rps={"m1": 10.0}), False, now=0.0)
    for _ in range(6):  # the 6th finds 5 ahead at 10/s: 0.5 s, half of its 1 s
        assert adm.refusal("m1", 1.0, now=0.0) is None
    assert adm.refusal("m1", 1.0, now=0.0) is not None
    adm.on_advert("w1", _advert("w1", backlog={"m1": 0}, drain_rps={"m1": 10.0}), False, now=1.0)
    assert adm.refusal("m1", 1.0, now=1.0) is None  # the advert says they were drained
    adm.on_advert("w1", _advert("w1", backlog={"m1": 1000}, drain_rps={"m1": 10.0}), False, now=2.0)
    assert adm.refusal("m1", 1.0, now=2.0) is not None
    assert adm.refusal("m1", 1.0, now=20.0) is None  # its worker went silent: no view


async def _outcomes(client: sdk.Client, model: str | None, n: int, rate: float, timeout_s: float) -> collections.Counter[str]:
    """``n`` calls sent at ``rate`` per second (open loop), each counted by how it ended."""
    counts: collections.Counter[str] = collections.Counter()

    async def one(i: int) -> None:
        try:
            await client.infer(f"r{i}".encode(), model=model, timeout=timeout_s)
            counts["ok"] += 1
        except sdk.JetbatchError as exc:
            counts[type(exc).__name__] += 1

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
            await anyio.sleep(1 / rate)
    return counts


async def _view_has_drain(client: sdk.Client, model: str) -> bool:
    load = client._admission._loads.get(model) if client._admission is not None else None  # noqa: SLF001
    return load is not None and load.drain_rps > 0


@pytest.mark.anyio
async def test_ten_times_capacity_at_the_defaults_gets_answers_or_overloaded_never_a_timeout(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": SLOW})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            await wait_until(lambda: _view_has_drain(client, "m1"), timeout_s=10, what="an advert of m1's drain rate")
            counts = await _outcomes(client, "m1", n=600, rate=200.0, timeout_s=1.0)
    assert counts["RequestTimeout"] == 0, counts
    assert counts["Overloaded"] > 0 and counts["ok"] > 0, counts
    assert set(counts) <= {"ok", "Overloaded", "DeadlineExceeded"}, counts


@pytest.mark.anyio
async def test_the_classifier_refuses_what_the_models_workers_cannot_reach_in_time(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": SLOW}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url), running_classifier(config, nats_url) as classifier:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            await wait_until(lambda: classifier.admission.known("m1"), timeout_s=10, what="the classifier's view of m1")
            counts = await _outcomes(client, None, n=600, rate=200.0, timeout_s=1.5)
    assert counts["RequestTimeout"] == 0, counts
    assert counts["Overloaded"] > 0 and counts["ok"] > 0, counts
    assert set(counts) <= {"ok", "Overloaded", "DeadlineExceeded"}, counts
