"""Health and readiness: every sidecar answers status requests; `jetbatch status` lists them."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from jetbatch import sdk
from jetbatch.sidecar.status import collect_status
from tests.helpers import make_config, running_worker, sleep_model

pytestmark = pytest.mark.anyio


async def test_worker_answers_status_and_cli_shows_cluster_view(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"m1": sleep_model(), "m2": sleep_model()})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"x", model="m1", timeout=10)
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
