"""Health and readiness: every sidecar answers status requests; `jetbatch status` lists them."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from jetbatch import sdk
from jetbatch.sidecar.status import collect_status
from tests.helpers import make_config, running_worker, sleep_model, wait_until

pytestmark = pytest.mark.anyio


async def test_worker_answers_status_and_cli_shows_cluster_view(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model(), "m2": sleep_model()})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"x", model="m1", timeout=10)
            # The answer reaches the caller before the worker has its stored copy confirmed and
            # counts the request: wait for the count, not for a fixed time.
            await wait_until(lambda: worker.stats["requests"] == 1, what="the request counted")
            reports = await collect_status(client.nats, config.subjects, wait_s=0.3)
        assert [(r.role, r.id) for r in reports] == [("worker", worker.worker_id)]
        report = reports[0]
        assert report.models == ["m1", "m2"] and report.resident == ["m1"]
        assert report.stats["requests"] == 1 and report.version
        proc = await anyio.run_process(
            [sys.executable, "-m", "jetbatch", "status", "--nats-url", nats_url, "--prefix", prefix], check=False
        )
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    assert worker.worker_id[:27] in out
    assert any(line.startswith("m1") and worker.worker_id in line for line in out.splitlines()), out


def test_status_with_nobody_listening(nats_url: str, prefix: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jetbatch", "status", "--nats-url", nats_url, "--prefix", prefix, "--wait", "0.2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "no jetbatch sidecar answered" in proc.stdout


async def test_sidecars_are_listed_by_the_nats_micro_protocol(nats_url: str, prefix: str) -> None:
    """What `nats micro ls/info/stats` sends, from a plain nats-py client: PING finds the worker,
    INFO names its status endpoint, STATS carries its report (models, residency, counters); and a
    control request whose reply names the JetStream API gets no answer there."""
    import json

    import nats

    from jetbatch.sdk.protocol import Subjects

    config = make_config(prefix, {"m1": sleep_model(), "m2": sleep_model()}, worker={"max_resident_models": 2})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"x", model="m1", timeout=10) == b"x"
        await wait_until(lambda: worker.stats["requests"] >= 1, what="the request counted")
        nc = await nats.connect(nats_url)
        try:
            inbox = nc.new_inbox()
            answers: list[dict] = []
            async def on_answer(m: object) -> None:
                await _append(answers, m)

            sub = await nc.subscribe(inbox, cb=on_answer)
            await nc.publish("$SRV.PING.jetbatch-worker", b"", reply=inbox)
            await wait_until(lambda: any(a.get("metadata", {}).get("prefix") == prefix for a in answers), what="a PING answer")
            ping = next(a for a in answers if a["metadata"]["prefix"] == prefix)
            assert ping["type"] == "io.nats.micro.v1.ping_response" and ping["name"] == "jetbatch-worker"
            assert ping["metadata"]["models"] == "m1,m2" and "m1" in ping["metadata"]["resident"].split(",")
            info = json.loads((await nc.request(f"$SRV.INFO.jetbatch-worker.{ping['id']}", b"", timeout=5)).data)
            assert info["type"] == "io.nats.micro.v1.info_response"
            assert [e["subject"] for e in info["endpoints"]] == [Subjects(prefix).status_subject]
            stats = json.loads((await nc.request(f"$SRV.STATS.jetbatch-worker.{ping['id']}", b"", timeout=5)).data)
            assert stats["type"] == "io.nats.micro.v1.stats_response"
            report = stats["endpoints"][0]["data"]
            assert report["id"] == worker.worker_id and report["stats"]["requests"] >= 1
            # The allowlist holds for the control subjects too.
            spy: list[str] = []
            async def on_spy(m: object) -> None:
                await _append_subject(spy, m)

            await nc.subscribe("$JS.API.STREAM.DELETE.>", cb=on_spy)
            await nc.publish("$SRV.PING", b"", reply=f"$JS.API.STREAM.DELETE.{Subjects(prefix).models_stream}")
            await nc.request(f"$SRV.PING.jetbatch-worker.{ping['id']}", b"", timeout=5)  # processed after the attack
            assert spy == []
            await sub.unsubscribe()
        finally:
            await nc.close()


async def _append(answers: list, msg: object) -> None:
    import json

    answers.append(json.loads(msg.data))  # type: ignore[attr-defined]


async def _append_subject(seen: list, msg: object) -> None:
    seen.append(msg.subject)  # type: ignore[attr-defined]


async def test_a_forged_report_cannot_drive_the_operators_terminal(nats_url: str, prefix: str) -> None:
    """Found by an attack: whoever may answer status requests (a sidecar identity, anyone on a
    server without authorization) put terminal escape sequences in a report's id, and `jetbatch
    status` printed them raw (clear the screen, colours, a forged row). They are printed as
    escapes now."""
    import json

    import nats

    from jetbatch.sdk.protocol import Subjects

    forger = await nats.connect(nats_url)
    try:
        report = {"id": "\x1b[2J\x1b[31mEVIL\x1b[0m\nworker    fake", "role": "worker", "models": ["m\x07"], "resident": ["m\x1b]0;t\x07"], "warm": []}

        async def answer(msg: object) -> None:
            await forger.publish(msg.reply, json.dumps(report).encode())  # type: ignore[attr-defined]

        await forger.subscribe(Subjects(prefix).status_subject, cb=answer)
        await forger.flush()
        proc = await anyio.run_process(
            [sys.executable, "-m", "jetbatch", "status", "--nats-url", nats_url, "--prefix", prefix, "--wait", "0.5"], check=False
        )
    finally:
        await forger.close()
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2J" in out  # shown, as an escape
    assert not any(line.startswith("worker    fake") for line in out.splitlines())  # no forged row
