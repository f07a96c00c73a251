"""The suite is hermetic: no test, fixture or bench harness binds a fixed port, so it passes on a
host where another process holds jetbatch's default ports (4222, 9464, 9465: 9464 is the
Prometheus exporters' customary port). A static check over the source, plus a check that the
session really holds the defaults (tests/conftest.py), so a test that starts a sidecar on a
default port fails everywhere."""

from __future__ import annotations

import ast
import re
import socket
from pathlib import Path

import pytest

from tests.ports import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parent.parent
# What the tests run: their own files and fixtures, and the bench harness code they import.
CHECKED = [*sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py"))]
# Flags whose next argument is a port a process binds.
PORT_FLAGS = {"--port", "--http-port"}
# Calls whose second element of the address (or ``port`` argument) is bound.
BINDING_CALLS = {"bind", "create_server", "create_tcp_listener", "start_server", "HTTPServer", "ThreadingHTTPServer", "TCPServer"}
# A TOML line in a config a test writes out: `port = 4222`, `worker_port = 9464`, `http_port: 8222`.
CONFIG_PORT = re.compile(r"\b\w*port\s*[=:]\s*([1-9]\d{3,4})\b")


def _fixed(node: ast.AST) -> int | None:
    """The port ``node`` names when it is a literal another process could hold, else None.
    Not one: 0 (any free port), a negative number (jetbatch's "off"), a number past 65535 (a
    test of the argument check), a port below 1024 (only root binds one: the suite dials port 1
    or 9 as "nothing listens here", and binds none)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str)) and not isinstance(node.value, bool):
        text = str(node.value)
        if text.isdigit() and 1024 <= int(text) <= 65535:
            return int(text)
    return None


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def fixed_ports(source: str) -> list[tuple[int, str]]:
    """(line, what) for each fixed port that ``source`` binds or has a process bind."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg and kw.arg.endswith("port") and (port := _fixed(kw.value)) is not None:
                    found.append((node.lineno, f"{kw.arg}={port}"))
            if _call_name(node) in BINDING_CALLS:
                for arg in node.args:
                    address = arg.elts if isinstance(arg, ast.Tuple) else [arg]
                    for element in address[1:2] if isinstance(arg, ast.Tuple) else address:
                        if (port := _fixed(element)) is not None:
                            found.append((node.lineno, f"{_call_name(node)}(... {port} ...)"))
        # A command line, as a list or as call arguments: ["jetbatch", "up", "--port", "4222"].
        items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else node.args if isinstance(node, ast.Call) else []
        for flag, value in zip(items, items[1:]):
            if isinstance(flag, ast.Constant) and flag.value in PORT_FLAGS and (port := _fixed(value)) is not None:
                found.append((value.lineno, f"{flag.value} {port}"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            for match in CONFIG_PORT.finditer(node.value):
                if int(match.group(1)) <= 65535:
                        found.append((node.lineno, f"a config's {match.group(0)!r}"))
    return found


def test_no_test_fixture_or_bench_harness_binds_a_fixed_port() -> None:
    assert CHECKED and ROOT / "tests" / "conftest.py" in CHECKED
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in CHECKED for line, what in fixed_ports(path.read_text())]
    assert not bad, "a fixed port (use 0, or a port bound first and read back):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        's.bind(("127.0.0.1", 9464))',
        'await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=9465)',
        'EmbeddedNats(port=4222)',
        'subprocess.run([sys.executable, "-m", "jetbatch", "up", "--port", "4222"])',
        'run_cli("worker", "--config", path, "--http-port", "9464")',
        'Deployment(config, http_port=9464, configured_http=True)',
        'path.write_text("[http]\\nworker_port = 9464\\n")',
    ],
)
def test_the_check_finds_a_fixed_port(source: str) -> None:
    assert fixed_ports(source), source


@pytest.mark.parametrize(
    "source",
    [
        's.bind(("127.0.0.1", 0))',
        'Deployment(config, http_port=-1)',
        'run_cli("worker", "--http-port", "0")',
        'run_cli("worker", "--http-port", "off")',
        'run_cli("probe", "--port", str(port))',
        'run_cli("probe", "--port", "9")',  # dialed where nothing listens; only root could bind it
        'run_cli("up", "--port", "70000")',  # refused by the argument check
        'assert {p["containerPort"] for p in ports} == {9464}',  # read from a manifest, not bound
    ],
)
def test_the_check_passes_ephemeral_ports_and_ports_only_read(source: str) -> None:
    assert not fixed_ports(source), source


@pytest.mark.parametrize("port", DEFAULT_PORTS)
def test_the_default_ports_are_taken_for_the_whole_session(port: int) -> None:
    """By the session fixture or by another process: either way a sidecar that a test starts
    on a default port fails, on this host as on one where an exporter holds 9464."""
    with socket.socket() as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", port))
