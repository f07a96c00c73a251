"""The classifier sidecar against a real nats-server: routing, batching, errors, crash safety."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
import torch

from jetbatch import sdk
from jetbatch.sdk.protocol import ContentType, Headers, Tensor, header_bytes
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.status import collect_status
from jetbatch.sidecar.streams import ensure_classifier_streams, ensure_model_consumer, ensure_streams
from tests import classifier_fixtures
from tests.helpers import running_classifier, running_worker, wait_until

pytestmark = pytest.mark.anyio

IDENTITY = {"handler": "identity", "max_batch_size": 16, "max_delay_ms": 5}


def config(prefix: str, classifier: dict[str, Any], models: tuple[str, ...] = ("m1", "m2")) -> Config:
    return msgspec.convert(
        {
            "nats": {"prefix": prefix},
            "worker": {"poll_interval_ms": 50},
            "models": {m: IDENTITY for m in models},
            "classifier": {"max_delay_ms": 20, **classifier},
        },
        Config,
    )


async def prepare(cfg: Config, url: str) -> None:
    """Create every stream, so requests can be queued before any sidecar runs."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_classifier_streams(js, cfg.subjects, cfg.streams)
    await ensure_streams(js, cfg.subjects, cfg.streams, cfg.models)
    for m in cfg.models:
        await ensure_model_consumer(js, cfg.subjects, cfg.streams, m)
    await nc.close()


async def test_rules_router_by_header_field_and_default(nats_url: str, prefix: str) -> None:
    rules = [{"header": "X-Tenant", "equals": "acme", "model": "m2"}, {"field": "kind", "equals": "b", "model": "m2"}]
    cfg = config(prefix, {"router": "rules", "rules": rules, "default_model": "m1"})
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            by_header = await client.infer_result({"kind": "a"}, headers={"X-Tenant": "acme"}, timeout=20)
            by_field = await client.infer_result({"kind": "b"}, timeout=20)
            default = await client.infer_result({"kind": "zzz"}, timeout=20)
    assert (by_header.batch.model, by_field.batch.model, default.batch.model) == ("m2", "m2", "m1")
    assert by_field.output == {"kind": "b"}  # the payload reached the model unchanged


async def test_callable_router_and_unknown_label(nats_url: str, prefix: str) -> None:
    cfg = config(prefix, {"router": "callable", "callable": "tests.classifier_fixtures:by_payload_key"})
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            a, b = await asyncio.gather(client.infer_result({"kind": "a"}, timeout=20), client.infer_result({"kind": "b"}, timeout=20))
            with pytest.raises(sdk.UnknownModel, match="gave no model"):
                await client.infer({"kind": "c"}, timeout=20)
            dlq = await client.nats.jetstream().get_last_msg(cfg.subjects.dead_letter_stream, cfg.subjects.dead_letter("classifier"))
    assert (a.batch.model, b.batch.model) == ("m1", "m2")
    assert dlq.headers[Headers.DLQ_REASON] == "the router gave no model"
    assert msgspec.msgpack.decode(dlq.data) == {"kind": "c"}


async def test_label_for_a_model_nobody_serves_is_unknown_model(nats_url: str, prefix: str) -> None:
    rules = [{"field": "kind", "equals": "x", "model": "ghost"}]
    cfg = config(prefix, {"router": "rules", "rules": rules, "default_model": "m1"})
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url) as classifier:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            with pytest.raises(sdk.UnknownModel, match="ghost"):
                await client.infer({"kind": "x"}, timeout=20)
            assert await client.infer({"kind": "y"}, timeout=20) == {"kind": "y"}
    assert classifier.stats["errors"] == 1


async def test_torch_router_classifies_a_batch_in_one_forward_pass(nats_url: str, prefix: str) -> None:
    cfg = config(
        prefix,
        {"router": "torch", "handler": "tests.classifier_fixtures:CountingNet", "labels": {"0": "m1", "1": "m2"}, "max_batch_size": 32, "max_delay_ms": 200},
    )
    await prepare(cfg, nats_url)
    classifier_fixtures.BATCH_SIZES.clear()
    xs = [torch.tensor([1.0 if i % 3 else -1.0, 0.0]) for i in range(12)]
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        calls = [asyncio.ensure_future(client.infer_result(Tensor.from_torch(x), timeout=30)) for x in xs]
        js = client.nats.jetstream()
        await wait_until(lambda: _stream_count(js, cfg.subjects.ingress_stream, 12), what="12 queued requests")
        async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url):
            results = await asyncio.gather(*calls)
    assert classifier_fixtures.BATCH_SIZES == [12]  # all twelve in one forward pass
    assert [r.batch.model for r in results] == ["m2" if i % 3 else "m1" for i in range(12)]


async def _stream_count(js: Any, stream: str, n: int) -> bool:
    return bool((await js.stream_info(stream)).state.messages >= n)


async def test_example_router_routes_example_inputs(nats_url: str, prefix: str, tmp_path: Path) -> None:
    from jetbatch.sidecar.dev.example_models import EXAMPLE_MODELS, build_examples, sample_inputs

    ex = build_examples(tmp_path)
    labels = {str(i): name for i, name in enumerate(EXAMPLE_MODELS)}
    cfg = config(prefix, {"router": "torch", "path": str(ex.directory / "router.pt2"), "labels": labels}, models=tuple(EXAMPLE_MODELS))
    x, truth = sample_inputs(30, seed=21)
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            results = await asyncio.gather(*(client.infer_result(Tensor.from_torch(row), timeout=30) for row in x))
    assert [r.batch.model for r in results] == truth


async def test_garbled_payload_bad_request_and_producer_choice_skips_classification(nats_url: str, prefix: str) -> None:
    cfg = config(prefix, {"router": "torch", "handler": "tests.classifier_fixtures:CountingNet", "labels": {"0": "m1", "1": "m2"}})
    classifier_fixtures.BATCH_SIZES.clear()
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url) as classifier:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            with pytest.raises(sdk.BadRequest):
                await client.infer(b"\x93garbage", content_type=ContentType.TENSOR, timeout=20)
            # The model named by the producer on jetbatch.in: routed without a forward pass.
            direct = await client.infer_result(b"raw", headers={Headers.MODEL: "m2"}, timeout=20)
            good = await client.infer_result(Tensor.from_torch(torch.tensor([-3.0, 1.0])), timeout=20)
    assert direct.batch.model == "m2" and direct.output == b"raw"
    assert good.batch.model == "m1"
    assert classifier_fixtures.BATCH_SIZES == [1]
    assert classifier.stats["direct"] == 1


async def test_lone_requests_share_one_waiting_pull_request_through_the_classifier(nats_url: str, prefix: str) -> None:
    """The classifier's first wait of a batch asks for the whole batch on one request left open a
    window past the wait (``Puller.fetch(hold_open_s=)``): the window it opens fills from it, and
    the next batch's wait sends none while it is open. Lone requests one after another once
    cost three pull requests each (what is stored, the first arrival, the window's fill) and two
    status messages; now one request serves several of them."""
    cfg = config(prefix, {"router": "rules", "default_model": "m1"})
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url) as classifier:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"warm", timeout=20) == b"warm"
            before = classifier.pull_counts()
            n = 6
            for i in range(n):
                assert await client.infer(f"r{i}".encode(), timeout=20) == f"r{i}".encode()
            after = classifier.pull_counts()
            reported = await collect_status(client.nats, cfg.subjects, wait_s=0.5)
    pulls, ends = (after[k] - before[k] for k in ("pull_requests", "pull_ends"))
    # A request open 0.27 s (the idle wait and a window) serves every request that comes within it.
    assert pulls < n and ends < n, (pulls, ends)
    assert any(r.role == "classifier" and r.stats["pull_requests"] >= pulls for r in reported)  # in its status report too


async def test_two_replicas_split_the_work(nats_url: str, prefix: str) -> None:
    cfg = config(prefix, {"router": "callable", "callable": "tests.classifier_fixtures:slow_to_m1", "max_batch_size": 2, "max_delay_ms": 1})
    async with running_worker(cfg, nats_url):
        async with running_classifier(cfg, nats_url) as one, running_classifier(cfg, nats_url) as two:
            async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                results = await asyncio.gather(*(client.infer(f"r{i}".encode(), timeout=30) for i in range(60)))
    assert results == [f"r{i}".encode() for i in range(60)]
    assert one.stats["routed"] > 0 and two.stats["routed"] > 0
    assert one.stats["routed"] + two.stats["routed"] == 60


@pytest.mark.parametrize("with_ids", [True, False], ids=["with-ids", "without-ids"])
async def test_crash_between_republish_and_ack_routes_each_request_once(nats_url: str, prefix: str, tmp_path: Path, with_ids: bool) -> None:
    """Without a Nats-Msg-Id of the producer's, the classifier's fallback id comes from the
    ingress message's place in its stream, so the redelivery after the crash is deduplicated too
    (a random fallback id made it a second copy)."""
    cfg_path = tmp_path / "classifier.toml"
    cfg_path.write_text(
        f'[nats]\nprefix = "{prefix}"\n[streams]\nack_wait_s = 1\n'
        '[models.m1]\nhandler = "identity"\n'
        '[classifier]\nrouter = "rules"\ndefault_model = "m1"\nmax_batch_size = 4\nmax_delay_ms = 50\n'
    )
    cfg = config(prefix, {"router": "rules", "default_model": "m1"}, models=("m1",))
    await prepare(cfg, nats_url)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for i in range(10):
            headers = {Headers.MSG_ID: f"req-{i}-{uuid.uuid4().hex[:6]}"} if with_ids else {"X-Request": str(i)}
            await js.publish(cfg.subjects.ingress, f"p{i}".encode(), headers=headers)
        env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_")}
        args = ["classifier", "--config", str(cfg_path), "--nats-url", nats_url, "--http-port", "0"]
        cmd = [sys.executable, "-m", "jetbatch", *args]
        crash = f"from tests.fault_handlers import run_classifier_that_dies_after_its_first_republish as r; r({args!r})"
        crashed = await anyio.run_process([sys.executable, "-c", crash], env=env, check=False)
        assert crashed.returncode == 137  # died after a republish, before acking it
        assert (await js.stream_info(cfg.subjects.models_stream)).state.messages >= 1
        with anyio.fail_after(60):
            async with await anyio.open_process(cmd, env=env) as proc:
                try:
                    await wait_until(lambda: _stream_count(js, cfg.subjects.models_stream, 10), timeout_s=30, what="10 routed")
                    await wait_until(lambda: _empty(js, cfg.subjects.ingress_stream), timeout_s=30, what="ingress drained")
                finally:
                    proc.terminate()
        info = await js.stream_info(cfg.subjects.models_stream)
    finally:
        await nc.close()  # on a failed assertion too: left open, it failed the next test
    assert info.state.messages == 10  # each request reached its model queue exactly once


async def _empty(js: Any, stream: str) -> bool:
    return (await js.stream_info(stream)).state.messages == 0


async def test_a_full_model_queue_is_overloaded_for_the_caller_and_the_classifier_keeps_routing(nats_url: str, prefix: str) -> None:
    """The bulk republish's refusal (JetStream error 10077 in a PubAck) goes through the careful
    path to a typed answer: the caller gets Overloaded, not a timeout, and nothing is lost."""
    cfg = config(prefix, {"router": "rules", "default_model": "m1"})
    cfg = msgspec.structs.replace(cfg, streams=msgspec.structs.replace(cfg.streams, max_msgs=2))
    await prepare(cfg, nats_url)  # the model queues exist, and no worker drains them
    async with running_classifier(cfg, nats_url) as classifier:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            parked = [asyncio.ensure_future(client.infer({"n": i}, timeout=30)) for i in range(2)]
            js = client.nats.jetstream()

            async def queue_full() -> bool:
                return (await js.stream_info(client.subjects.models_stream)).state.messages >= 2

            await wait_until(queue_full, timeout_s=15, what="two requests in the model queue")
            with pytest.raises(sdk.Overloaded, match="m1"):
                await client.infer({"n": 2}, timeout=20)
            # The answer reaches the caller before the store's PubAck, and the count follows it.
            await wait_until(lambda: classifier.stats["errors"] == 1, timeout_s=10, what="the refusal counted")
            assert classifier.stats["routed"] == 2
            for task in parked:
                task.cancel()


async def test_the_classifier_keeps_a_request_priority(nats_url: str, prefix: str) -> None:
    """A batch-class request through the classifier lands on its model's batch line (and is
    answered); a forged priority value is refused as bad_request, never routed."""
    cfg = config(prefix, {"router": "rules", "rules": [], "default_model": "m1"})
    await prepare(cfg, nats_url)
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        js = client.nats.jetstream()
        sent = asyncio.ensure_future(client.infer_result({"kind": "a"}, timeout=20, priority="batch"))
        async with running_classifier(cfg, nats_url):

            async def on_batch_line() -> bool:
                info = await js.stream_info(cfg.subjects.models_stream, subjects_filter=cfg.subjects.models_wildcard)
                return (info.state.subjects or {}).get(cfg.subjects.model("m1", "batch"), 0) == 1

            await wait_until(on_batch_line, timeout_s=10, what="the request on m1's batch line")
            # A raw NATS caller's forged class: refused with a typed answer, never routed.
            inbox = f"_INBOX.{uuid.uuid4().hex}"
            replies = await client.nats.subscribe(inbox, max_msgs=1)
            forged = {Headers.PRIORITY: "urgent", Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: inbox}
            await js.publish(cfg.subjects.ingress, msgspec.msgpack.encode({"kind": "a"}), headers=forged)
            reply = await replies.next_msg(timeout=10)
            assert reply.headers[Headers.ERROR_CODE] == "bad_request"
            assert "Jetbatch-Priority" in msgspec.json.decode(reply.data)["message"]
            async with running_worker(cfg, nats_url):
                result = await sent
    assert result.batch.model == "m1" and result.output == {"kind": "a"}


async def test_two_tenants_may_choose_the_same_request_id(nats_url: str, prefix: str) -> None:
    """JetStream dedupes on Nats-Msg-Id across a stream: a tenant's ids carry its name there, so
    tenant b's request under a's id is its own request, answered with its own payload (it used
    to be taken for a retry of a's, and time out)."""
    cfg = config(prefix, {"router": "rules", "rules": [], "default_model": "m1"})
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix, tenant="a") as a, sdk.Client.connect(nats_url, prefix=prefix, tenant="b") as b:
            first = await a.infer({"from": "a"}, timeout=20, request_id="same-1")
            second = await b.infer({"from": "b"}, timeout=20, request_id="same-1")
            again = await a.infer({"from": "a, again"}, timeout=20, request_id="same-1")  # a's retry: a's answer
            js = a.nats.jetstream()
            stored = {t: await js.get_msg(cfg.subjects.results_stream, subject=cfg.subjects.answer_anywhere("same-1", t), direct=True) for t in "ab"}
    assert (first, second, again) == ({"from": "a"}, {"from": "b"}, {"from": "a"})
    assert all(m.headers[Headers.STATUS] == "ok" for m in stored.values())


async def test_a_tenants_request_at_the_ingress_limit_still_fits_its_model_queue_once_routed(nats_url: str, prefix: str) -> None:
    """The classifier adds the tenant and a tenant-scoped dedupe id to what it republishes: a
    tenant's request exactly at the ingress's max message size used to be refused by the model
    queue as too large (``bad_request``). The models stream leaves room for what routing adds."""
    cfg = config(prefix, {"router": "rules", "rules": [], "default_model": "m1"})
    cfg = msgspec.structs.replace(cfg, streams=msgspec.structs.replace(cfg.streams, max_msg_size=4096))
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            limit = (await js.stream_info(cfg.subjects.ingress_stream)).config.max_msg_size
            answers: asyncio.Queue[Any] = asyncio.Queue()
            await nc.subscribe(cfg.subjects.answers("k", "app1"), cb=answers.put)
            headers = {Headers.MSG_ID: "app1.big-1", Headers.REPLY_KEY: "k"}
            body = b"a" * (limit - header_bytes(headers))
            assert header_bytes(headers) + len(body) == limit
            await js.publish(cfg.subjects.tenant_ingress("app1"), body, headers=headers, timeout=10)
            with anyio.fail_after(20):
                answer = await answers.get()
        finally:
            await nc.close()
    assert answer.headers[Headers.STATUS] == "ok", answer.headers
    assert answer.data == body


async def test_an_ingress_whose_tenant_is_the_no_tenant_token_is_refused_never_served_untenanted(nats_url: str, prefix: str) -> None:
    """``_`` stands for "no tenant" in answer subjects: a request on ``<prefix>.in._`` would
    otherwise be answered where untenanted callers' answers live. It gets ``bad_request``, and
    the SDK refuses ``tenant="_"`` before connecting."""
    cfg = config(prefix, {"router": "rules", "rules": [], "default_model": "m1"})
    async with running_worker(cfg, nats_url), running_classifier(cfg, nats_url):
        nc = await nats.connect(nats_url)
        try:
            answers = await nc.subscribe(cfg.subjects.answers("k1"), max_msgs=1)
            headers = {Headers.MSG_ID: "r-no-tenant", Headers.REPLY_KEY: "k1", Headers.CONTENT_TYPE: "application/json"}
            await nc.jetstream().publish(f"{prefix}.in._", b"{}", headers=headers)
            answer = await answers.next_msg(timeout=10)
        finally:
            await nc.close()
    assert answer.subject == cfg.subjects.answer("r-no-tenant", "k1")
    assert answer.headers[Headers.ERROR_CODE] == "bad_request"
    assert "names no valid tenant" in msgspec.json.decode(answer.data)["message"]
    with pytest.raises(sdk.BadRequest, match="reserved"):
        await sdk.Client.connect(nats_url, prefix=prefix, tenant="_")
