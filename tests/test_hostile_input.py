"""Hostile requests crafted on the wire with nats-py: a reply subject aimed at the JetStream API,
another queue, the dead-letter stream or another tenant's inbox; absurd deadlines; reply
subjects longer than the server's control line. The sidecars publish nothing there, answer what
they can with ``bad_request``, dead-letter what they cannot answer, and keep serving."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from typing import Any

import msgspec
import nats
import nats.js.errors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetbatch import sdk
from jetbatch.sdk.connection import MAX_HEADER_BLOCK_BYTES, unreadable_messages
from jetbatch.sdk.protocol import DEFAULT_REPLY_PREFIXES, Headers, ProtocolError, ReplyPolicy, Subjects, parse_request_headers, subject_matches
from tests.helpers import make_config, running_classifier, running_worker, sleep_model, wait_until, worker_reports

pytestmark = pytest.mark.anyio


def _attacks(subjects: Subjects) -> list[str]:
    return [
        f"$JS.API.STREAM.DELETE.{subjects.models_stream}",
        f"$JS.API.STREAM.PURGE.{subjects.models_stream}",
        f"$JS.API.CONSUMER.DELETE.{subjects.models_stream}.model-m1",
        f"$JS.API.STREAM.DELETE.{subjects.dead_letter_stream}",
        f"$JS.API.STREAM.DELETE.{subjects.ingress_stream}",
        f"$KV.{subjects.kv_bucket}.forged",
        subjects.model("m2"),  # inject a "result" into another model's queue
        subjects.dead_letter("worker"),  # forge a dead letter
        "_INBOX",  # the bare prefix: no token of the caller's own
        "_INBOX..x",  # empty token: undeliverable
        "_INBOX.a b",  # a space would split the protocol line
        "_INBOX." + "x" * 5000,  # over the server's control line: it would close the connection
    ]


async def _spy(nc: Any, subjects: list[str]) -> list[str]:
    """Everything published on ``subjects`` from now on (a third party watching the targets)."""
    seen: list[str] = []

    async def on(msg: Any) -> None:
        seen.append(msg.subject)

    for s in subjects:
        await nc.subscribe(s, cb=on)
    await nc.flush()
    return seen


async def test_worker_publishes_nothing_where_a_request_aims_its_reply(nats_url: str, prefix: str) -> None:
    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5), "m2": sleep_model()}, worker={"max_resident_models": 2})
    async with running_worker(config, nats_url) as worker:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            seen = await _spy(nc, ["$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.CONSUMER.DELETE.>", f"$KV.{subjects.kv_bucket}.forged", subjects.model("m2")])
            # A backlog the purge would have wiped.
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                waiting = [asyncio.ensure_future(client.infer(f"w{i}".encode(), model="m1", timeout=30)) for i in range(10)]
                attacks = _attacks(subjects)
                for reply_to in attacks:
                    await js.publish(subjects.model("m1"), b"attacker-chosen body", headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: reply_to})
                assert sorted(await asyncio.gather(*waiting)) == sorted(f"w{i}".encode() for i in range(10))
                await wait_until(lambda: worker.stats["requests"] >= 10 + len(attacks), what="every attack handled")
                # The queues, the consumer and the DLQ are all still there, and nothing was injected.
                await js.stream_info(subjects.models_stream)
                await js.consumer_info(subjects.models_stream, "model-m1")
                dlq = await js.stream_info(subjects.dead_letter_stream)
                assert dlq.state.messages == len(attacks)  # each refused request kept, with its reason
                assert (await js.stream_info(subjects.models_stream, subjects_filter=subjects.model("m2"))).state.messages == 0
                assert seen == []
                reason = (await js.get_msg(subjects.dead_letter_stream, seq=dlq.state.first_seq)).headers[Headers.DLQ_REASON]
                assert "not allowed" in reason or "reply" in reason.lower()
                assert await client.infer(b"still serving", model="m1", timeout=10) == b"still serving"
        finally:
            await nc.close()


async def test_classifier_publishes_nothing_where_a_request_aims_its_reply(nats_url: str, prefix: str) -> None:
    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url), running_classifier(config, nats_url) as classifier:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            seen = await _spy(nc, ["$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.CONSUMER.DELETE.>"])
            for reply_to in _attacks(subjects):
                # One routable, one with a header the classifier must answer about itself.
                await js.publish(subjects.ingress, b"x", headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: reply_to})
                await js.publish(
                    subjects.ingress, b"x",
                    headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: reply_to, Headers.DEADLINE: "9" * 400},
                )  # fmt: skip
            await wait_until(lambda: classifier.stats["requests"] >= 2 * len(_attacks(subjects)), what="every attack classified")
            for stream in (subjects.ingress_stream, subjects.models_stream, subjects.dead_letter_stream):
                await js.stream_info(stream)
            assert seen == []
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                assert await client.infer(b"still serving", timeout=20) == b"still serving"
        finally:
            await nc.close()


async def test_a_refused_request_with_a_header_name_nats_py_cannot_write_is_still_dead_lettered(nats_url: str, prefix: str) -> None:
    """Found by an attack: the dead letter copies the request's headers, and nats-py refuses to
    publish a name that is not a token (``a(b``, which the server passes on from a raw client):
    the copy failed, and a hostile request erased its own record. Such names are left off the
    copy now, and its reason says so; the classifier's and the worker's dead letters alike."""
    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url), running_classifier(config, nats_url):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            for subject in (subjects.ingress, subjects.model("m1")):
                block = b"\r\n%s: %s\r\n%s: $JS.API.STREAM.DELETE.X\r\na(b: 1" % (
                    Headers.MSG_ID.encode(), uuid.uuid4().hex.encode(), Headers.REPLY_TO.encode())
                _raw_hpub(nats_url, subject, block, b"x")  # stored by the stream: a core publish, no PubAck asked
            letters: list[Any] = []

            async def both_kept() -> bool:
                state = (await js.stream_info(subjects.dead_letter_stream)).state
                letters[:] = [await js.get_msg(subjects.dead_letter_stream, seq=q) for q in range(state.first_seq, state.last_seq + 1)] if state.messages else []
                return len(letters) == 2

            await wait_until(both_kept, what="both refused requests dead-lettered")
            for letter in letters:
                assert "not allowed" in letter.headers[Headers.DLQ_REASON] or "reply" in letter.headers[Headers.DLQ_REASON].lower()
                assert "1 header(s) not copied" in letter.headers[Headers.DLQ_REASON]
                assert "a(b" not in letter.headers
            assert sorted(letter.headers[Headers.DLQ_STAGE] for letter in letters) == ["classifier", "worker"]
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                assert await client.infer(b"still serving", timeout=20) == b"still serving"
        finally:
            await nc.close()


async def test_a_producers_nats_headers_never_steer_the_sidecars_own_publishes(nats_url: str, prefix: str) -> None:
    """JetStream acts on Nats-* headers (Nats-Expected-Stream, Nats-Rollup, ...). A producer's
    must not ride along on what a sidecar publishes: a refused request copied with one into the
    dead-letter stream was refused there and vanished (no reply, no dead letter), and a classifier
    republish carrying one was refused by the model queue."""
    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url) as worker, running_classifier(config, nats_url):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                assert await client.infer(b"warm", model="m1", timeout=20) == b"warm"
                # Worker: a reply subject it refuses, and a header that matches the models stream
                # (so the request is queued) but not the dead-letter stream.
                await js.publish(
                    subjects.model("m1"), b"refused",
                    headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: f"$JS.API.STREAM.DELETE.{subjects.models_stream}",
                             "Nats-Expected-Stream": subjects.models_stream},
                )  # fmt: skip
                await wait_until(lambda: worker.stats["requests"] >= 2, what="the refused request handled")
                dlq = await js.stream_info(subjects.dead_letter_stream)
                assert dlq.state.messages == 1, "the refused request must be kept in the dead-letter stream"
                kept = await js.get_msg(subjects.dead_letter_stream, seq=dlq.state.last_seq)
                assert not any(k.lower().startswith("nats-") for k in (kept.headers or {})), kept.headers
                # Classifier: headers that match the ingress stream and nothing after it.
                steered = {"Nats-Expected-Stream": subjects.ingress_stream, "Nats-Expected-Last-Subject-Sequence": "0"}
                assert await client.infer(b"routed anyway", headers=steered, timeout=20) == b"routed anyway"
                # No reply subject at all: computed and stored for a caller that reads the store.
                quiet = uuid.uuid4().hex
                await js.publish(subjects.model("m1"), b"no reply wanted", headers={Headers.MSG_ID: quiet})

                async def stored() -> bool:
                    try:
                        await js.get_msg(subjects.results_stream, subject=subjects.result(quiet), direct=True)
                    except nats.js.errors.NotFoundError:
                        return False
                    return True

                await wait_until(stored, what="the result of a request without a reply subject in the store")
                assert (await js.get_msg(subjects.results_stream, subject=subjects.result(quiet), direct=True)).data == b"no reply wanted"
                assert await client.infer(b"still serving", model="m1", timeout=20) == b"still serving"
        finally:
            await nc.close()


async def test_absurd_deadlines_and_huge_reply_subjects_get_bad_request_and_the_sidecars_keep_serving(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url), running_classifier(config, nats_url):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            inbox = nc.new_inbox()
            sub = await nc.subscribe(f"{inbox}.*")
            for i, deadline in enumerate(["9" * 400, "1e30", "-5", "12.5", "0x10", "inf"]):
                for subject in (Subjects(prefix).model("m1"), Subjects(prefix).ingress):
                    await js.publish(subject, b"x", headers={Headers.MSG_ID: f"d{i}{len(subject)}", Headers.REPLY_TO: f"{inbox}.d{i}", Headers.DEADLINE: deadline})
                    reply = await sub.next_msg(timeout=10)
                    assert reply.headers[Headers.ERROR_CODE] == "bad_request"
                    assert "Jetbatch-Deadline" in sdk.protocol.decode_error(reply.data).message
            for subject in (Subjects(prefix).model("m1"), Subjects(prefix).ingress):
                await js.publish(subject, b"x", headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: f"{inbox}." + "y" * 5000})
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                assert await client.infer(b"direct", model="m1", timeout=10) == b"direct"
                assert await client.infer(b"routed", timeout=10) == b"routed"
        finally:
            await nc.close()


async def test_a_tenant_cannot_aim_replies_at_another_tenants_inbox(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url), running_classifier(config, nats_url) as classifier:
        victim_nc = await nats.connect(nats_url, inbox_prefix="_INBOX.app1")
        attacker = await nats.connect(nats_url, inbox_prefix="_INBOX.app2")
        try:
            seen = await _spy(victim_nc, ["_INBOX.app1.>"])
            # app2 may publish only to <prefix>.in.app2 (server permissions in docs/security.md).
            await attacker.jetstream().publish(
                Subjects(prefix).tenant_ingress("app2"), b"forged",
                headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: "_INBOX.app1.victim.r1", Headers.TENANT: "app1"},
            )  # fmt: skip
            await wait_until(lambda: classifier.stats["errors"] >= 1, what="the forged request refused")
            async with sdk.Client.connect(nats_url, prefix=prefix, tenant="app2") as app2:
                assert await app2.infer(b"own inbox", timeout=10) == b"own inbox"  # its own replies still work
            async with sdk.Client.connect(nats_url, prefix=prefix, tenant="app1") as app1:
                assert await app1.infer(b"app1", timeout=10) == b"app1"
            assert not [s for s in seen if s.startswith("_INBOX.app1.victim")]
        finally:
            await victim_nc.close()
            await attacker.close()


async def test_a_message_forged_onto_a_sidecars_pull_inbox_is_neither_answered_nor_settled(nats_url: str, prefix: str) -> None:
    """A sidecar's pull inbox is named in each pull request it sends, so whoever can see those
    and publish there can send it a message that looks like a request. Taken as a delivery, the
    worker answered it under the tenant and key its headers claimed and settled it by
    publishing to the reply subject the forger chose (found by sending one). Both sidecars drop
    it, count it (``forged_deliveries``), and keep serving."""
    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)}, classifier={"router": "rules", "default_model": "m1"})
    async with running_worker(config, nats_url) as worker, running_classifier(config, nats_url) as classifier:
        nc = await nats.connect(nats_url)
        try:
            pulls = await nc.subscribe("$JS.API.CONSUMER.MSG.NEXT.>")
            forged_id = uuid.uuid4().hex
            seen = await _spy(nc, ["forged.>", f"{subjects.prefix}.result.*.*.{forged_id}", f"{subjects.prefix}.result.{forged_id}"])
            inboxes: dict[str, str] = {}
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                assert await client.infer(b"first", timeout=20) == b"first"  # both sidecars have pulled
                while len(inboxes) < 2:
                    pull = await pulls.next_msg(timeout=10)
                    stream = pull.subject.split(".")[5]
                    inboxes.setdefault(stream, pull.reply)
                assert set(inboxes) == {subjects.ingress_stream, subjects.models_stream}
                headers = {Headers.MSG_ID: forged_id, Headers.TENANT: "app1", Headers.REPLY_KEY: "k1", Headers.MODEL: "m1"}
                for inbox in inboxes.values():
                    await nc.publish(inbox, b"forged", reply="forged.ack", headers=headers)
                await nc.flush()
                await wait_until(lambda: worker.report().stats["forged_deliveries"] == 1, what="the worker's forgery dropped")
                await wait_until(lambda: classifier.pull_counts()["forged_deliveries"] == 1, what="the classifier's forgery dropped")
                for i in range(3):  # the next fetches find nothing forged in the buffers
                    assert await client.infer(f"r{i}".encode(), timeout=20) == f"r{i}".encode()
                    assert await client.infer(f"d{i}".encode(), model="m1", timeout=20) == f"d{i}".encode()
            assert seen == []
        finally:
            await nc.close()


async def test_a_caller_cannot_aim_a_reply_at_the_inbox_where_a_workers_pubacks_come(nats_url: str, prefix: str) -> None:
    """An answer's own publish carries its worker's PubAck subject as its reply, and every
    subscriber of the answer sees it. A protocol-2 caller that aimed a reply at one still waiting,
    through another worker (which cannot know its peer's inbox), would hand the first a PubAck it
    wrote (the answer's body is the caller's). Every sidecar inbox carries one mark, and no
    sidecar answers there: refused and dead-lettered, and both workers keep serving."""
    subjects = Subjects(prefix)
    a = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)}, worker={"id": "a"})
    b = make_config(prefix, {"m2": sleep_model(max_delay_ms=5)}, worker={"id": "b"})
    async with running_worker(a, nats_url), running_worker(b, nats_url):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            answers = await nc.subscribe(subjects.results_wildcard)
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                assert await client.infer(b"to b", model="m2", timeout=20) == b"to b"
                seen = (await answers.next_msg(timeout=10)).reply  # b's PubAck subject
                inbox, token = seen.rsplit(".", 1)
                assert seen.startswith("_INBOX.") and len(token) == 16  # in sight of the caller (the token is random)
                forged_ack = json.dumps({"stream": subjects.results_stream, "seq": 1}).encode()
                headers = {Headers.MSG_ID: uuid.uuid4().hex, Headers.REPLY_TO: f"{inbox}.{token}"}
                await js.publish(subjects.model("m1"), forged_ack, headers=headers)  # served by a
                dlq: list[Any] = []

                async def refused() -> bool:
                    dlq[:] = [(await js.stream_info(subjects.dead_letter_stream)).state]
                    return dlq[0].messages == 1

                await wait_until(refused, what="the request aimed at b's inbox dead-lettered")
                reason = (await js.get_msg(subjects.dead_letter_stream, seq=dlq[0].first_seq)).headers[Headers.DLQ_REASON]
                assert "sidecar's own inbox" in reason
                assert await client.infer(b"still serving", model="m2", timeout=20) == b"still serving"
                assert await client.infer(b"a too", model="m1", timeout=20) == b"a too"
        finally:
            await nc.close()


def _raw_hpub(url: str, subject: str | bytes, header_block: bytes, payload: bytes, reply: bytes = b"") -> None:
    """One HPUB written on a socket of its own, bytes as given (nats-py encodes what it sends)."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    raw_subject = subject if isinstance(subject, bytes) else subject.encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.recv(4096)  # INFO
        head = b"NATS/1.0" + header_block + b"\r\n\r\n"
        args = raw_subject + (b" " + reply if reply else b"")
        sock.sendall(
            b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n'
            + b"HPUB %s %d %d\r\n" % (args, len(head), len(head) + len(payload)) + head + payload + b"\r\nPING\r\n"
        )
        seen = b""
        while b"PONG" not in seen:
            chunk = sock.recv(4096)
            assert chunk and b"-ERR" not in chunk, chunk
            seen += chunk


def _unreadable(listened: str) -> list[tuple[bytes, bytes, bytes]]:
    """What nats-py 2.16 decodes in its read loop outside any try, each as (subject, header block,
    reply subject) for a subscriber of ``listened`` (which ends in a wildcard token): a status
    line, a reply subject and a subject token that are not UTF-8."""
    parent = listened.encode().rsplit(b".", 1)[0]
    return [(parent + b".r1", b" \xff\xfe\xfd", b""), (parent + b".r1", b"", b"_INBOX.\xff\xfe"), (parent + b".\xff", b"", b"")]


async def test_bytes_nats_py_cannot_read_stop_no_connections_reading(nats_url: str, prefix: str) -> None:
    """Found by attacks: nats-py decodes a message's inline status ("NATS/1.0 <status>"), subject
    and reply subject outside its try, so one message with bytes that are not UTF-8 there ended
    the connection's read loop for good, with the connection still "connected". Any tenant may
    publish to its cancel subject, which every worker reads, with any reply subject: one such
    message and no worker read another delivery, and every producer timed out; sent to a caller's
    answer subject, that caller timed out on everything after. jetbatch's connections drop such a
    message, count it, and go on; so does a caller's own connection handed to
    ``Client.from_connection``."""
    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"before", model="m1", timeout=10) == b"before"
            for listened in (subjects.cancel_wildcard, subjects.answers(client._key)):
                for subject, status, reply in _unreadable(listened):
                    _raw_hpub(nats_url, subject, status, b"x", reply=reply)
            _raw_hpub(nats_url, subjects.cancel(), b"", b"x", reply=b"_INBOX.\xff")  # the untenanted cancel subject
            for i in range(3):
                assert await client.infer(f"after {i}".encode(), model="m1", timeout=10) == f"after {i}".encode()
            assert client.nats.is_connected
            assert unreadable_messages(client.nats) == 3  # the three sent to its answers
            reports = await worker_reports(nats_url, prefix)
            assert [r.stats["unreadable_messages"] for r in reports] == [4]  # the four sent to cancel subjects
        # A caller's own connection, handed to the SDK, is guarded the same way.
        nc = await nats.connect(nats_url)
        try:
            async with await sdk.Client.from_connection(nc, prefix=prefix) as client:
                assert await client.infer(b"before", model="m1", timeout=10) == b"before"
                for subject, status, reply in _unreadable(subjects.answers(client._key)):
                    _raw_hpub(nats_url, subject, status, b"x", reply=reply)
                assert await client.infer(b"after", model="m1", timeout=10) == b"after"
                assert unreadable_messages(nc) == 3
        finally:
            await nc.close()


async def test_a_header_block_larger_than_jetstream_stores_is_dropped_unread(nats_url: str, prefix: str) -> None:
    """Found by an attack: nats-py parses a header block into a dict inside the read loop, before
    any limit: an 8 MiB block of tiny headers on a core subject (a tenant's cancel subject, which
    every worker reads; a caller's answers) held the loop 0.7 s and 82 MB, and a burst got the
    connection cut as a slow consumer. A block over what JetStream stores (65 535 bytes) plus
    the server's republish headers is now dropped unread; a request whose headers JetStream did
    store is still served, its arrival event and delivery read as before."""
    subjects = Subjects(prefix)
    tiny_lines = b"".join(b"\r\nk%d:" % i for i in range(60_000))  # about 500 KiB, 60 000 headers
    assert len(tiny_lines) > MAX_HEADER_BLOCK_BYTES
    config = make_config(prefix, {"m1": sleep_model(max_delay_ms=5)})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"before", model="m1", timeout=10) == b"before"
            _raw_hpub(nats_url, subjects.cancel("app1"), tiny_lines, b"x")
            _raw_hpub(nats_url, subjects.answers(client._key).removesuffix("*") + "r1", tiny_lines, b"x")
            big = {"X-Big": "a" * 64_000}  # JetStream stores it: read on every hop
            assert await client.infer(b"big headers", model="m1", timeout=10, headers=big) == b"big headers"
            assert await client.infer(b"after", model="m1", timeout=10) == b"after"
            assert unreadable_messages(client.nats) == 1
            # The cancel subject is read on a connection of its own, in no order with the answers.

            async def counted() -> bool:
                return [r.stats["unreadable_messages"] for r in await worker_reports(nats_url, prefix)] == [1]

            await wait_until(counted, timeout_s=10, what="the worker's count of unreadable messages")


# --- the parser itself ---------------------------------------------------------------------------

POLICY = ReplyPolicy(forbidden_prefixes=("jetbatch",))


@pytest.mark.parametrize(
    "subject",
    ["$JS.API.STREAM.DELETE.X", "$KV.b.k", "$SYS.REQ", "jetbatch.model.m1", "jetbatch", "_INBOX", "_INBOX.", "_INBOX..a",
     "_INBOX.a.", "_INBOX.*", "_INBOX.>", "_INBOX.a b", "_INBOX.\x00", "_INBOX.é", "other.inbox.x", "_INBOX." + "x" * 300],
)  # fmt: skip
def test_reply_policy_refuses(subject: str) -> None:
    with pytest.raises(ProtocolError):
        POLICY.check(subject)


def test_a_sidecars_own_inbox_namespace_is_never_a_reply_target() -> None:
    """With least privilege each sidecar has an inbox namespace of its own (docs/security.md),
    and every sidecar connection's inboxes carry a mark (``_INBOX._jbs<hex>.``): its pull
    requests' and PubAcks' replies come there, and an answer the caller chose, sent there, would
    pose as one. The default ``_INBOX`` is the callers' too, and stays allowed."""
    config = make_config(
        "jb", {"m1": sleep_model()},
        nats={"inbox_prefix": "_INBOX.worker", "reply_identity": {"user": "r", "password": "p", "inbox_prefix": "_INBOX.worker-replies"}},
    )  # fmt: skip
    policy = config.reply_policy
    for subject in ("_INBOX.worker.Zx81.1", "_INBOX.worker-replies.Zx81.7", "_INBOX.worker", "_INBOX._jbs3f9a0c1b2d4e.Zx81.1", "_INBOX.app._jbs1.x"):
        with pytest.raises(ProtocolError):
            policy.check(subject)
    with pytest.raises(ProtocolError):
        policy.check("_INBOX.worker.Zx81.1", tenant="worker")  # a tenant that shares the name
    assert policy.check("_INBOX.workers.abc.r1") == "_INBOX.workers.abc.r1"
    assert policy.check("_INBOX.app1.abc", tenant="app1") == "_INBOX.app1.abc"
    assert make_config("jb", {"m1": sleep_model()}).reply_policy.forbidden_prefixes == ("jb",)


def test_reply_policy_allows_inboxes_and_binds_tenants() -> None:
    assert POLICY.check("_INBOX.abc.r1") == "_INBOX.abc.r1"
    assert POLICY.check("_INBOX.app1.abc", tenant="app1")
    with pytest.raises(ProtocolError):
        POLICY.check("_INBOX.app2.abc", tenant="app1")
    assert DEFAULT_REPLY_PREFIXES == ("_INBOX",)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([Headers.MSG_ID, Headers.REPLY_TO, Headers.REPLY_KEY, Headers.DEADLINE, Headers.CONTENT_TYPE,
                                        Headers.MODEL, Headers.TRACEPARENT, Headers.TRACESTATE, "X-Other"]),
                       st.one_of(st.text(max_size=600), st.sampled_from(["k1", "a.b", "*", ">", "_INBOX.x", "k\n", "x" * 65]))),
       st.sampled_from([None, "t1"]))  # fmt: skip
def test_header_parser_never_raises_and_keeps_its_limits(headers: dict[str, str], tenant: str | None) -> None:
    meta = parse_request_headers(headers, policy=POLICY, fallback_id="fallback", tenant=tenant)
    assert meta.reply_to is None or (meta.reply_to.startswith("_INBOX.") and len(meta.reply_to) <= 255)
    if meta.reply_key is not None:
        # Wherever the answer goes, it is one of the deployment's answer subjects, under the
        # tenant the sidecar knows: exactly five tokens, the last three never wildcards.
        subject = Subjects("jb").answer(meta.request_id, meta.reply_key, meta.tenant)
        tokens = subject.split(".")
        assert tokens[:3] == ["jb", "result", tenant or "_"] and len(tokens) == 5
        assert not {"*", ">"} & set(tokens) and subject_matches("jb.result.*.*.*", subject)
    assert meta.deadline is None or 0 <= meta.deadline < 10**13
    assert 1 <= len(meta.request_id) <= 64
    if meta.problem is None:
        # With a key the reply subject is not used, nor checked.
        assert meta.reply_to == (None if Headers.REPLY_KEY in headers else headers.get(Headers.REPLY_TO))


async def test_results_are_not_readable_without_the_request_id(nats_url: str, prefix: str) -> None:
    """The results store keys answers by request id (unguessable from the SDK): a missing id is
    simply not found, and nothing lists another caller's answers through the SDK."""
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"secret", model="m1", timeout=10)
            with pytest.raises(nats.js.errors.NotFoundError):
                await client.nats.jetstream().get_msg(Subjects(prefix).results_stream, subject=Subjects(prefix).result("not-my-id"), direct=True)


async def test_status_requests_cannot_aim_the_answer_at_the_jetstream_api(nats_url: str, prefix: str) -> None:
    """The status responder obeys the same reply allowlist: a status request with a reply subject
    naming the JetStream API or a queue gets no answer there; an inbox gets one."""
    subjects = Subjects(prefix)
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            seen = await _spy(nc, ["$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", subjects.model("m2")])
            for reply_to in _attacks(subjects)[:7]:
                await nc.publish(subjects.status_subject, b"", reply=reply_to)
            answers = await worker_reports(nats_url, prefix)  # an inbox still gets the report
            assert [r.role for r in answers] == ["worker"]
            await nc.flush()
            assert seen == []
            await js.stream_info(subjects.models_stream)
            await js.stream_info(subjects.dead_letter_stream)
        finally:
            await nc.close()


async def test_an_answer_the_sdk_cannot_read_is_a_typed_error(nats_url: str, prefix: str) -> None:
    """Found by an attack: whoever may publish on a caller's answer subject (a worker or reply
    identity, or anyone on a server without authorization) answered first with a tensor whose
    shape made decoding raise ValueError: ``infer`` raised it untyped (and, at 60 000 dimensions,
    held the caller's loop 7 s past its timeout); a ``Jetbatch-Status`` the protocol does not
    know was read as success, its body handed back as the output. Both are JetbatchError now."""
    subjects = Subjects(prefix)
    slow = sleep_model(options={"load_cost_s": 0.0, "batch_cost_s": 1.0, "item_cost_s": 0.0})  # the forger answers first
    forgeries = [
        ({Headers.STATUS: "maybe", Headers.CONTENT_TYPE: "application/octet-stream"}, b"forged", "unknown Jetbatch-Status 'maybe'"),
        ({Headers.STATUS: "ok", Headers.CONTENT_TYPE: "application/vnd.jetbatch.tensor+msgpack"},
         msgspec.msgpack.encode({"dtype": "float32", "shape": [2**64 - 1] * 60_000, "data": b""}), "undecodable reply"),
        ({Headers.STATUS: "ok", Headers.CONTENT_TYPE: "application/vnd.jetbatch.tensors+msgpack"},
         msgspec.msgpack.encode([{"dtype": "float32", "shape": [2**64 - 1] * 300, "data": b""}]), "undecodable reply"),
    ]
    async with running_worker(make_config(prefix, {"m1": slow}), nats_url):
        forger = await nats.connect(nats_url)
        try:
            pending: list[tuple[dict[str, str], bytes]] = []

            async def forge(msg: Any) -> None:
                headers, body = pending.pop(0)
                rid, key = msg.headers[Headers.MSG_ID], msg.headers[Headers.REPLY_KEY]
                await forger.publish(subjects.answer(rid, key), body, headers={**headers, Headers.REQUEST_ID: rid})

            await forger.subscribe(subjects.model("m1"), cb=forge)
            await forger.flush()
            async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                for headers, body, match in forgeries:
                    pending.append((headers, body))
                    with pytest.raises(sdk.JetbatchError, match=match) as caught:
                        await client.infer(b"x", model="m1", timeout=10)
                    assert not isinstance(caught.value, ProtocolError)  # the SDK's reply error, not a bare decode error
        finally:
            await forger.close()
