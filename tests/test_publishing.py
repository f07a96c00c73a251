"""sdk/publishing.py: PubAcks and the AckGroup that awaits a batch of them, with a stand-in
connection whose PubAcks the test delivers (the real server's are in tests/test_replies.py and
tests/test_classifier.py)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, Awaitable, Callable
from unittest import mock

import anyio.lowlevel
import nats
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetbatch.sdk import publishing
from jetbatch.sdk.errors import RequestTimeout
from jetbatch.sdk.publishing import AckGroup, BatchIgnored, PublishRefused, PubAcks, publish_with_retries

pytestmark = pytest.mark.anyio


class StandIn:
    """What PubAcks needs of a connection: an inbox, a subscription, publishes it records."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str, dict[str, str] | None]] = []
        self.on_ack: Callable[[Any], Awaitable[None]] | None = None
        self.unsubscribed = False

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        self.on_ack = cb

        async def unsubscribe() -> None:
            self.unsubscribed = True

        return SimpleNamespace(unsubscribe=unsubscribe)

    async def publish(self, subject: str, body: bytes, reply: str = "", headers: dict[str, str] | None = None) -> None:
        self.published.append((subject, reply, headers))

    async def ack(self, reply: str, body: dict[str, Any] | None, headers: dict[str, str] | None = None) -> None:
        """The server's answer to the publish whose reply subject was ``reply``."""
        assert self.on_ack is not None
        await self.on_ack(SimpleNamespace(subject=reply, data=json.dumps(body).encode() if body is not None else b"", headers=headers))


def _stored(seq: int, **extra: Any) -> dict[str, Any]:
    return {"stream": "R", "seq": seq, **extra}


async def test_a_group_wakes_once_every_pubAck_came_and_each_future_holds_its_own() -> None:
    nc = StandIn()
    acks = PubAcks(nc)  # type: ignore[arg-type]
    group = AckGroup()
    futs = [await acks.publish(f"s.{i}", b"x", {}, group=group) for i in range(3)]
    waiting = asyncio.ensure_future(group.wait(5.0))
    for i, (_, reply, _) in enumerate(nc.published[:2]):
        await nc.ack(reply, _stored(i + 1))
    await anyio.lowlevel.checkpoint()  # the waiting task runs up to its wait
    assert not waiting.done()  # one PubAck still to come
    await nc.ack(nc.published[2][1], {"error": {"code": 400, "err_code": 10077, "description": "maximum messages exceeded"}})
    await asyncio.wait_for(waiting, 1)
    assert [f.result()["seq"] for f in futs[:2]] == [1, 2]
    refused = futs[2].exception()
    assert isinstance(refused, PublishRefused) and refused.err_code == 10077
    assert not acks._waiting  # every token answered is forgotten


async def test_what_has_no_pubAck_by_the_timeout_is_cancelled_and_a_late_one_is_dropped() -> None:
    nc = StandIn()
    acks = PubAcks(nc)  # type: ignore[arg-type]
    group = AckGroup()
    answered = await acks.publish("s.1", b"x", {}, group=group)
    lost = await acks.publish("s.2", b"x", {}, group=group)
    await nc.ack(nc.published[0][1], _stored(1))
    waiting = asyncio.ensure_future(group.wait(0.05))
    await anyio.lowlevel.checkpoint()  # the waiting task runs up to its wait
    assert not waiting.done()  # it waits for the missing one, up to its timeout
    await asyncio.wait_for(waiting, 5)
    assert answered.result()["seq"] == 1 and lost.cancelled()
    await nc.ack(nc.published[1][1], _stored(2))  # too late: dropped, nothing raises
    assert lost.cancelled()


async def _one_waited_for() -> tuple[StandIn, PubAcks, asyncio.Future[Any], asyncio.Future[None]]:
    """One publish in a group, and the group's wait (long) already waiting for its PubAck."""
    nc = StandIn()
    acks = PubAcks(nc)  # type: ignore[arg-type]
    group = AckGroup()
    fut = await acks.publish("s.1", b"x", {}, group=group)
    waiting = asyncio.ensure_future(group.wait(30.0))
    await anyio.lowlevel.checkpoint()  # the waiting task runs up to its wait
    return nc, acks, fut, waiting


async def test_closing_the_pubAcks_ends_a_groups_wait_at_once() -> None:
    nc, acks, fut, waiting = await _one_waited_for()
    await acks.close()
    await asyncio.wait_for(waiting, 1)
    assert fut.cancelled() and nc.unsubscribed


async def test_a_cancelled_wait_cancels_what_it_waited_for() -> None:
    nc, _, fut, waiting = await _one_waited_for()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert fut.cancelled()
    await nc.ack(nc.published[0][1], _stored(1))  # its PubAck after all: dropped


async def test_an_atomic_batchs_pubAck_must_cover_the_batch() -> None:
    nc = StandIn()
    acks = PubAcks(nc)  # type: ignore[arg-type]
    for answer, ok in (({"batch": None, "count": 3}, True), ({"count": 1}, False), ({"count": 2}, False)):
        group = AckGroup()
        nc.published.clear()
        fut = await acks.publish_atomic([("s.1", b"a", {"H": "1"}), ("s.2", b"b", {}), ("s.3", b"c", {})], group=group)
        subject, reply, headers = nc.published[-1]
        assert headers is not None and headers["Nats-Batch-Commit"] == "1" and [p[1] for p in nc.published[:-1]] == ["", ""]
        batch = headers["Nats-Batch-Id"]
        await nc.ack(reply, _stored(3, **{**answer, **({"batch": batch} if "batch" in answer else {})}))
        await group.wait(1.0)
        if ok:
            assert fut.result()["count"] == 3
        else:
            assert isinstance(fut.exception(), BatchIgnored)
    assert nc.published[0][2] == {"H": "1", "Nats-Batch-Id": batch, "Nats-Batch-Sequence": "1"}


async def test_a_pubAck_with_no_stream_is_a_refusal_naming_the_status() -> None:
    nc = StandIn()
    acks = PubAcks(nc)  # type: ignore[arg-type]
    fut = await acks.publish("s.1", b"x", {})
    await nc.ack(nc.published[0][1], None, {"Status": "503"})
    exc = fut.exception()
    assert isinstance(exc, PublishRefused) and exc.err_code is None and "503" in str(exc)


async def test_pubAck_tokens_are_random_so_one_seen_tells_nothing_of_the_next() -> None:
    """Every answer carries its PubAck subject as its reply, in sight of its callers. With a
    counter there, anyone who may publish to the inbox confirmed the next publishes before
    JetStream did (an attack confirmed 24% of a worker's answer stores, and during a results
    stream outage got requests acked whose answers were stored nowhere). Tokens are 64 random
    bits now; a PubAck on any other token is dropped."""
    nc = StandIn()
    acks = PubAcks(nc)  # type: ignore[arg-type]
    futs = [await acks.publish(f"s.{i}", b"x", {}) for i in range(600)]  # past one pool of random bytes
    tokens = [reply.rsplit(".", 1)[1] for _, reply, _ in nc.published]
    assert len(set(tokens)) == 600 and all(len(t) == 16 and int(t, 16) >= 0 for t in tokens)
    for guess in ("1", "2", "601", tokens[0][:-1] + ("0" if tokens[0][-1] != "0" else "1")):
        await nc.ack(f"_INBOX.test.{guess}", _stored(9))
    assert not any(f.done() for f in futs) and len(acks._waiting) == 600


async def test_a_pubAck_from_another_stream_is_a_refusal() -> None:
    """Each publisher knows the streams its messages are for (a worker's answers, the results
    stream): a PubAck naming another is no proof its message was stored there."""
    nc = StandIn()
    acks = PubAcks(nc, streams=("R",))  # type: ignore[arg-type]
    ours, theirs = await acks.publish("s.1", b"x", {}), await acks.publish("s.2", b"x", {})
    await nc.ack(nc.published[0][1], _stored(1))
    await nc.ack(nc.published[1][1], {"stream": "FORGED", "seq": 424242})
    assert ours.result()["seq"] == 1
    assert isinstance(theirs.exception(), PublishRefused) and "FORGED" in str(theirs.exception())


@pytest.mark.parametrize(
    "body",
    [b"[" * 1000 + b"]" * 1000, b'{"stream": 1, "seq": 1}', b'{"stream": "R"}', b'{"stream": "R", "seq": "1"}', b"[1, 2]", b"not json"],
    ids=["nested too deep", "stream not a name", "no seq", "seq not a number", "a list", "not json"],
)
async def test_a_pubAck_that_is_not_one_is_a_refusal_at_once(body: bytes) -> None:
    """A body on a live token that is not a PubAck is a refusal (the caller's careful path
    publishes again under the same id), never an exception out of the subscription: a body
    nested past msgspec's depth raised RecursionError there, and the batch waited out its 5 s."""
    nc = StandIn()
    acks = PubAcks(nc)  # type: ignore[arg-type]
    group = AckGroup()
    fut = await acks.publish("s.1", b"x", {}, group=group)
    assert nc.on_ack is not None
    await nc.on_ack(SimpleNamespace(subject=nc.published[0][1], data=body, headers=None))
    await asyncio.wait_for(group.wait(30.0), 1)
    assert isinstance(fut.exception(), PublishRefused)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["ack", "refuse", "give_up", "none"]), min_size=1, max_size=40))
def test_tokens_given_up_on_are_swept_and_the_table_stays_bounded(outcomes: list[str]) -> None:
    """Whatever becomes of each publish (answered, refused, given up on by its caller, never
    answered), the table of tokens holds only futures still waiting once it is swept, and never
    more than twice what it held after the last sweep, or the sweep's floor."""

    async def run() -> None:
        nc = StandIn()
        acks = PubAcks(nc)  # type: ignore[arg-type]
        acks._sweep_at = floor
        pending: list[asyncio.Future[Any]] = []
        for i, outcome in enumerate(outcomes * 3):
            fut = await acks.publish(f"s.{i}", b"x", {})
            reply = nc.published[-1][1]
            if outcome == "ack":
                await nc.ack(reply, _stored(i))
                assert fut.done()
            elif outcome == "refuse":
                await nc.ack(reply, {"error": {"code": 503, "description": "no"}})
                assert isinstance(fut.exception(), PublishRefused)
            elif outcome == "give_up":
                fut.cancel()
            else:
                pending.append(fut)
            # Answered tokens go at once; given-up ones at the next sweep, which comes once the
            # table is twice what it held after the last (or the floor).
            assert len(acks._waiting) <= max(floor, 2 * len(pending)) + 1
        assert all(not e[0].done() or e[0].cancelled() for e in acks._waiting.values())
        assert {id(f) for f in pending} <= {id(e[0]) for e in acks._waiting.values()}

    floor = 4  # sweep often: the property is about the sweep, not its floor
    with mock.patch.object(publishing, "_SWEEP_MIN", floor):
        asyncio.run(run())


@pytest.mark.parametrize("junk", [b"not json", b"[" * 1000 + b"]" * 1000, b"[1, 2]", b'{"stream": 1}'], ids=["text", "nested", "list", "stream"])
async def test_the_careful_path_reads_a_reply_that_is_not_a_pubAck_as_no_pubAck(nats_url: str, junk: bytes) -> None:
    """nats-py's ``js.publish`` parses whatever reaches the request's inbox first; junk there (a
    responder on a subject no stream captures, or anyone who may publish to that inbox first)
    raised JSONDecodeError, RecursionError or TypeError out of ``publish_with_retries``, where a
    typed error is promised (the SDK's ``infer`` raised it; a worker's ``deliver`` that must not
    raise did). It is retried like a missing PubAck, to the deadline: ``RequestTimeout``."""
    nc = await nats.connect(nats_url)
    try:

        async def answer_junk(msg: Any) -> None:
            await nc.publish(msg.reply, junk)

        await nc.subscribe("no.stream.here", cb=answer_junk)
        with pytest.raises(RequestTimeout):
            await publish_with_retries(nc.jetstream(), "no.stream.here", b"x", {"Nats-Msg-Id": "r1"}, deadline=time.monotonic() + 0.3)
    finally:
        await nc.close()
