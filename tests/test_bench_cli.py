"""`jetbatch bench` as a user runs it, against an embedded deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jetbatch.sidecar.dev.loadtest import BenchError, parse_mix

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
    for key in ("throughput", "p50 / p95 / p99", "mean batch size", "loads"):
        assert key in proc.stdout
    assert (tmp_path / "out.png").stat().st_size > 10_000


def test_bench_json_is_one_summary_on_stdout(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "jetbatch", "bench", "--rate", "20", "--duration", "1", "--mix", "m1=1", "--json"],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)  # nothing else on stdout
    assert summary["sent"] == summary["answered"] > 0


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
