"""Deployment files: the compose file validates against the official Compose schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT.parent / "shared" / "tools" / "check_compose.py"


@pytest.mark.skipif(not CHECKER.exists(), reason="../shared/tools/check_compose.py is not beside this checkout")
def test_compose_file_validates_against_the_compose_schema() -> None:
    proc = subprocess.run([sys.executable, str(CHECKER), str(ROOT / "compose.yaml")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid" in proc.stdout


def test_compose_wires_the_sidecars() -> None:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = doc["services"]
    assert {"nats", "classifier", "worker", "jaeger"} <= set(services)
    assert "--jetstream" in services["nats"]["command"]
    assert services["worker"]["environment"]["NATS_URL"] == "nats://nats:4222"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
