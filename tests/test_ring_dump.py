"""A running worker's ring asked for over NATS (`jetbatch ring`), against a real nats-server and a
real `jetbatch worker --ring-minutes`: the dump arrives whole, in parts when asked for small ones,
and replays exactly; hostile requests get nothing sent outside the reply allowlist and leave it
serving; a worker that is not there is one line and exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import anyio
import pytest

from jetbatch import sdk
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Headers, Subjects
from jetbatch.sidecar.recording import replay, replay_file
from jetbatch.sidecar.ring_dump import PENDING_REQUESTS, RingTransferError, fetch_ring
from tests.helpers import ring_worker_process

pytestmark = [pytest.mark.timeout(120)]

WORKER = "w-ring.a"  # a dotted id: the subject's tail is several tokens


@pytest.fixture
def ring_worker(nats_url: str, prefix: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    text = f'[nats]\nprefix = "{prefix}"\n[worker]\nid = "{WORKER}"\n[models.m1]\nhandler = "identity"\nmax_batch_size = 4\n'
    with ring_worker_process(nats_url, prefix, text, tmp_path) as proc:
        yield proc


def _ring(nats_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jetbatch", "ring", "--nats-url", nats_url, "--prefix", prefix, *args], capture_output=True, text=True, timeout=60
    )


def test_jetbatch_ring_fetches_a_running_workers_ring_and_it_replays(ring_worker: subprocess.Popen[str], nats_url: str, prefix: str, tmp_path: Path) -> None:
    out = _ring(nats_url, prefix, "--worker", WORKER, "--out", str(tmp_path / "ring.jsonl"))
    assert out.returncode == 0 and "events) of worker w-ring.a's ring" in out.stdout, out.stdout + out.stderr
    result = replay_file(tmp_path / "ring.jsonl")
    assert result.ok and result.from_snapshot and result.events > 0, result
    # The same through `jetbatch replay`, as an operator checks it.
    check = subprocess.run([sys.executable, "-m", "jetbatch", "replay", str(tmp_path / "ring.jsonl")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "events replayed" in check.stdout, check.stdout + check.stderr


def test_a_ring_larger_than_a_part_comes_in_parts_and_replays(ring_worker: subprocess.Popen[str], nats_url: str, prefix: str) -> None:
    async def main() -> tuple[bytes, int]:
        nc = await connect_nats(nats_url)
        parts = 0

        async def count(msg: object) -> None:
            nonlocal parts
            parts += 1

        try:
            # A listener beside the asker counts the parts the worker sends to the inbox.
            inbox_sub = await nc.subscribe("_INBOX.>", cb=count)
            data = await fetch_ring(nc, Subjects(prefix), WORKER, timeout_s=30, chunk_bytes=1024)
            await inbox_sub.unsubscribe()
            return data, parts
        finally:
            await nc.close()

    data, parts = anyio.run(main)
    assert len(data) > 3 * 1024 and parts == -(-len(data) // 1024), (len(data), parts)
    result = replay(data.splitlines())
    assert result.ok and result.from_snapshot and result.events > 0


def test_hostile_ring_requests_get_nothing_outside_the_allowlist_and_the_worker_serves_on(
    ring_worker: subprocess.Popen[str], nats_url: str, prefix: str
) -> None:
    subjects = Subjects(prefix)

    async def main() -> tuple[list[object], list[str], bytes]:
        nc = await connect_nats(nats_url)
        leaked: list[object] = []
        errors: list[str] = []
        try:
            # Reply subjects outside the allowlist: a JetStream API call and a model's queue.
            async def note(msg: object) -> None:
                leaked.append(msg)

            trap = await nc.subscribe(f"{prefix}.model.>", cb=note)
            api = await nc.subscribe("$JS.API.STREAM.DELETE.>", cb=note)
            for reply in ("$JS.API.STREAM.DELETE.X", f"{prefix}.model.m1"):
                await nc.publish(subjects.ring(WORKER), b"", reply=reply)
            # Bodies that are not a request: an error answer each, never a dump or a crash.
            for body in (b"not json", b'{"chunk_bytes": 1}', b'{"chunk_bytes": 1e400}', b'{"evil": 1}', b"{" * 100_000):
                msg = await nc.request(subjects.ring(WORKER), body, timeout=10)
                assert msg.headers and Headers.RING_ERROR in msg.headers and msg.data == b"", (body[:20], msg.headers)
                errors.append(msg.headers[Headers.RING_ERROR])
            # A flood: dropped beyond the pending limit, the worker is not buried in dumps. An
            # asker during the flood may be dropped with it: it asks again until answered.
            flood_inbox = nc.new_inbox()

            async def dumped(msg: object) -> None:
                flood.append(msg)

            flood: list[object] = []
            flood_sub = await nc.subscribe(flood_inbox, cb=dumped)
            for _ in range(200):
                await nc.publish(subjects.ring(WORKER), b"", reply=flood_inbox)
            await nc.flush()
            with anyio.fail_after(60):
                while True:
                    try:
                        data = await fetch_ring(nc, subjects, WORKER, timeout_s=2)
                        break
                    except RingTransferError:
                        continue
            await flood_sub.unsubscribe()
            assert 1 <= len(flood) <= 2 * PENDING_REQUESTS, len(flood)  # one part a dump here
            await trap.unsubscribe()
            await api.unsubscribe()
            return leaked, errors, data
        finally:
            await nc.close()

    leaked, errors, data = anyio.run(main)
    assert not leaked
    assert any("at most 1024 bytes" in e for e in errors) and any("chunk_bytes" in e for e in errors), errors
    assert replay(data.splitlines()).ok
    assert ring_worker.poll() is None  # still running


def test_a_worker_that_is_not_there_is_one_line_and_exit_1(nats_url: str, prefix: str, tmp_path: Path) -> None:
    # Told at once by the server (no responders): with a 600 s timeout, a command that waited for
    # it would outlive _ring's own 60 s deadline and fail there.
    out = _ring(nats_url, prefix, "--worker", "nobody", "--out", str(tmp_path / "r.jsonl"), "--timeout", "600")
    assert out.returncode == 1 and "no worker answers" in out.stdout and not (tmp_path / "r.jsonl").exists(), out.stdout + out.stderr


@pytest.mark.parametrize("worker", ["a.>", "*", "a b", ""])
def test_a_worker_id_that_is_no_subject_is_a_usage_error(nats_url: str, prefix: str, tmp_path: Path, worker: str) -> None:
    out = _ring(nats_url, prefix, "--worker", worker, "--out", str(tmp_path / "r.jsonl"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


