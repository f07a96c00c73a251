"""The results store's bookkeeping (sidecar/replies.py): with a stand-in connection, and the one
publish per answer (protocol 3) against a real server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

import nats

from jetbatch.sdk.protocol import ContentType, ErrorCode, RequestMeta, Subjects, message_bytes
from jetbatch.sdk.publishing import AckGroup
from jetbatch.sidecar.config import RepliesConfig, StreamsConfig
from jetbatch.sidecar.replies import PUBLISH_CHUNK, Answer, Replier
from jetbatch.sidecar.streams import results_stream_config

pytestmark = pytest.mark.anyio


class BackLaterJetStream:
    """A JetStream context whose first publishes time out, as while the server restarts."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.published: list[str] = []

    async def publish(self, subject: str, data: bytes, timeout: float, headers: dict[str, str]) -> Any:
        if self.failures:
            self.failures -= 1
            raise asyncio.TimeoutError  # no PubAck
        self.published.append(subject)
        return SimpleNamespace(stream="RESULTS", seq=1, duplicate=False)


async def test_an_answer_without_a_pubAck_is_stored_again_not_left_to_be_recomputed() -> None:
    """A chaos run (nats-server down 6-7 s) saw requests answered `ok` live, left unstored after a
    5 s wait, redelivered past their deadline and answered `deadline_exceeded`, which the store then
    kept. The answer already sent is now stored again within replies.store_timeout_s."""
    js = BackLaterJetStream(failures=3)
    nc = SimpleNamespace(jetstream=lambda: js, max_payload=1 << 20)
    config = msgspec.convert({"store_timeout_s": 2.0}, RepliesConfig)
    replier = Replier(nc, Subjects("t"), config)  # type: ignore[arg-type]
    meta = RequestMeta(request_id="r1", reply_to=None, deadline=None, content_type=None, model="m1", tenant=None)
    answer = Answer.ok(meta, b"out", ContentType.BYTES)
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()  # its PubAck never comes
    await replier._store_finish([([answer], never)], _pending(never))
    assert answer.stored and replier.safe(answer)
    assert js.published == [Subjects("t").result("r1")]


async def test_an_answer_stored_again_is_sent_again() -> None:
    """What lost the first store's PubAck (a node gone with the worker's connection) may have lost
    the live reply sent right behind it; a caller whose own connection never broke would wait for
    it until its timeout (the failover bench saw that). Once stored again, it is sent again."""
    js = BackLaterJetStream(failures=1)
    sent: list[tuple[str, bytes]] = []

    async def publish(subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        sent.append((subject, body))

    nc = SimpleNamespace(jetstream=lambda: js, max_payload=1 << 20, publish=publish)
    config = msgspec.convert({"store_timeout_s": 2.0}, RepliesConfig)
    replier = Replier(nc, Subjects("t"), config)  # type: ignore[arg-type]
    meta = RequestMeta(request_id="r2", reply_to="_INBOX.c.r2", deadline=None, content_type=None, model="m1", tenant=None)
    answer = Answer.ok(meta, b"out", ContentType.BYTES)
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    await replier._store_finish([([answer], never)], _pending(never))
    assert answer.stored
    assert sent == [("_INBOX.c.r2", b"out")]


def _keyed(rid: str, key: str = "k1", tenant: str | None = None) -> Answer:
    meta = RequestMeta(request_id=rid, reply_to=None, deadline=None, content_type=None, model="m1", tenant=tenant, reply_key=key)
    return Answer.ok(meta, rid.encode(), ContentType.BYTES)


def test_an_answer_over_the_servers_limit_with_its_headers_becomes_model_failed() -> None:
    """Headers count against ``max_payload`` (less room for an atomic batch's own): an answer that
    fits on its body alone but not with its headers is refused before it is sent, and one a byte
    under the limit goes out as it is, whatever its characters take in UTF-8."""
    limit = 4096
    replier = Replier(SimpleNamespace(jetstream=lambda: None, max_payload=limit + 128), Subjects("t"), RepliesConfig())  # type: ignore[arg-type]
    for extra in ({}, {"Jetbatch-Note": "é€" * 40}):
        probe = Answer.ok(_keyed("r1").meta, b"", ContentType.BYTES, extra)
        room = limit - message_bytes(probe.headers, b"")
        fits = Answer.ok(probe.meta, b"x" * room, ContentType.BYTES, extra)
        assert replier.fit(fits) is fits
        over = Answer.ok(probe.meta, b"x" * (room + 1), ContentType.BYTES, extra)
        refused = replier.fit(over)
        assert refused.error is ErrorCode.MODEL_FAILED and b"max payload" in refused.body
        assert message_bytes(refused.headers, refused.body) <= limit


@pytest.mark.parametrize(("setting", "allowed"), [(False, True), (True, True), (True, False)])
async def test_each_answer_is_one_message_stored_and_received_live(nats_url: str, prefix: str, setting: bool, allowed: bool) -> None:
    """Protocol 3: the caller's subscription receives each answer once, and the results stream
    holds it under the same subject. By default the worker waits for a PubAck an answer; with
    ``atomic_batches``, one for the whole batch. A stream made without ``allow_atomic`` refuses
    the batch: the answers are stored one by one, and the replier stops trying batches."""
    subjects = Subjects(prefix)
    config = msgspec.convert({"atomic_batches": setting}, RepliesConfig)
    nc = await nats.connect(nats_url)
    try:
        stream = results_stream_config(subjects, StreamsConfig(), config)
        stream.allow_atomic = allowed
        await nc.jetstream().add_stream(stream)
        live: list[str] = []

        async def heard(msg: Any) -> None:
            live.append(msg.subject)

        await nc.subscribe(subjects.answers("k1"), cb=heard)
        await nc.subscribe(subjects.answers("k2", "t1"), cb=heard)
        replier = Replier(nc, subjects, config)
        answers = [_keyed(f"r{i}") for i in range(5)] + [_keyed("r5", "k2", "t1")]
        await replier.deliver(answers)
        acks = replier._acks
        assert all(a.stored and a.sent and replier.safe(a) for a in answers)
        await nc.flush()
        assert set(live) == {subjects.answer(a.meta.request_id, a.meta.reply_key, a.meta.tenant) for a in answers}
        # Once each; where a refused batch's answers are stored again one by one, twice (the
        # caller drops the second).
        assert len(live) == (12 if setting and not allowed else 6)
        for a in answers:
            stored = await nc.jetstream().get_msg(subjects.results_stream, subject=subjects.answer_anywhere(a.meta.request_id, a.meta.tenant), direct=True)
            assert stored.data == a.body
        info = await nc.jetstream().stream_info(subjects.results_stream)
        assert info.state.messages == 6
        assert replier._atomic is (setting and allowed)
        assert acks is not None
        published = acks.sent
        await replier.deliver([_keyed("r6"), _keyed("r7")])
        assert (await nc.jetstream().stream_info(subjects.results_stream)).state.messages == 8
        assert acks.sent - published == (1 if setting and allowed else 2)  # PubAcks waited for: one a batch, else one an answer
    finally:
        await nc.close()


def _pending(*futures: asyncio.Future[Any]) -> AckGroup:
    group = AckGroup()
    for fut in futures:
        group.add(fut)
    return group


def _record_buffered(nc: Any, head: str, into: list[int]) -> None:
    """Have ``nc`` note, before each publish to a subject starting with ``head``, how many bytes
    it holds unwritten: a drop between two publishes means the socket was written in between."""
    publish = nc.publish

    async def recording(subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None) -> None:
        if subject.startswith(head):
            into.append(nc.pending_data_size)
        await publish(subject, payload, reply=reply, headers=headers)

    nc.publish = recording


async def test_a_batchs_answers_reach_the_socket_in_chunks(nats_url: str, prefix: str) -> None:
    """A batch's answers were all published before any was written: a closed loop of callers
    then waited for the whole batch, and the worker for all their next requests, one batch in
    lockstep at a time (bench.overhead.deployed: batches of 55-59 at 64 in flight). Each chunk now reaches the socket before
    the next is published, and every answer is stored as before."""
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(results_stream_config(subjects, StreamsConfig(), RepliesConfig()))
        buffered: list[int] = []
        _record_buffered(nc, f"{prefix}.result.", buffered)
        replier = Replier(nc, subjects, RepliesConfig())
        answers = [_keyed(f"r{i}") for i in range(2 * PUBLISH_CHUNK + 1)]
        await replier.deliver(answers)
        assert all(a.stored and a.sent for a in answers)
        assert len(buffered) == len(answers)
        written_before = [i for i in range(1, len(buffered)) if buffered[i] < buffered[i - 1]]
        assert written_before == [PUBLISH_CHUNK, 2 * PUBLISH_CHUNK]
        assert (await nc.jetstream().stream_info(subjects.results_stream)).state.messages == len(answers)
    finally:
        await nc.close()


async def test_a_batch_refused_in_an_election_is_stored_one_by_one_and_batches_go_on() -> None:
    """No stream answering a batch (an election) is passing: its answers are stored one by one,
    and the next batch is atomic again. A server that stored the batch's messages one by one
    (it knows no atomic batches) turns batches off for good."""
    from jetbatch.sdk.publishing import BatchIgnored, PublishRefused

    for refusal, atomic_after in ((PublishRefused("no stream answered (status 503)"), True), (BatchIgnored("not atomic"), False)):
        js = BackLaterJetStream(failures=0)
        nc = SimpleNamespace(jetstream=lambda js=js: js, max_payload=1 << 20)
        replier = Replier(nc, Subjects("t"), msgspec.convert({"atomic_batches": True}, RepliesConfig))  # type: ignore[arg-type]
        group = [_keyed("r1"), _keyed("r2")]
        refused: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        refused.set_exception(refusal)
        await replier._store_finish([(group, refused)], _pending(refused))
        assert all(a.stored and a.sent for a in group)
        assert js.published == [Subjects("t").answer("r1", "k1"), Subjects("t").answer("r2", "k1")]
        assert replier._atomic is atomic_after


async def test_stored_answers_are_looked_up_on_the_main_identity() -> None:
    """A reply identity may only publish answers: a direct get from it would wait out a
    permission violation, and a redelivered request be computed again."""

    class Lookups:
        def __init__(self) -> None:
            self.asked: list[str] = []

        async def get_msg(self, stream: str, subject: str, direct: bool) -> Any:
            self.asked.append(subject)
            return SimpleNamespace(data=b"out", headers={"Jetbatch-Status": "ok", "Nats-Batch-Id": "b1", "Nats-Sequence": "9"})

    main, replies = Lookups(), Lookups()
    nc = SimpleNamespace(jetstream=lambda: main, max_payload=1 << 20)
    reply_nc = SimpleNamespace(jetstream=lambda: replies, max_payload=1 << 20)
    replier = Replier(nc, Subjects("t"), RepliesConfig(), reply_nc=reply_nc)  # type: ignore[arg-type]
    found = await replier.stored_answer(_keyed("r1").meta)
    assert found is not None and found.stored
    assert (main.asked, replies.asked) == ([Subjects("t").answer("r1", "k1")], [])
    assert found.headers == {"Jetbatch-Status": "ok"}  # no Nats-* header is sent again


@pytest.mark.parametrize("durable", [True, False])
async def test_a_ping_round_trip_only_where_no_pubacks_say_the_answers_are_out(nats_url: str, prefix: str, durable: bool) -> None:
    """With the results store, the PubAcks confirm a batch's answers (and nats-py writes while
    they are awaited): no PING and PONG a batch besides. Without it, an answer is safe once
    written out, which a flush's round trip confirms."""
    subjects = Subjects(prefix)
    config = msgspec.convert({"durable": durable}, RepliesConfig)
    nc = await nats.connect(nats_url)
    try:
        if durable:
            await nc.jetstream().add_stream(results_stream_config(subjects, StreamsConfig(), config))
        flushes: list[float] = []
        flush = nc.flush

        async def counting(timeout: float = 10) -> None:
            flushes.append(timeout)
            await flush(timeout)

        nc.flush = counting  # type: ignore[method-assign]
        replier = Replier(nc, subjects, config)
        meta = RequestMeta(request_id="r1", reply_to=None, deadline=None, content_type=None, model="m1", tenant=None, reply_key="k1")
        answers = [Answer.ok(meta, b"out", ContentType.BYTES)]
        await replier.deliver(answers)
        assert replier.safe(answers[0])
        assert len(flushes) == (0 if durable else 1)
    finally:
        await nc.close()
