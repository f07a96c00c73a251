"""`jetbatch dlq`: list, show, replay and purge dead letters on a real server."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import nats
import pytest

from jetbatch.sdk.protocol import Headers, Subjects, replay_id, request_id_of
from jetbatch.sidecar.config import StreamsConfig
from jetbatch.sidecar.streams import ensure_model_consumer, ensure_streams
from tests.helpers import make_config, running_worker, sleep_model

pytestmark = pytest.mark.anyio


def dlq(nats_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jetbatch", "dlq", *args, "--nats-url", nats_url, "--prefix", prefix],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


async def test_list_show_replay_purge(nats_url: str, prefix: str) -> None:
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js, subjects, StreamsConfig(), ["m1"])
    await ensure_model_consumer(js, subjects, StreamsConfig(), "m1")
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    # Two dead letters as a worker writes them: original headers plus the reason.
    for i in range(2):
        rid = uuid.uuid4().hex
        await js.publish(
            subjects.dead_letter("worker"), f"payload{i}".encode(),
            headers={Headers.REPLY_TO: inbox, Headers.CONTENT_TYPE: "application/octet-stream", Headers.REQUEST_ID: rid,
                     Headers.DLQ_REASON: f"reason {i}", Headers.DLQ_STAGE: "worker", Headers.DLQ_SUBJECT: subjects.model("m1"),
                     Headers.DLQ_DELIVERIES: "5"},
        )  # fmt: skip
    listed = dlq(nats_url, prefix, "list", "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["reason"] for r in rows] == ["reason 0", "reason 1"] and rows[0]["deliveries"] == 5 and rows[0]["bytes"] == 8
    shown = dlq(nats_url, prefix, "show", str(rows[0]["seq"]), "--json")
    assert json.loads(shown.stdout)["payload_preview"] == "payload0" and json.loads(shown.stdout)["deliveries"] == 5
    # Without --json: lines for a person, not JSON.
    lines = dlq(nats_url, prefix, "show", str(rows[0]["seq"])).stdout.splitlines()
    assert lines[0] == f"dead letter {rows[0]['seq']}" and "  reason      reason 0" in lines, lines
    assert "  payload     8 bytes: payload0" in lines and not lines[0].startswith("{"), lines
    # Replay the first to its model queue: a worker answers it on the original reply-to.
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        replayed = dlq(nats_url, prefix, "replay", str(rows[0]["seq"]))
        assert replayed.returncode == 0 and replayed.stdout.strip() == "replayed 1 dead letter", replayed.stdout
        reply = await replies.next_msg(timeout=20)
    assert reply.data == b"payload0" and reply.headers[Headers.STATUS] == "ok"
    left = [json.loads(line) for line in dlq(nats_url, prefix, "list", "--json").stdout.splitlines()]
    assert [r["reason"] for r in left] == ["reason 1"]
    refused = dlq(nats_url, prefix, "purge")  # no terminal to ask on: refused, nothing deleted
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert dlq(nats_url, prefix, "purge", "--yes").stdout.strip() == "purged 1 dead letter"
    assert dlq(nats_url, prefix, "list").stdout.strip() == "no dead letters"
    nothing = dlq(nats_url, prefix, "replay", "--all")  # an empty queue: done, not "no dead letter with sequence None"
    assert nothing.returncode == 0 and nothing.stdout.strip() == "no dead letters", nothing.stdout + nothing.stderr
    missing = dlq(nats_url, prefix, "show", "999")
    assert missing.returncode == 2 and missing.stderr.strip() == "jetbatch dlq: no dead letter with sequence 999"
    await nc.close()


def test_dlq_without_the_stream_is_a_one_line_error(nats_url: str) -> None:
    proc = dlq(nats_url, f"none{uuid.uuid4().hex[:6]}", "list")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no dead-letter stream" in proc.stderr


async def test_replay_never_publishes_where_a_forged_letter_points(nats_url: str, prefix: str) -> None:
    """A dead letter is data in a stream: one whose original-subject header aims at the JetStream
    API must not make the operator's replay (run with admin credentials) delete the queues."""
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await ensure_streams(js, subjects, StreamsConfig(), ["m1"])
        target = f"$JS.API.STREAM.DELETE.{subjects.models_stream}"
        await js.publish(
            subjects.dead_letter("worker"), b"{}",
            headers={Headers.DLQ_SUBJECT: target, Headers.DLQ_REASON: "forged", Headers.REQUEST_ID: uuid.uuid4().hex},
        )  # fmt: skip
        replayed = dlq(nats_url, prefix, "replay", "--all")
        assert replayed.returncode == 1, replayed.stdout + replayed.stderr
        assert "not a queue of this deployment" in replayed.stderr
        await js.stream_info(subjects.models_stream)  # still there
        assert (await js.stream_info(subjects.dead_letter_stream)).state.messages == 1  # kept for a look
    finally:
        await nc.close()


async def test_a_letter_with_a_header_that_is_not_utf8_is_listed_shown_and_replayed(nats_url: str, prefix: str) -> None:
    """Found by an attack: a producer's request whose header value held bytes that are not UTF-8,
    copied into the dead-letter stream, broke `dlq list` (plain and --json), `show` and `replay
    --all` with tracebacks: nats-py reads a stored message's headers with the email parser, which
    gives such a value as a ``Header`` object. Now it is shown with replacement characters, and
    replayed without that header (its bytes cannot be sent again as they were); the letter after
    it is replayed too."""
    from tests.test_hostile_input import _raw_hpub

    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await ensure_streams(js, subjects, StreamsConfig(), ["m1"])
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        block = (b"\r\n%s: %s\r\n%s: bad bytes\r\n%s: worker\r\n%s: r-bin\r\n%s: %s\r\nX-Note: ab\xff\xfe\x80cd" % (
            Headers.DLQ_SUBJECT.encode(), subjects.model("m1").encode(), Headers.DLQ_REASON.encode(), Headers.DLQ_STAGE.encode(),
            Headers.REQUEST_ID.encode(), Headers.REPLY_TO.encode(), inbox.encode()))  # fmt: skip
        _raw_hpub(nats_url, subjects.dead_letter("worker"), block, b"first")
        await js.publish(
            subjects.dead_letter("worker"), b"second",
            headers={Headers.DLQ_SUBJECT: subjects.model("m1"), Headers.DLQ_REASON: "plain", Headers.REQUEST_ID: "r-plain", Headers.REPLY_TO: inbox},
        )  # fmt: skip
        listed = dlq(nats_url, prefix, "list")
        assert listed.returncode == 0 and "bad bytes" in listed.stdout and "plain" in listed.stdout, listed.stderr
        rows = [json.loads(line) for line in dlq(nats_url, prefix, "list", "--json").stdout.splitlines()]
        assert [r["request_id"] for r in rows] == ["r-bin", "r-plain"]
        shown = dlq(nats_url, prefix, "show", str(rows[0]["seq"]), "--json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["headers"]["X-Note"].startswith("ab"), shown.stderr
        plain = dlq(nats_url, prefix, "show", str(rows[0]["seq"]))
        assert plain.returncode == 0 and any(line.startswith("    X-Note: ab") for line in plain.stdout.splitlines()), plain.stdout
        async with running_worker(make_config(prefix, {"m1": sleep_model()}), nats_url):
            replayed = dlq(nats_url, prefix, "replay", "--all")
            assert replayed.returncode == 0 and "replayed 2" in replayed.stdout, replayed.stdout + replayed.stderr
            assert "X-Note is not UTF-8" in replayed.stderr and "Traceback" not in replayed.stderr
            answers = {(await replies.next_msg(timeout=20)).data for _ in range(2)}
        assert answers == {b"first", b"second"}
    finally:
        await nc.close()


async def test_replay_reads_the_letters_own_headers_in_any_case(nats_url: str, prefix: str) -> None:
    """Found by an attack: the letter's own headers were taken off case-sensitively, so a crafted
    letter's `jetbatch-dlq-subject` and `jetbatch-dlq-reason` went on into the queue with the
    request. They are the letter's, in any case: read as its subject and left off."""
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await ensure_streams(js, subjects, StreamsConfig(), ["m1"])
        await js.publish(
            subjects.dead_letter("worker"), b"lower",
            headers={"jetbatch-dlq-subject": subjects.model("m1"), "jetbatch-dlq-reason": "crafted", "jetbatch-request-id": "r-lower",
                     Headers.DLQ_REASON: "both spellings", "JETBATCH-REQUEST-ID": "r-upper"},
        )  # fmt: skip
        replayed = dlq(nats_url, prefix, "replay", "--all")
        assert replayed.returncode == 0 and "replayed 1" in replayed.stdout, replayed.stdout + replayed.stderr
        queued = await js.get_msg(subjects.models_stream, seq=1, subject=subjects.model("m1"), next=True)
        names = {k.lower() for k in (queued.headers or {})}
        assert queued.data == b"lower" and not {n for n in names if n.startswith("jetbatch-dlq-")}, queued.headers
        assert "jetbatch-request-id" not in names, queued.headers  # every spelling taken off
        assert (queued.headers or {}).get("Nats-Msg-Id") in ("r-lower.replay-1", "r-upper.replay-1")
    finally:
        await nc.close()


def test_a_replay_id_keeps_the_request_id() -> None:
    """A replay's message id is new to JetStream, yet every reader takes the request id from it."""
    assert request_id_of(replay_id("abc", 7), None) == "abc"
    assert request_id_of(replay_id("t1.abc", 7), "t1") == "abc"
    assert replay_id(replay_id("abc", 7), 9) == "abc.replay-9"  # a letter replayed before: one mark
    assert request_id_of("t1.abc.replay-7", None) == "t1.abc"  # still dotted: refused as before


async def _letter_of_a_request_just_taken(js: Any, subjects: Subjects, inbox: str) -> tuple[str, int]:
    """A request stored in the models stream and gone from it (as a worker takes it), then its dead
    letter as a worker writes one: the request's id is in the duplicate window."""
    rid = uuid.uuid4().hex
    ack = await js.publish(subjects.model("m1"), b"again", headers={Headers.MSG_ID: rid, Headers.REPLY_TO: inbox})
    await js.delete_msg(subjects.models_stream, ack.seq)
    letter = await js.publish(
        subjects.dead_letter("worker"), b"again",
        headers={Headers.REPLY_TO: inbox, Headers.REQUEST_ID: rid, Headers.DLQ_REASON: "crashed", Headers.DLQ_STAGE: "worker",
                 Headers.DLQ_SUBJECT: subjects.model("m1"), Headers.DLQ_DELIVERIES: "5"},
    )  # fmt: skip
    return rid, letter.seq


async def test_a_replay_within_the_duplicate_window_is_queued_and_answered(nats_url: str, prefix: str) -> None:
    """Replayed under its request's own Nats-Msg-Id, a letter replayed within two minutes of the
    request was dropped by JetStream as a duplicate, while the command said "replayed 1" and
    deleted the letter: the request was lost. It is queued again under a replay id, and answered
    under its own request id."""
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await ensure_streams(js, subjects, StreamsConfig(), ["m1"])
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        rid, seq = await _letter_of_a_request_just_taken(js, subjects, inbox)
        before = (await js.stream_info(subjects.models_stream)).state.last_seq
        replayed = dlq(nats_url, prefix, "replay", str(seq))
        assert replayed.returncode == 0 and "replayed 1" in replayed.stdout, replayed.stdout + replayed.stderr
        queued = await js.get_msg(subjects.models_stream, seq=before + 1)  # stored, not dropped
        assert queued.data == b"again" and queued.headers[Headers.MSG_ID] == f"{rid}.replay-{seq}", queued.headers
        assert (await js.stream_info(subjects.dead_letter_stream)).state.messages == 0
        async with running_worker(make_config(prefix, {"m1": sleep_model()}), nats_url):
            reply = await replies.next_msg(timeout=20)
        assert reply.data == b"again" and reply.headers[Headers.REQUEST_ID] == rid, reply.headers
    finally:
        await nc.close()


async def test_a_replay_jetstream_drops_as_a_duplicate_keeps_its_letter(nats_url: str, prefix: str) -> None:
    """The PubAck decides: a republish JetStream took for a duplicate was not queued, so the
    letter stays, and the command says so in one line and exits 1."""
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await ensure_streams(js, subjects, StreamsConfig(), ["m1"])
        rid, seq = await _letter_of_a_request_just_taken(js, subjects, nc.new_inbox())
        await js.publish(subjects.model("m1"), b"earlier", headers={Headers.MSG_ID: replay_id(rid, seq)})  # an earlier replay's id
        replayed = dlq(nats_url, prefix, "replay", str(seq))
        assert replayed.returncode == 1, replayed.stdout + replayed.stderr
        assert replayed.stdout.strip() == "replayed 0 of 1 dead letter"
        assert len(replayed.stderr.strip().splitlines()) == 1 and "duplicate" in replayed.stderr and "letter kept" in replayed.stderr
        assert (await js.stream_info(subjects.dead_letter_stream)).state.messages == 1
    finally:
        await nc.close()
