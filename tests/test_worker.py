"""The worker against a real nats-server: replies, batching, errors, and that it keeps serving."""

from __future__ import annotations

import time

import pytest

from jetbatch import sdk
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import ContentType, Headers
from jetbatch.sidecar.streams import model_consumer_name
from tests.helpers import make_config, running_worker, sleep_model, wait_until

pytestmark = pytest.mark.anyio


async def test_request_gets_reply_with_batch_metadata(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            result = await client.infer_result({"x": [1, 2, 3]}, model="m1", timeout=10)
        # The forward pass's time beyond the model's configured cost, for the simulator's twin.
        assert worker.stats["compute_excess_n"] == 1
    assert result.output == {"x": [1, 2, 3]}
    assert result.batch.model == "m1"
    assert result.batch.batch_size == 1
    assert result.batch.model_loaded is True  # the first batch paid the load
    assert len(result.batch.batch_id) == 16


async def test_concurrent_requests_share_batches(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model(max_batch_size=8, max_delay_ms=50)})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)  # load first, then measure batching
            results = await _gather_results(client, [f"r{i}".encode() for i in range(24)], "m1")
    assert [r.output for r in results] == [f"r{i}".encode() for i in range(24)]
    batch_ids = {r.batch.batch_id for r in results}
    assert len(batch_ids) < 24
    for bid in batch_ids:
        members = [r for r in results if r.batch.batch_id == bid]
        assert members[0].batch.batch_size == len(members) <= 8


async def _gather_results(client: sdk.Client, payloads: list[bytes], model: str) -> list[sdk.Result]:
    import asyncio

    return await asyncio.gather(*(client.infer_result(p, model=model, timeout=20) for p in payloads))


async def test_lone_request_waits_about_max_delay(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=200, max_batch_size=8)})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            result = await client.infer_result(b"alone", model="m1", timeout=10)
    assert result.batch.batch_size == 1
    # The batch window held it for max_delay (200 ms) from its enqueue time, less at most the
    # early aim of the last fetch (half the window, and never more than 50 ms: batching.py);
    # the wait is the worker's own measure, in the reply. How close to 200 ms it closes is
    # test_batching's, on a fake clock.
    assert result.batch.queue_wait_ms >= 150


async def test_garbled_payload_is_bad_request_and_worker_keeps_serving(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            with pytest.raises(sdk.BadRequest) as info:
                await client.infer(b"\xc1\xff\x00garbage", model="m1", timeout=10, content_type=ContentType.MSGPACK)
            assert info.value.code == "bad_request"
            assert "msgpack" in info.value.message
            assert await client.infer([1, 2], model="m1", timeout=10) == [1, 2]


async def test_bad_tensor_gets_bad_request_rest_of_batch_served(nats_url: str, prefix: str) -> None:
    import asyncio

    import msgspec

    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=100)})
    bad = msgspec.msgpack.encode({"dtype": "float32", "shape": [4], "data": b"\x00" * 3})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            good = [client.infer_result(f"ok{i}".encode(), model="m1", timeout=10) for i in range(3)]
            broken = client.infer(bad, model="m1", timeout=10, content_type=ContentType.TENSOR)
            outcome = await asyncio.gather(*good, broken, return_exceptions=True)
    assert [r.output for r in outcome[:3]] == [b"ok0", b"ok1", b"ok2"]
    assert isinstance(outcome[3], sdk.BadRequest)
    assert "do not match shape" in str(outcome[3])


async def test_unknown_model_is_typed_error(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            with pytest.raises(sdk.UnknownModel):
                await client.infer(b"x", model="nosuchmodel", timeout=5)
            with pytest.raises(sdk.BadRequest):
                await client.infer(b"x", model="bad.name", timeout=5)


async def test_expired_deadline_is_not_computed(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            past = str(int((time.time() - 5) * 1000))
            with pytest.raises(sdk.DeadlineExceeded):
                await client.infer(b"late", model="m1", timeout=10, headers={Headers.DEADLINE: past})
    # Answered without compute, and without paying m1's load for a caller already gone.
    assert (worker.stats["reaped"], worker.stats["requests"], worker.stats["loads"]) == (1, 0, 0)


async def test_request_that_cannot_finish_in_time_is_refused_before_compute(nats_url: str, prefix: str) -> None:
    """A model whose batches take 1 s: a request due in 0.6 s is answered deadline_exceeded as
    soon as its batch is assembled (that batch would end too late), one due in 5 s is computed."""
    slow = {"load_cost_s": 0.0, "batch_cost_s": 1.0, "item_cost_s": 0.0}
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=1, batch_cost_s=1.0, options=slow)})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"in time", model="m1", timeout=5) == b"in time"
            due = str(int((time.time() + 0.6) * 1000))
            # Refused on the prediction (the message says so: time left, against a batch's
            # estimated time), so before compute and before the deadline passed.
            with pytest.raises(sdk.DeadlineExceeded, match=r"s left, a batch takes about"):
                await client.infer(b"too tight", model="m1", timeout=10, headers={Headers.DEADLINE: due})


async def test_handler_failure_isolates_poison_request(nats_url: str, prefix: str) -> None:
    import asyncio

    model = sleep_model(max_delay_ms=100, options={"load_cost_s": 0, "batch_cost_s": 0, "item_cost_s": 0, "fail_on": "poison"})
    config = make_config(prefix, {"m1": model})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            calls = [client.infer(p, model="m1", timeout=10) for p in (b"a", b"poison", b"b", b"c")]
            outcome = await asyncio.gather(*calls, return_exceptions=True)
    assert outcome[0] == b"a" and outcome[2] == b"b" and outcome[3] == b"c"
    assert isinstance(outcome[1], sdk.ModelFailed)


async def test_startup_retries_a_slow_jetstream_then_gives_up_with_one_line() -> None:
    """A worker starting while the cluster elects a leader retries with a logged backoff; a
    configuration conflict is not retried; a JetStream that never answers is one clear error."""
    import nats.errors

    from jetbatch.sidecar.streams import StreamSetupError
    from jetbatch.sidecar.worker import retry_startup

    calls = 0

    async def slow() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise nats.errors.TimeoutError
        return "ready"

    assert await retry_startup(slow, timeout_s=10, what="w") == "ready"
    assert calls == 3

    async def conflict() -> None:
        raise StreamSetupError("retention differs", transient=False)

    with pytest.raises(StreamSetupError, match="retention"):
        await retry_startup(conflict, timeout_s=10, what="w")

    async def never() -> None:
        raise nats.errors.TimeoutError

    started = time.monotonic()
    with pytest.raises(StreamSetupError, match="did not answer within 1s"):
        await retry_startup(never, timeout_s=1, what="w")
    assert time.monotonic() - started < 3


async def test_a_reply_on_the_wire_carries_five_headers_with_the_batch_metadata_in_one(nats_url: str, prefix: str) -> None:
    """Protocol 2: what a client in another language (or the `nats` CLI) sees of a reply."""
    import nats

    from jetbatch.sdk.protocol import Subjects, batch_info_from_headers

    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        nc = await nats.connect(nats_url)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.jetstream().publish(
                Subjects(prefix).model("m1"), b"hi",
                headers={Headers.MSG_ID: "wire-1", Headers.REPLY_TO: inbox, Headers.CONTENT_TYPE: ContentType.BYTES.value},
            )  # fmt: skip
            msg = await sub.next_msg(timeout=15)
        finally:
            await nc.close()
    assert msg.data == b"hi"
    assert set(msg.headers) == {Headers.STATUS, Headers.REQUEST_ID, Headers.CONTENT_TYPE, Headers.MODEL, Headers.BATCH}
    fields = dict(part.split("=", 1) for part in msg.headers[Headers.BATCH].split(";"))
    assert set(fields) >= {"id", "size", "wait_ms", "loaded", "worker"} and fields["size"] == "1" and fields["loaded"] == "1"
    info = batch_info_from_headers(msg.headers)
    assert (info.model, info.batch_size, len(info.batch_id)) == ("m1", 1, 16)


async def test_an_answer_the_results_store_refuses_is_sent_but_not_acked(nats_url: str, prefix: str) -> None:
    """The store's PubAck gates the ack: when the results stream refuses the stored copy (here:
    over its maximum message size), the caller still gets the live reply, and the request is
    redelivered rather than acked as if its answer were safe."""
    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.streams import model_consumer_name
    from tests.helpers import wait_until, worker_and_jetstream

    subjects = Subjects(prefix)
    async with worker_and_jetstream(prefix, nats_url) as (_, js):
        info = await js.stream_info(subjects.results_stream)
        info.config.max_msg_size = 16  # every answer below is bigger
        await js.update_stream(info.config)
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"x" * 64, model="m1", timeout=10) == b"x" * 64

        async def redelivered() -> bool:
            consumer = await js.consumer_info(subjects.models_stream, model_consumer_name("m1"))
            return consumer.num_redelivered >= 1

        await wait_until(redelivered, timeout_s=15, what="the unstored request's redelivery")
        assert (await js.stream_info(subjects.results_stream)).state.messages == 0


async def test_a_request_given_back_when_its_store_was_refused_is_found_when_due_whatever_the_poll_interval(nats_url: str, prefix: str) -> None:
    """A request whose answer the results store refused goes back to its queue (nak) for a
    second, and JetStream sends no arrival event for its redelivery: the worker counts its queues
    when it falls due, and stores its answer then, with the periodic count a minute away (it
    used to wait for that minute)."""
    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.streams import model_consumer_name

    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model()}, worker={"poll_interval_ms": 60_000, "idle_refresh_s": 60.0})
    async with running_worker(config, nats_url) as worker:
        nc = await connect_nats(nats_url)
        try:
            js = nc.jetstream()
            async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                await client.infer(b"warm", model="m1", timeout=10)
                info = await js.stream_info(subjects.results_stream)
                limit = info.config.max_msg_size
                info.config.max_msg_size = 16  # the answer below is bigger
                await js.update_stream(info.config)
                # The live reply is the publish the store refuses. The stream takes it in after
                # the live delivery, so the limit stays until the worker gave the request back.
                assert await client.infer(b"x" * 64, model="m1", timeout=10, request_id="refused-1") == b"x" * 64
                await wait_until(lambda: worker.stats["given_back"] >= 1, timeout_s=10, what="the request given back")
                info.config.max_msg_size = limit
                await js.update_stream(info.config)
            await wait_until(lambda: _settled(js, subjects.models_stream, model_consumer_name("m1")), timeout_s=10, what="the request acked")
            stored = await js.get_msg(subjects.results_stream, subject=subjects.answer_anywhere("refused-1"), direct=True)
            assert stored.data == b"x" * 64
            # The warm-up, the refused delivery, and one more for each time it was given back (a
            # redelivery due before the limit was lifted is refused and given back again).
            assert worker.stats["requests"] == 2 + worker.stats["given_back"]
        finally:
            await nc.close()


async def test_a_results_stream_briefly_gone_delays_the_ack_instead_of_redelivering(nats_url: str, prefix: str) -> None:
    """No stream answering the store (a leader election, a restart) is retried within the store's
    bound: once the results stream is back, the answer is stored and the request acked, never
    redelivered to be computed again."""
    import nats.js.errors

    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.streams import model_consumer_name, results_stream_config
    from tests.helpers import wait_until, worker_and_jetstream

    subjects = Subjects(prefix)
    async with worker_and_jetstream(prefix, nats_url) as (worker, js):
        await js.delete_stream(subjects.results_stream)
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            # The live reply goes out before the store is confirmed: the caller has its answer.
            assert await client.infer(b"during the election", model="m1", timeout=10, request_id="elect-1") == b"during the election"
        await js.add_stream(results_stream_config(subjects, worker.config.streams, worker.config.replies))

        async def stored() -> bool:
            try:
                await js.get_msg(subjects.results_stream, subject=subjects.answer_anywhere("elect-1"), direct=True)
                return True
            except nats.js.errors.NotFoundError:
                return False

        await wait_until(stored, timeout_s=10, what="the answer stored once the stream was back")
        await wait_until(lambda: _settled(js, subjects.models_stream, model_consumer_name("m1")), timeout_s=10, what="the request acked")
        assert worker.stats["requests"] == 1  # computed once: never naked and run again


async def _settled(js: object, stream: str, consumer: str) -> bool:
    info = await js.consumer_info(stream, consumer)  # type: ignore[attr-defined]
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_the_next_batch_computes_while_the_answers_before_it_are_stored(nats_url: str, prefix: str) -> None:
    """Storing a batch's answers is a round trip that needs no device: while the first batch's
    answers wait on the results store, the next batch computes and answers (the simulator's
    model of the worker). Each request is acked only once its own answer is stored."""
    import asyncio

    config = make_config(prefix, {"m1": sleep_model(max_batch_size=1, max_delay_ms=1)})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"warm", model="m1", timeout=10)
            deliver = worker.replier.deliver
            release = asyncio.Event()
            entered: list[bytes] = []

            async def held_first(answers: list) -> None:  # type: ignore[type-arg]
                entered.append(answers[0].body)
                if len(entered) == 1:
                    await asyncio.wait_for(release.wait(), 20)
                await deliver(answers)

            worker.replier.deliver = held_first  # type: ignore[method-assign]
            first = asyncio.ensure_future(client.infer(b"first", model="m1", timeout=20))
            await wait_until(lambda: entered == [b"first"], what="the first batch's answers held at the store")
            assert await client.infer(b"second", model="m1", timeout=10) == b"second"
            assert not first.done()
            await wait_until(lambda: worker.core.in_flight("m1") == 1, what="the second batch settled")
            assert worker.core.computing("m1") == 0  # the first still holds its request, not the model

            async def only_the_first_unacked() -> bool:
                info = await client.nats.jetstream().consumer_info(worker.subjects.models_stream, model_consumer_name("m1"))
                return bool(info.num_ack_pending == 1)

            # The second's ack may still be on its way to the server; the first, its answer held
            # at the store, cannot be acked meanwhile.
            await wait_until(only_the_first_unacked, what="only the first request unacked")
            release.set()
            assert await first == b"first"


async def test_an_inline_handler_computes_on_the_event_loop_and_any_other_in_a_worker_thread(nats_url: str, prefix: str) -> None:
    """A handler that declares ``predict`` cheap and bounded (``inline``: the identity model) is
    called on the event loop's own thread, which a thread's round trip would cost more than; any
    other (the sleep model here, or a custom handler) in a worker thread, as the handler contract
    says, so that a slow batch never stops the loop."""
    import threading

    config = make_config(prefix, {"fast": {"handler": "identity", "max_batch_size": 4, "max_delay_ms": 1}, "slow": sleep_model()})
    async with running_worker(config, nats_url) as worker:
        loop_thread = threading.get_ident()
        ran_on_loop: dict[str, list[bool]] = {"fast": [], "slow": []}
        for name, calls in ran_on_loop.items():
            handler = worker.slots[name].handler
            predict = handler.predict

            def recorded(inputs: list, predict=predict, calls=calls) -> list:  # type: ignore[no-untyped-def, type-arg]
                calls.append(threading.get_ident() == loop_thread)
                return predict(inputs)

            handler.predict = recorded  # type: ignore[method-assign]
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            for name in ("fast", "slow", "fast", "slow"):
                assert await client.infer(name.encode(), model=name, timeout=10) == name.encode()
    assert ran_on_loop == {"fast": [True, True], "slow": [False, False]}


@pytest.mark.anyio
async def test_a_json_request_is_answered_in_json_whatever_the_output(nats_url: str, prefix: str) -> None:
    """docs/protocol.md: a request sent as JSON is answered as JSON. Found by an attack: only a
    tensor output was; a handler returning plain values (the identity handler, a function
    handler) answered a JSON request in MessagePack, which ``nats sub`` shows as binary."""
    import json

    from jetbatch.sdk.protocol import Subjects

    subjects = Subjects(prefix)
    value = {"a": [1, 2.5, "x"], "b": None, "c": {"d": True}}
    config = make_config(prefix, {"m1": {"handler": "identity", "max_batch_size": 4, "max_delay_ms": 5}})
    async with running_worker(config, nats_url):
        nc = await connect_nats(nats_url)
        try:
            sub = await nc.subscribe(subjects.answers("me"))
            headers = {Headers.MSG_ID: "json-1", Headers.REPLY_KEY: "me", Headers.CONTENT_TYPE: ContentType.JSON.value}
            await nc.jetstream().publish(subjects.model("m1"), json.dumps(value).encode(), headers=headers)
            msg = await sub.next_msg(timeout=10)
            assert msg.headers[Headers.CONTENT_TYPE] == ContentType.JSON.value
            assert json.loads(msg.data) == value
            # Asked in msgpack, answered in msgpack as before.
            async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                assert await client.infer(value, model="m1", timeout=10) == value
        finally:
            await nc.close()


def test_a_json_request_gets_json_only_for_what_json_holds_as_it_is() -> None:
    """From a review: turning every msgpack output into JSON would change it silently (bytes as
    base64 text, NaN as null, integer keys as text). Such an output keeps msgpack."""
    import math

    import msgspec

    from jetbatch.sidecar.worker.triage import as_asked as _as_asked

    as_json = ContentType.JSON.value
    for value in ({"a": [1, 2.5, "x"], "b": None}, [True, {"c": "d"}]):
        body, ctype = _as_asked(msgspec.msgpack.encode(value), ContentType.MSGPACK, as_json)
        assert ctype is ContentType.JSON and msgspec.json.decode(body) == value
    for value in ({"b": b"\x00\xff"}, {1: "a"}, [math.nan]):
        body, ctype = _as_asked(msgspec.msgpack.encode(value), ContentType.MSGPACK, as_json)
        assert ctype is ContentType.MSGPACK, value
    assert _as_asked(b"\x81\xa1a\x01", ContentType.MSGPACK, "application/msgpack")[1] is ContentType.MSGPACK
