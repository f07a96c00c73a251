"""Tenants' quotas and fair shares in the classifier, against a real nats-server: a quota answers
Overloaded at admission, naming the tenant's limit, before anything reaches a model queue; a
tenant over its share lands on the model's batch line while the other keeps the interactive one;
and the real worker's adverts feed the classifier the service rate its shares are taken of."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from jetbatch import sdk
from jetbatch.sidecar.config import Config
from tests.helpers import running_classifier, running_worker, wait_until
from tests.test_classifier import IDENTITY, prepare

pytestmark = pytest.mark.anyio


def config(prefix: str, tenants: dict[str, Any]) -> Config:
    return msgspec.convert(
        {
            "nats": {"prefix": prefix},
            "worker": {"poll_interval_ms": 50},
            "models": {"m1": IDENTITY},
            "classifier": {"max_delay_ms": 5, "router": "rules", "default_model": "m1"},
            "tenants": tenants,
        },
        Config,
    )


async def _lines(js: Any, cfg: Config) -> dict[str, int]:
    info = await js.stream_info(cfg.subjects.models_stream, subjects_filter=cfg.subjects.models_wildcard)
    return dict(info.state.subjects or {})


async def test_a_rate_quota_is_overloaded_at_admission_and_names_the_limit(nats_url: str, prefix: str) -> None:
    cfg = config(prefix, {"max_rps": {"a": 2.0}})
    await prepare(cfg, nats_url)  # no worker: whatever is admitted stays in the model queue
    async with running_classifier(cfg, nats_url) as classifier:
        async with sdk.Client.connect(nats_url, prefix=prefix, tenant="a") as a, sdk.Client.connect(nats_url, prefix=prefix, tenant="b") as b:
            sent_a = [asyncio.ensure_future(a.infer({"n": i}, timeout=20)) for i in range(8)]
            sent_b = [asyncio.ensure_future(b.infer({"n": i}, timeout=20)) for i in range(4)]
            js = a.nats.jetstream()

            async def settled() -> bool:
                refused = sum(1 for t in sent_a if t.done())
                return refused >= 5 and sum((await _lines(js, cfg)).values()) >= 4 + (8 - refused)

            await wait_until(settled, timeout_s=15, what="a's refusals and every admitted request stored")
            refusals = [t.exception() for t in sent_a if t.done()]
            # A burst of 2 (a second of its rate) admitted within the burst's few milliseconds; more
            # only as time passes. Every refusal is typed and says whose limit it was.
            assert 5 <= len(refusals) <= 6
            assert all(isinstance(e, sdk.Overloaded) and "tenant 'a'" in str(e) and "2 requests/s" in str(e) for e in refusals)
            assert not any(t.done() for t in sent_b)  # b has no quota: all four wait in the queue
            assert classifier.shares.refused == {"a": len(refusals)}
            for t in sent_a + sent_b:
                t.cancel()


async def test_a_waiting_quota_counts_what_was_admitted_until_a_worker_advert_counts_it(nats_url: str, prefix: str) -> None:
    cfg = config(prefix, {"max_waiting": {"a": 3}})
    await prepare(cfg, nats_url)  # no worker, no advert: the classifier counts its own admissions
    async with running_classifier(cfg, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix, tenant="a") as a:
            sent = [asyncio.ensure_future(a.infer({"n": i}, timeout=20)) for i in range(6)]
            js = a.nats.jetstream()

            async def settled() -> bool:
                return sum(1 for t in sent if t.done()) == 3 and sum((await _lines(js, cfg)).values()) == 3

            await wait_until(settled, timeout_s=15, what="three stored and three refused")
            refusals = [t.exception() for t in sent if t.done()]
            assert all(isinstance(e, sdk.Overloaded) and "its quota is 3" in str(e) for e in refusals)
            for t in sent:
                t.cancel()


async def test_a_tenant_over_its_share_lands_on_the_batch_line_and_the_other_keeps_its_own(nats_url: str, prefix: str) -> None:
    cfg = config(prefix, {"credit_s": 0.01})
    await prepare(cfg, nats_url)
    async with running_classifier(cfg, nats_url) as classifier:
        # What the adverts would have said: the workers serve 10 requests/s while a sends far
        # more and b a little (by state, at the classifier's clock, so the window is this one).
        now = time.time()
        shares = classifier.shares
        shares.served(100, now - 1.0)
        for k in range(2000):
            shares.admit("a", now - 1.0 + k * 0.0005)
        for k in range(20):
            shares.admit("b", now - 1.0 + k * 0.05)
        shares.admit("b", now + 0.3)  # a recompute past the last: a is shaped from here
        assert "a" in shares.fair_rps() and "b" not in shares.fair_rps()
        async with sdk.Client.connect(nats_url, prefix=prefix, tenant="a") as a, sdk.Client.connect(nats_url, prefix=prefix, tenant="b") as b:
            tasks = [asyncio.ensure_future(a.infer({"n": i}, timeout=20)) for i in range(10)]
            tasks += [asyncio.ensure_future(b.infer({"n": i}, timeout=20)) for i in range(3)]
            js = a.nats.jetstream()

            async def stored() -> bool:
                return sum((await _lines(js, cfg)).values()) >= 13

            await wait_until(stored, timeout_s=15, what="all 13 requests stored")
            lines = await _lines(js, cfg)
            # b's three on the interactive line; a's beyond its one token on the batch line.
            assert lines.get(cfg.subjects.model("m1", "batch"), 0) >= 9
            assert lines.get(cfg.subjects.model("m1"), 0) <= 4
            assert shares.demoted.get("a", 0) >= 9 and "b" not in shares.demoted
            for t in tasks:
                t.cancel()


async def test_the_workers_adverts_tell_the_classifier_what_they_served(nats_url: str, prefix: str) -> None:
    cfg = config(prefix, {})
    cfg = msgspec.structs.replace(cfg, worker=msgspec.structs.replace(cfg.worker, heartbeat_s=0.2))
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url) as classifier:
        async with sdk.Client.connect(nats_url, prefix=prefix, tenant="a") as a:
            for i in range(20):
                assert await a.infer({"n": i}, timeout=20) == {"n": i}
            # The next adverts carry the worker's count of requests served: the service rate rises.
            await wait_until(lambda: classifier.shares._service.value > 0, timeout_s=10, what="service seen in the adverts")
