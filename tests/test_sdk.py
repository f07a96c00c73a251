"""The SDK on its own: imports without torch, typed errors, blocking client, duplicate replies."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetbatch import sdk
from tests.helpers import make_config, running_classifier, running_worker, sleep_model, wait_until

NO_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch.") or name == "jetbatch.sidecar" or name.startswith("jetbatch.sidecar."):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    from jetbatch import sdk
    from jetbatch.sdk import Client, BlockingClient, JetbatchError, Tensor
    assert "torch" not in sys.modules and "jetbatch.sidecar" not in sys.modules
    data, ctype = sdk.protocol.encode_payload({"a": 1})
    print("ok", ctype.value)
    """
)


def test_sdk_imports_and_works_without_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok application/msgpack"


def test_public_api_matches_all() -> None:
    exported = {name for name in dir(sdk) if not name.startswith("_")} - {
        "admission", "blocking", "client", "connection", "errors", "failures", "protocol", "publishing", "registry", "telemetry", "timeouts", "validation",
    }
    assert exported == set(sdk.__all__)
    for name in sdk.__all__:
        assert getattr(sdk, name) is not None


def test_error_tree() -> None:
    for cls in (sdk.BadRequest, sdk.UnknownModel, sdk.ModelFailed, sdk.Overloaded, sdk.RequestTimeout, sdk.ConnectionFailed, sdk.ClientClosed):
        assert issubclass(cls, sdk.JetbatchError)
    assert issubclass(sdk.RequestTimeout, TimeoutError)
    assert issubclass(sdk.PayloadTooLarge, sdk.BadRequest)


@pytest.mark.anyio
async def test_server_down_is_connection_failed() -> None:
    with pytest.raises(sdk.ConnectionFailed, match="cannot connect to NATS"):
        await sdk.Client.connect("nats://127.0.0.1:1", connect_timeout_s=0.5)


@pytest.mark.anyio
async def test_missing_streams_is_stream_not_found(nats_url: str, prefix: str) -> None:
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        with pytest.raises(sdk.StreamNotFound):
            await client.infer(b"x", model="m1", timeout=5)
        with pytest.raises(sdk.StreamNotFound):
            await client.infer(b"x", timeout=5)


@pytest.mark.anyio
async def test_payload_over_max_payload(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model()}, streams={"max_msg_size": 1024})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            with pytest.raises(sdk.PayloadTooLarge):
                await client.infer(b"x" * 4096, model="m1", timeout=5)  # over the stream's limit
            with pytest.raises(sdk.PayloadTooLarge):
                await client.infer(b"x" * (client.nats.max_payload + 1), model="m1", timeout=5)  # over the server's
            assert await client.infer(b"small", model="m1", timeout=10) == b"small"


@pytest.mark.anyio
async def test_payload_just_under_max_payload_is_refused_with_its_headers_counted(nats_url: str, prefix: str) -> None:
    """The server counts headers against max_payload and closes a connection that sends more:
    the SDK refuses such a request itself, and the connection (and a bystander call) survive."""
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            bystander = asyncio.ensure_future(client.infer(b"bystander", model="m1", timeout=10))
            with pytest.raises(sdk.PayloadTooLarge, match="headers"):
                await client.infer(b"x" * (client.nats.max_payload - 10), model="m1", timeout=5)
            assert await bystander == b"bystander"
            assert await client.infer(b"after", model="m1", timeout=10) == b"after"
            assert client.nats.is_connected


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1, "5", True, 10**9])
async def test_a_bad_timeout_is_bad_request(nats_url: str, prefix: str, timeout: object) -> None:
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        with pytest.raises(sdk.BadRequest, match="timeout"):
            await client.infer(b"x", model="m1", timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_bad_header_names_and_reserved_headers_are_bad_request(nats_url: str, prefix: str) -> None:
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        for headers in ({"bad name": "v"}, {"X-Ok": 5}, {"Jetbatch-Reply-To": "_INBOX.elsewhere"}, {"jetbatch-reply-key": "theirs"}, {"Nats-Msg-Id": "x"}):
            with pytest.raises(sdk.BadRequest):
                await client.infer(b"x", model="m1", timeout=5, headers=headers)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_retrying_a_finished_request_id_returns_its_answer(nats_url: str, prefix: str) -> None:
    """JetStream drops a retry under the same request id as a duplicate (dedupe window); the SDK
    sees the PubAck's duplicate flag and fetches the stored answer, from this client or another."""
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            first = await client.infer_result(b"once", model="m1", timeout=10, request_id="retry-me-1")
            again = await client.infer_result(b"once", model="m1", timeout=10, request_id="retry-me-1")
        async with sdk.Client.connect(nats_url, prefix=prefix) as other:
            third = await other.infer_result(b"once", model="m1", timeout=10, request_id="retry-me-1")
    assert first.output == again.output == third.output == b"once"
    assert again.batch.batch_id == third.batch.batch_id == first.batch.batch_id  # the same computation
    assert worker.stats["requests"] == 1
    assert again.latency_s < 5


def test_blocking_client_after_close_is_client_closed(nats_url: str) -> None:
    client = sdk.BlockingClient.connect(nats_url)
    client.close()
    with pytest.raises(sdk.ClientClosed):
        client.infer(b"x", model="m1", timeout=1)
    client.close()  # closing twice is fine


@pytest.mark.anyio
async def test_full_stream_is_overloaded(nats_url: str, prefix: str) -> None:
    import anyio

    config = make_config(prefix, {"m1": sleep_model()}, streams={"max_msgs": 2})
    # Create the streams with a worker, then stop it so the queue fills up.
    async with running_worker(config, nats_url):
        pass
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(_ignore_timeout, client, f"fill{i}".encode())
            with pytest.raises(sdk.Overloaded, match="full"):
                await _publish_when_full(client)
            tg.cancel_scope.cancel()


async def _ignore_timeout(client: sdk.Client, payload: bytes) -> None:
    try:
        await client.infer(payload, model="m1", timeout=3)
    except sdk.RequestTimeout:
        pass


async def _publish_when_full(client: sdk.Client) -> None:
    await wait_until(lambda: _queued(client.nats.jetstream(), client.subjects.models_stream), timeout_s=10, what="a full queue")
    await client.infer(b"one too many", model="m1", timeout=3)


def test_blocking_client(nats_url: str, prefix: str) -> None:
    import threading

    import anyio

    config = make_config(prefix, {"m1": sleep_model()})
    ready = threading.Event()
    done = threading.Event()

    async def serve() -> None:
        async with running_worker(config, nats_url):
            ready.set()
            await anyio.to_thread.run_sync(done.wait)

    thread = threading.Thread(target=lambda: anyio.run(serve), daemon=True)
    thread.start()
    try:
        assert ready.wait(30)
        with sdk.BlockingClient.connect(nats_url, prefix=prefix) as client:
            assert client.infer([1, 2, 3], model="m1", timeout=10) == [1, 2, 3]
            assert client.infer_many([b"a", b"b"], model="m1", timeout=10) == [b"a", b"b"]
            with pytest.raises(sdk.UnknownModel):
                client.infer(b"x", model="nope", timeout=5)
    finally:
        done.set()
        thread.join(30)


@pytest.mark.anyio
async def test_duplicate_replies_are_dropped(nats_url: str, prefix: str) -> None:
    """A redelivered request can be answered twice; the caller sees one result, and a late
    duplicate for a finished request is ignored."""
    from jetbatch.sdk.protocol import Headers

    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        nc = client.nats
        js = nc.jetstream()
        await js.add_stream(name=f"{prefix.upper()}_IN", subjects=[f"{prefix}.in"])

        async def responder(msg) -> None:  # type: ignore[no-untyped-def]
            reply_to = client.subjects.answer(msg.headers[Headers.MSG_ID], msg.headers[Headers.REPLY_KEY])
            for body in (b"first", b"second"):
                await nc.publish(reply_to, body, headers={Headers.STATUS: "ok", Headers.CONTENT_TYPE: "application/octet-stream"})

        sub = await nc.subscribe(f"{prefix}.in", cb=responder)
        result = await client.infer(b"x", timeout=5)
        await nc.flush()  # the duplicate reaches the inbox: it must be dropped without error
        await sub.unsubscribe()
    assert result == b"first"


@pytest.mark.anyio
async def test_an_unanswered_request_times_out_and_a_cancelled_caller_is_cancelled(nats_url: str, prefix: str) -> None:
    """The reply timer: no answer within ``timeout`` is RequestTimeout; cancelling the caller is a
    cancellation, not a timeout; neither leaves the request registered."""
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        pass  # creates the streams; nobody serves m1 afterwards
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        with pytest.raises(sdk.RequestTimeout, match="no reply within 0.3s"):
            await client.infer(b"nobody home", model="m1", timeout=0.3)
        task = asyncio.ensure_future(client.infer(b"cancel me", model="m1", timeout=30))
        js = client.nats.jetstream()
        await wait_until(lambda: _queued(js, client.subjects.models_stream), timeout_s=10, what="the request in its queue")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client._pending == {}


async def _queued(js: object, stream: str) -> bool:
    info = await js.stream_info(stream)  # type: ignore[attr-defined]
    return info.state.messages >= 2


@pytest.mark.anyio
async def test_a_request_whose_live_reply_never_comes_reads_the_stored_answer(nats_url: str, prefix: str) -> None:
    """An id names one request (docs/protocol.md). A caller's own id is looked up in the results
    store first: a second request under an answered id, sent through the classifier (which would
    drop it as a duplicate, never answered live), returns the id's answer. And a live reply that is
    lost gets read from the store once before RequestTimeout."""
    config = make_config(prefix, {"m1": sleep_model()}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url), running_classifier(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"first", model="m1", request_id="dup-1", timeout=20) == b"first"
            assert await client.infer(b"second", request_id="dup-1", timeout=2) == b"first"
            client._resolve = lambda rid, msg: None  # type: ignore[method-assign]  # every live reply lost
            assert await client.infer(b"lost live", model="m1", timeout=2) == b"lost live"


@pytest.mark.anyio
async def test_after_a_reconnect_the_stored_answer_is_looked_for_until_found(nats_url: str, prefix: str) -> None:
    """A node loss: the live reply went out while the client reconnected, and the results stream
    did not answer the first looks (an election). The client keeps looking, so the caller gets
    the answer in seconds, not at its timeout."""
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        pass  # the streams exist; nobody serves m1 now
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        call = asyncio.ensure_future(client.infer(b"x", model="m1", request_id="lost-live-1", timeout=60))
        await wait_until(lambda: "lost-live-1" in client._pending, timeout_s=10, what="the request published")
        # The answer is stored, and its live delivery is lost (as in a reconnect).
        lost: list[object] = []
        client._on_reply_sync = lost.append  # type: ignore[method-assign]
        js = client.nats.jetstream()
        await js.publish(client.subjects.answer("lost-live-1", client._key), b"stored answer", headers={"Content-Type": "application/octet-stream"})
        await wait_until(lambda: len(lost) == 1, timeout_s=10, what="the live answer lost")
        del client._on_reply_sync
        real = client._stored_answer
        misses = {"n": 0}

        async def electing(rid: str, **kw: bool) -> object:
            if misses["n"] < 3:  # the results stream does not answer the first looks
                misses["n"] += 1
                return None
            return await real(rid, **kw)

        client._stored_answer = electing  # type: ignore[method-assign]
        client.nats.stats["reconnects"] += 1  # what nats-py counts when it reconnects
        with anyio.fail_after(10):
            assert await call == b"stored answer"
        assert misses["n"] == 3


@pytest.mark.anyio
async def test_one_request_id_twice_at_once_is_refused_for_the_second(nats_url: str, prefix: str) -> None:
    """A caller's own id is first looked up in the results store (a retry's answer may be there),
    and a second call with the same id, started during that look-up, passed the in-flight check
    too: one call got the answer, the other waited out its whole timeout. The second is
    ``BadRequest`` now, at once, whatever the order."""
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            calls = [client.infer(b"same", model="m1", timeout=10, request_id="twice-1") for _ in range(2)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert sorted(type(o).__name__ for o in outcomes) == ["BadRequest", "bytes"]
            assert b"same" in outcomes


@pytest.mark.anyio
async def test_closing_a_client_while_callers_are_still_publishing_logs_nothing(nats_url: str, prefix: str) -> None:
    """Found by an attack: `jetbatch bench` interrupted with thousands of requests in flight
    printed "Future exception was never retrieved ... ClientClosed" for each. A caller registers
    its answer's future before it publishes; the client fails that future as it closes, and a
    caller cancelled before it came to wait never reads it. The client marks it read."""
    import gc

    loop = asyncio.get_running_loop()
    logged: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: logged.append(str(context.get("message"))))
    try:
        client = await sdk.Client.connect(nats_url, prefix=prefix)
        answer = loop.create_future()
        client._pending["still-publishing"] = answer  # as _call registers it, before its publish
        await client.close()
        assert answer.done()  # failed with ClientClosed (reading it here would hide what this test looks for)
        del answer
        gc.collect()  # a future's finalizer reports an exception never read, at once
    finally:
        loop.set_exception_handler(previous)
    assert not [m for m in logged if "never retrieved" in m], logged


_KEYS = st.one_of(st.text(max_size=4), st.integers(), st.none(), st.booleans(), st.floats(), st.tuples(st.integers()))
_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=8),
    st.complex_numbers(), st.decimals(allow_nan=False), st.datetimes(), st.builds(object),
)  # fmt: skip
_VALUES = st.recursive(
    _LEAVES,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.tuples(kids, kids), st.dictionaries(_KEYS, kids, max_size=4), st.frozensets(st.integers(), max_size=3)),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None)
@given(_VALUES, st.sampled_from([None, "application/json", "application/msgpack", "text/plain"]))
def test_a_payload_is_encoded_or_refused_with_a_typed_error(value: object, content_type: str | None) -> None:
    """Any nested Python value either encodes or raises ProtocolError (a JetbatchError, which the
    client turns into BadRequest): an integer past 64 bits raised a bare OverflowError."""
    try:
        data, ctype = sdk.protocol.encode_payload(value, content_type)
    except sdk.protocol.ProtocolError as exc:
        assert isinstance(exc, sdk.JetbatchError) and exc.code == "bad_request"
        return
    assert isinstance(data, bytes) and isinstance(ctype, sdk.ContentType)


def test_payloads_that_contain_themselves_or_nest_too_deep_are_typed() -> None:
    cycle: list[object] = []
    cycle.append(cycle)
    deep: list[object] = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    for value in (cycle, deep, {"x": 2**64}, [-(2**63) - 1]):
        with pytest.raises(sdk.protocol.ProtocolError):
            sdk.protocol.encode_payload(value)


@pytest.mark.anyio
async def test_an_unencodable_payload_is_bad_request_from_the_client(nats_url: str, prefix: str) -> None:
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        with pytest.raises(sdk.BadRequest, match="OverflowError"):
            await client.infer({"x": 2**64}, model="m1", timeout=5)
        with pytest.raises(sdk.BadRequest, match="content type"):
            await client.infer({"x": 1}, model="m1", timeout=5, content_type="text/plain")


@pytest.mark.anyio
async def test_a_fresh_request_id_already_taken_is_bad_request_at_once(nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another publisher took the id the SDK made for a call (a squatter): JetStream's PubAck says
    duplicate on the first publish. That call took the squatter's answer for its own (here
    b"squat", the echo of the squatter's body), or waited out its whole timeout when none came
    (RequestTimeout); it is BadRequest now, at once. A caller's own id keeps the retry semantics
    (the duplicate is its earlier attempt's: covered above)."""
    import nats

    import jetbatch.sdk.client as client_module

    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            # No reply key: whatever the worker makes of it, no caller hears of it.
            await js.publish(f"{prefix}.model.m1", b"squat", headers={"Nats-Msg-Id": "squatted-id-1"})
        finally:
            await nc.close()
        monkeypatch.setattr(client_module, "new_request_id", lambda: "squatted-id-1")
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            with anyio.fail_after(10):
                with pytest.raises(sdk.BadRequest, match="is taken"):
                    await client.infer(b"mine", model="m1", timeout=60)
