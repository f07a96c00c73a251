"""Backpressure before the caller's deadline: at an overload every caller hears back (its answer,
Overloaded or DeadlineExceeded) before its own timeout, at the default settings
(sdk/jetbatch/sdk/admission.py, docs/reliability.md)."""

from __future__ import annotations

import collections
import contextlib
import time

import anyio
import msgspec
import pytest

from jetbatch import sdk
from jetbatch.sdk.admission import Admission, ModelLoad, wait_estimate_s
from jetbatch.sdk.protocol import SidecarReport, Subjects
from jetbatch.sidecar.worker.counters import Counters
from jetbatch.sidecar.worker.late_arrivals import LateArrivals
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


def test_the_worker_refuses_an_arrival_its_queue_cannot_reach_in_time_and_screens_only_what_it_can_answer() -> None:
    """The worker's screen (worker/late_arrivals.py) counts every arrival it lets wait ahead of
    the next, leaves its own batch's time out of the wait allowed, and leaves unscreened what it
    could not answer (no reply key) or what has no deadline."""
    late = LateArrivals(None, Subjects("t"), Counters(), batch_size=lambda name: 2)
    late.admission.on_advert("w1", _advert("w1", backlog={"m1": 0}, drain_rps={"m1": 10.0}), False)

    def headers(i: int, remaining_s: float, **extra: str) -> dict[str, str]:
        deadline_ms = int((time.time() + remaining_s) * 1000)
        return {"Nats-Msg-Id": f"r{i}", "Jetbatch-Reply-Key": "k1", "Jetbatch-Deadline": str(deadline_ms), **extra}

    # 1 s left, less its own batch (2 at 10/s: 0.2 s), 0.7 of that: 0.56 s of wait, 5 ahead at 10/s.
    verdicts = [late.refusal("m1", headers(i, 1.0)) for i in range(10)]
    assert [v is None for v in verdicts] == [True] * 6 + [False] * 4
    refused = verdicts[-1]
    assert refused is not None and refused.error is not None and refused.error.value == "overloaded"
    assert refused.meta.request_id == "r9" and refused.meta.reply_key == "k1"
    # A fresh advert from a worker that counts its line by its last fetch (none of these seen
    # yet) does not make the screen forget what it admitted.
    late.admission.on_advert("w1", _advert("w1", backlog={"m1": 0}, drain_rps={"m1": 10.0}), False)
    assert late.refusal("m1", headers(10, 1.0)) is not None
    assert late.refusal("m1", {"Nats-Msg-Id": "x", "Jetbatch-Deadline": headers(0, 1.0)["Jetbatch-Deadline"]}) is None  # no reply key
    assert late.refusal("m1", {"Nats-Msg-Id": "y", "Jetbatch-Reply-Key": "k1"}) is None  # no deadline
    assert late.refusal("m1", headers(11, 30.0)) is None  # a long deadline waits
    assert late.refusal("m2", headers(12, 0.1)) is None  # no advert of m2: nothing to go by
    # Its own batch alone (0.2 s) outlasts the 0.1 s left: no queue makes it late, so it is no
    # overload; the deadline check before compute answers it deadline_exceeded.
    assert late.refusal("m1", headers(13, 0.1)) is None


async def _outcomes(client: sdk.Client, model: str | None, n: int, rate: float, timeout_s: float) -> collections.Counter[str]:
    """``n`` calls sent at ``rate`` per second (open loop), each counted by how it ended."""
    return await _outcomes_of_many([client], model, n=n, rate=rate, timeout_s=timeout_s)


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


async def _outcomes_of_many(clients: list[sdk.Client], model: str | None, n: int, rate: float, timeout_s: float) -> collections.Counter[str]:
    """``n`` calls at ``rate`` per second spread over independent ``clients`` (open loop)."""
    counts: collections.Counter[str] = collections.Counter()

    async def one(i: int) -> None:
        try:
            await clients[i % len(clients)].infer(f"r{i}".encode(), model=model, timeout=timeout_s)
            counts["ok"] += 1
        except sdk.JetbatchError as exc:
            counts[type(exc).__name__] += 1

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
            await anyio.sleep(1 / rate)
    return counts


@pytest.mark.anyio
async def test_eight_independent_clients_at_ten_times_capacity_never_time_out(nats_url: str, prefix: str) -> None:
    """Each client counts only its own requests between two adverts, so eight of them together
    queued past what the worker reaches in time (224 of 8000 timed out in the overload bench);
    the worker, which sees every arrival, refuses the excess at arrival."""
    config = make_config(prefix, {"m1": SLOW})
    async with running_worker(config, nats_url) as worker, contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(sdk.Client.connect(nats_url, prefix=prefix)) for _ in range(8)]
        await clients[0].infer(b"warm", model="m1", timeout=10)
        for c in clients:
            await wait_until(lambda c=c: _view_has_drain(c, "m1"), timeout_s=10, what="an advert of m1's drain rate")
        await wait_until(lambda: worker.arrivals.late.admission.known("m1"), timeout_s=10, what="the worker's view of m1")
        counts = await _outcomes_of_many(clients, "m1", n=800, rate=200.0, timeout_s=1.0)
        refused = worker.stats["arrivals_refused"]
    assert counts["RequestTimeout"] == 0, counts
    assert refused > 0, "the worker refused none: the clients' own admission did all"
    assert counts["Overloaded"] > 0 and counts["ok"] > 0, counts
    assert set(counts) <= {"ok", "Overloaded", "DeadlineExceeded"}, counts
