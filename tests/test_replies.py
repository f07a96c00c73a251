"""The results store's bookkeeping on its own (sidecar/replies.py), with a stand-in connection."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from jetbatch.sdk.protocol import ContentType, RequestMeta, Subjects
from jetbatch.sidecar.config import RepliesConfig
from jetbatch.sidecar.replies import Answer, Replier

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
    await replier._store_finish([([answer], never)])
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
    await replier._store_finish([([answer], never)])
    assert answer.stored
    assert sent == [("_INBOX.c.r2", b"out")]
