"""Bad input from the wire: every garbled message gets a typed answer (or, with no usable
reply-to, none), nothing crashes or hangs, and the worker serves the next good request."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any, Iterator

import anyio
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jetbatch import sdk
from jetbatch.sdk.protocol import ContentType, Headers
from tests.helpers import make_config, running_worker, sleep_model

VALID_CODES = {"bad_request", "deadline_exceeded"}


@pytest.fixture(scope="module")
def worker_prefix(nats_server: Any) -> Iterator[str]:
    """A worker on its own thread and event loop for the whole module (hypothesis drives sync tests)."""
    prefix = f"bad{uuid.uuid4().hex[:8]}"
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=1, options={"load_cost_s": 0, "batch_cost_s": 0, "item_cost_s": 0})})
    ready, done = threading.Event(), threading.Event()

    async def serve() -> None:
        async with running_worker(config, nats_server.url):
            ready.set()
            await anyio.to_thread.run_sync(done.wait)

    thread = threading.Thread(target=lambda: anyio.run(serve), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield prefix
    done.set()
    thread.join(30)


async def _raw(url: str, prefix: str, payload: bytes, headers: dict[str, str], *, expect_reply: bool = True) -> Any:
    nc = await nats.connect(url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        hdrs = {Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: inbox, **headers}
        await nc.jetstream().publish(f"{prefix}.model.m1", payload, headers={k: v for k, v in hdrs.items() if v is not None})
        if not expect_reply:
            return None
        return await sub.next_msg(timeout=10)
    finally:
        await nc.close()


def _still_serving(url: str, prefix: str) -> None:
    async def check() -> None:
        async with sdk.Client.connect(url, prefix=prefix) as client:
            assert await client.infer(b"good", model="m1", timeout=10) == b"good"

    asyncio.run(check())


header_text = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    payload=st.binary(max_size=300),
    content_type=st.sampled_from([c.value for c in ContentType] + ["text/plain", "", "application/json; charset=utf-8"]),
    deadline=st.one_of(st.none(), header_text, st.integers(-(10**15), 10**15).map(str)),
)
def test_random_payloads_and_headers_get_typed_answers(worker_prefix: str, nats_server: Any, payload: bytes, content_type: str, deadline: str | None) -> None:
    headers = {Headers.CONTENT_TYPE: content_type or None, Headers.DEADLINE: deadline.strip() if deadline else None}
    reply = asyncio.run(_raw(nats_server.url, worker_prefix, payload, headers))
    status = reply.headers.get(Headers.STATUS)
    assert status in ("ok", "error")
    if status == "error":
        body = sdk.protocol.decode_error(reply.data)
        assert body.code in VALID_CODES, body
        assert body.message


def test_tensor_shape_and_bytes_disagree_is_bad_request(worker_prefix: str, nats_server: Any) -> None:
    import msgspec

    body = msgspec.msgpack.encode({"dtype": "float32", "shape": [3, 3], "data": b"\x00" * 8})
    reply = asyncio.run(_raw(nats_server.url, worker_prefix, body, {Headers.CONTENT_TYPE: ContentType.TENSOR.value}))
    assert reply.headers[Headers.ERROR_CODE] == "bad_request"
    assert "do not match shape" in sdk.protocol.decode_error(reply.data).message
    _still_serving(nats_server.url, worker_prefix)


def test_reply_to_that_is_invalid_or_missing_or_points_nowhere(worker_prefix: str, nats_server: Any) -> None:
    url = nats_server.url
    asyncio.run(_raw(url, worker_prefix, b"x", {Headers.REPLY_TO: "bad.*.subject"}, expect_reply=False))
    asyncio.run(_raw(url, worker_prefix, b"x", {Headers.REPLY_TO: None}, expect_reply=False))
    asyncio.run(_raw(url, worker_prefix, b"x", {Headers.REPLY_TO: "nobody.listens.here"}, expect_reply=False))
    _still_serving(url, worker_prefix)


def test_past_deadline_is_deadline_exceeded(worker_prefix: str, nats_server: Any) -> None:
    reply = asyncio.run(_raw(nats_server.url, worker_prefix, b"late", {Headers.DEADLINE: "1000"}))
    assert reply.headers[Headers.ERROR_CODE] == "deadline_exceeded"
