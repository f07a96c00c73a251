"""`jetbatch bench` as a user runs it, against an embedded deployment."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetbatch import sdk
from jetbatch.sidecar.dev.loadtest import BenchError, parse_mix
from jetbatch.sidecar.status import collect_status

pytestmark = pytest.mark.slow


def test_bench_against_an_embedded_deployment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "jetbatch", "bench", "--concurrency", "8", "--duration", "2", "--mix", "m1=0.5,m2=0.5",
         "--out", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["sent"] == summary["answered"] > 0 and summary["errors"] == {}
    assert summary["mean_batch_size"] >= 1 and summary["loads"] >= 1
    # Loads split by tier, from the worker's counters: the first load of each model is cold; the
    # two models share one slot, so the rest are reloads from the warm tier, and every load the
    # replies saw is in the counters.
    assert summary["loads_cold"] == 2 and summary["loads_cold"] + summary["loads_warm"] >= summary["loads"]
    assert summary["load_s"] > 0 and summary["interrupted"] is False
    assert "cold from disk" in proc.stdout and "s loading" in proc.stdout
    for key in ("throughput", "p50 / p95 / p99", "mean batch size", "loads"):
        assert key in proc.stdout
    assert (tmp_path / "out.png").stat().st_size > 10_000
    # Piped (no terminal, as in CI): progress still shows, as whole lines on stderr.
    assert re.search(r"^bench: \d+\.\ds of 2s sent=\d+ answered=\d+ errors=0$", proc.stderr, re.M), proc.stderr[-2000:]


def test_bench_json_is_one_summary_on_stdout(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "jetbatch", "bench", "--rate", "20", "--duration", "1", "--mix", "m1=1", "--json"],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)  # nothing else on stdout
    assert summary["sent"] == summary["answered"] > 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_bench_still_reports_what_it_measured(tmp_path: Path, signum: int) -> None:
    """Ctrl-C during the run: the summary of what was measured until then, and exit 130 (as wrk
    and locust print partial stats). SIGTERM the same (docs/cli.md): it printed a traceback, no
    summary, and crashed with status 139 (found by an independent attack on the CLI)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    # Files, not pipes: the deployment's sidecars inherit them, and a pipe would keep a reader
    # waiting on them. -X faulthandler: a bench stuck after the interrupt is asked for its
    # threads' stacks (SIGABRT) so the failure says where it hung.
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with open(out_path, "wb") as out_file, open(err_path, "wb") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "jetbatch", "bench", "--rate", "50", "--duration", "600", "--mix", "m1=1", "--json"],
            stdout=out_file, stderr=err_file, env=env, preexec_fn=_ctrl_c_as_at_a_terminal,
        )  # fmt: skip
    try:
        # Interrupt once requests have been answered: find the embedded deployment's worker in
        # the process tree, then ask it (status) until it has served some.
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            url = _worker_nats_url(proc.pid)
            time.sleep(0.1)
        assert url, "the bench's worker did not start"

        async def served() -> int:
            async with sdk.Client.connect(url) as client:
                return sum(r.stats.get("requests", 0) for r in await collect_status(client.nats, client.subjects, wait_s=0.3))

        while asyncio.run(served()) < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signum)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            pytest.fail("the bench did not end within 60 s of the interrupt:\n" + err_path.read_text(errors="replace")[-6000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_path.read_text(errors="replace")
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    summary = json.loads(out_path.read_text())
    assert summary["interrupted"] is True and summary["answered"] > 0
    assert summary["elapsed_s"] < 600


def _ctrl_c_as_at_a_terminal() -> None:
    """In the child, before exec: SIGINT back to its default. A test run started in the background
    by a shell without job control ignores SIGINT, and an ignored signal stays ignored across exec:
    the bench would never see the Ctrl-C (as a background job should not)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _worker_nats_url(pid: int) -> str | None:
    """The --nats-url of the `jetbatch worker` child of ``pid`` (Linux /proc), once it runs."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if "worker" in argv and "--nats-url" in argv:
                return argv[argv.index("--nats-url") + 1]
    return None


def test_bad_mix_is_a_one_line_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jetbatch", "bench", "--rate", "10", "--mix", "m1=lots"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "jetbatch bench: --mix: weight of 'm1' is not a number: 'lots'"


def test_parse_mix() -> None:
    assert parse_mix("a=1,b=3") == {"a": 0.25, "b": 0.75}
    with pytest.raises(BenchError, match="invalid model name"):
        parse_mix("a.b=1")
    with pytest.raises(BenchError, match="sum to zero"):
        parse_mix("a=0")
