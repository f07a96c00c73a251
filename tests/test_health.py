"""Each sidecar's HTTP endpoints, answered by a real worker process: /healthz, /readyz (ready only
once its streams exist; not ready while NATS is gone) and /metrics (Prometheus text with the
histogram buckets jetbatch advises)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jetbatch import sdk
from jetbatch.sidecar.dev.natsserver import EmbeddedNats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _poll(what: str, check: "object", timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(store_dir=tmp_path / "store") as s:
        yield s


def test_worker_serves_health_readiness_and_metrics(server: EmbeddedNats, tmp_path: Path) -> None:
    prefix = "health"
    config = tmp_path / "w.toml"
    config.write_text(
        f'[nats]\nprefix = "{prefix}"\n[worker]\npoll_interval_ms = 50\n'
        '[models.m1]\nhandler = "sleep"\nmax_delay_ms = 1\noptions = { load_cost_s = 0.0, batch_cost_s = 0.003, item_cost_s = 0.0 }\n'
    )
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetbatch", "worker", "--config", str(config), "--nats-url", server.url, "--http-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        _poll("/healthz", lambda: _get(port, "/healthz")[0] == 200)
        _poll("/readyz", lambda: _get(port, "/readyz")[0] == 200)

        async def use() -> None:
            # Ready means the streams exist: a producer can publish at once.
            async with sdk.Client.connect(server.url, prefix=prefix) as client:
                for i in range(5):
                    assert await client.infer(f"x{i}".encode(), model="m1", timeout=10) == f"x{i}".encode()

        asyncio.run(use())
        probe = [sys.executable, "-m", "jetbatch", "probe", "--port", str(_free_port()), "--port", str(port)]
        assert subprocess.run(probe, capture_output=True).returncode == 0  # the second port answers

        def scraped() -> bool:
            status, text = _get(port, "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(text)}
            infer = families.get("jetbatch_infer_duration_seconds")
            requests = families.get("jetbatch_requests")
            if status != 200 or infer is None or requests is None:
                return False
            bounds = {s.labels["le"] for s in infer.samples if s.name.endswith("_bucket")}
            assert {"0.001", "0.005", "0.1", "1.0", "+Inf"} <= bounds, bounds  # seconds, not the ms defaults
            # One meaning per metric: use and budget apart, no label that mixes them; no
            # constant otel_scope_* labels on every series.
            assert "jetbatch_memory_used_bytes" in families and "jetbatch_memory" not in families
            assert not [s for f in families.values() for s in f.samples if any(k.startswith("otel_scope") for k in s.labels)]
            # Alone, the worker reports the stream's backlog.
            assert "jetbatch_queue_backlog" in families
            return sum(s.value for s in requests.samples if s.name.endswith("_total")) >= 5

        _poll("metrics with 5 requests", scraped)

        # One model's readiness (Triton's /v2/models/<m>/ready): served here and loadable.
        status, why = _get(port, "/readyz?model=m1")
        assert status == 200 and why.startswith("model m1: resident"), why
        assert _get(port, "/readyz?model=nope")[0] == 404
        assert _get(port, "/readyz?model=bad%2Fname")[0] == 400  # not a model name: never looked up
        probe_model = [sys.executable, "-m", "jetbatch", "probe", "--port", str(port), "--model"]
        assert subprocess.run([*probe_model, "m1"], capture_output=True).returncode == 0
        assert subprocess.run([*probe_model, "nope"], capture_output=True).returncode == 1

        # Hostile or wrong requests get a status and the endpoint keeps answering.
        assert _get(port, "/nope")[0] == 404
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 400")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"DELETE /readyz HTTP/1.1\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 405")
        # A flood of idle connections is capped: the sidecar goes on serving requests, and the
        # endpoint answers again once they go.
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(60)]
        try:
            asyncio.run(use())
        finally:
            for s in idle:
                s.close()
        _poll("/healthz after the flood", lambda: _get(port, "/healthz")[0] == 200)

        server.kill()  # NATS gone: not ready, still alive
        _poll("/readyz 503 without NATS", lambda: _get(port, "/readyz")[0] == 503)
        status, why = _get(port, "/readyz")
        assert "NATS" in why
        assert _get(port, "/healthz")[0] == 200
        assert subprocess.run(probe, capture_output=True).returncode == 1
        server.restart()
        _poll("/readyz again after NATS returns", lambda: _get(port, "/readyz")[0] == 200, timeout_s=60)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()[-2000:]


def test_http_port_option_is_checked(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "jetbatch", "worker", "--config", "x.toml", "--http-port", "99999"], capture_output=True, text=True)
    assert r.returncode == 2 and "out of range" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.anyio
async def test_idle_sockets_cannot_keep_the_probes_out() -> None:
    """Found by an attack: the server refused every connection past 32 while each open one had 5 s
    to send its request, so 32 idle sockets renewed every 5 s failed every liveness and readiness
    probe. A new connection now ends the oldest one still silent, and a probe is answered."""
    import anyio

    from jetbatch.sidecar.health import ProbeServer

    probe = ProbeServer("127.0.0.1", 0, alive=lambda: (True, "alive"), ready=lambda: (True, "ready"))
    async with anyio.create_task_group() as tg:
        port = await tg.start(probe.serve)
        idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(64)]  # connected, silent
        try:
            for path in ("/healthz", "/readyz"):
                status, _ = await anyio.to_thread.run_sync(_get, port, path)
                assert status == 200
        finally:
            for s in idle:
                await s.aclose()
            tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_request_head_over_4_kib_is_refused() -> None:
    """The head limit is 4 KiB as documented: checked after each receive (it was checked before,
    so a head of up to 8 KiB got through), and a head within it is still answered."""
    import anyio

    from jetbatch.sidecar.health import ProbeServer

    probe = ProbeServer("127.0.0.1", 0, alive=lambda: (True, "alive"), ready=lambda: (True, "ready"))

    async def ask(port: int, head: bytes) -> bytes:
        async with await anyio.connect_tcp("127.0.0.1", port) as s:
            await s.send(head)
            out = b""
            with anyio.fail_after(10):
                try:
                    while True:
                        out += await s.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                    return out

    async with anyio.create_task_group() as tg:
        port = await tg.start(probe.serve)
        try:
            start = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
            fits = start + b"X-Pad: " + b"a" * (4096 - len(start) - 11) + b"\r\n\r\n"
            over = start + b"X-Pad: " + b"a" * 5000 + b"\r\n\r\n"
            assert len(fits) <= 4096 < len(over) < 8192
            assert (await ask(port, fits)).startswith(b"HTTP/1.1 200")
            assert not (await ask(port, over)).startswith(b"HTTP/1.1 200")
        finally:
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("role", ["worker", "classifier"])
def test_a_sidecar_says_when_it_is_ready_and_where_its_endpoints_listen(server: EmbeddedNats, tmp_path: Path, role: str) -> None:
    """Found in a day of use: ``jetbatch worker``/``classifier`` printed nothing when ready, and
    with ``--http-port 0`` nothing said which port they bound. One line now says both, and the
    port it names answers."""
    config = tmp_path / "s.toml"
    config.write_text(
        '[nats]\nprefix = "ready-line"\n[worker]\nid = "w-ready"\n[classifier]\nid = "c-ready"\nrouter = "rules"\ndefault_model = "m1"\n'
        '[models.m1]\nhandler = "sleep"\noptions = { load_cost_s = 0.0, batch_cost_s = 0.001, item_cost_s = 0.0 }\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetbatch", role, "--config", str(config), "--nats-url", server.url, "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the line (or EOF if it died): the test's timeout bounds it
        want = f"{role} {'w-ready' if role == 'worker' else 'c-ready'} ready"
        assert line.startswith(want), line
        assert role != "worker" or "serving m1" in line, line
        port = int(line.rsplit(":", 1)[1])
        assert _get(port, "/readyz")[0] == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0  # SIGTERM: a graceful stop (docs/cli.md)
