"""`jetbatch dlq`: list, show, replay and purge dead letters on a real server."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import nats
import pytest

from jetbatch.sdk.protocol import Headers, Subjects
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
    assert [r["reason"] for r in rows] == ["reason 0", "reason 1"] and rows[0]["deliveries"] == "5"
    shown = dlq(nats_url, prefix, "show", str(rows[0]["seq"]))
    assert json.loads(shown.stdout)["payload_preview"] == "payload0"
    # Replay the first to its model queue: a worker answers it on the original reply-to.
    config = make_config(prefix, {"m1": sleep_model()})
    async with running_worker(config, nats_url):
        replayed = dlq(nats_url, prefix, "replay", str(rows[0]["seq"]))
        assert replayed.returncode == 0 and "replayed 1" in replayed.stdout
        reply = await replies.next_msg(timeout=20)
    assert reply.data == b"payload0" and reply.headers[Headers.STATUS] == "ok"
    left = [json.loads(line) for line in dlq(nats_url, prefix, "list", "--json").stdout.splitlines()]
    assert [r["reason"] for r in left] == ["reason 1"]
    refused = dlq(nats_url, prefix, "purge")  # no terminal to ask on: refused, nothing deleted
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert "purged 1" in dlq(nats_url, prefix, "purge", "--yes").stdout
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
        shown = dlq(nats_url, prefix, "show", str(rows[0]["seq"]))
        assert shown.returncode == 0 and json.loads(shown.stdout)["headers"]["X-Note"].startswith("ab"), shown.stderr
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
        assert (queued.headers or {}).get("Nats-Msg-Id") in ("r-lower", "r-upper")
    finally:
        await nc.close()
