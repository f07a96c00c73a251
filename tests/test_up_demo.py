"""`jetbatch examples build`, `jetbatch up` and `jetbatch demo` as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from jetbatch import sdk
from jetbatch.sdk.protocol import Tensor
from jetbatch.sidecar.dev.example_models import EXAMPLE_MODELS, build_examples, sample_inputs
from jetbatch.sidecar.status import collect_status

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    env["JETBATCH_HOME"] = str(tmp_path / "home")
    env["PYTHONWARNINGS"] = "default"  # show every warning, as a newcomer's terminal would
    return env


def test_example_models_are_real_and_deterministic(examples_dir: Path, tmp_path: Path) -> None:
    from jetbatch.sidecar.dev.example_models import ExampleMLP
    from jetbatch.sidecar.handlers import read_module

    again = build_examples(tmp_path / "again", force=True)
    x, _ = sample_inputs(4, seed=3)
    for name, (hidden, classes, fmt) in EXAMPLE_MODELS.items():
        suffix = ".pt2" if fmt == "export" else ".safetensors"
        kw = {"module_class": "jetbatch.sidecar.dev.example_models:ExampleMLP", "module_kwargs": {"hidden": hidden, "classes": classes}}
        extra = kw if fmt == "state_dict" else {}
        a = read_module(fmt, str(examples_dir / f"{name}{suffix}"), **extra)
        b = read_module(fmt, str(again.directory / f"{name}{suffix}"), **extra)
        with torch.inference_mode():
            out_a, out_b = a(x), b(x)
        assert out_a.shape == (4, classes)
        assert torch.equal(out_a, out_b)  # fixed seeds: same weights on every build
    assert issubclass(ExampleMLP, torch.nn.Module)
    router = read_module("export", str(examples_dir / "router.pt2"))
    x, truth = sample_inputs(200, seed=11)
    with torch.inference_mode():
        predicted = [list(EXAMPLE_MODELS)[i] for i in router(x).argmax(dim=1).tolist()]
    assert sum(p == t for p, t in zip(predicted, truth)) >= 190  # the router learned its clusters


def test_up_serves_and_stops_on_sigint(examples_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetbatch", "up", "--config", str(examples_dir / "models.toml"), "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
        start_new_session=True,  # its own process group: a failed test kills what it started too
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the sidecars are ready (theirs say nothing under up)
        match = re.search(r"NATS at (nats://\S+); sidecars: (\S+) \(worker\)\.", line)
        assert match, line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        url, worker_id = match.group(1), match.group(2)
        # The health URL printed is the one the worker listens on (a free port here), on loopback.
        health = re.search(rf"{re.escape(worker_id)} health and metrics at (http://127\.0\.0\.1:\d+)/readyz", proc.stdout.readline())
        assert health, "no health URL printed"
        with urllib.request.urlopen(f"{health.group(1)}/readyz", timeout=10) as resp:
            assert resp.status == 200
        # The server admits only its users: `up` says where the app's credentials are, and how
        # the SDK takes them (the file holds connect's keyword arguments, for its owner only).
        credentials = Path(_env(tmp_path)["JETBATCH_HOME"]) / "credentials"
        assert str(credentials / "app.json") in proc.stdout.readline()
        assert f"sdk.Client.connect({url!r}, **json.load(open({str(credentials / 'app.json')!r})))" in proc.stdout.readline()
        assert str(credentials / "admin.json") in proc.stdout.readline()
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in credentials.iterdir())
        app = json.loads((credentials / "app.json").read_text())
        admin_url = url.replace("nats://", f"nats://admin:{json.loads((credentials / 'admin.json').read_text())['password']}@")

        async def ids() -> list[str]:
            async with sdk.Client.connect(admin_url) as client:
                return [r.id for r in await collect_status(client.nats, client.subjects, wait_s=0.5)]

        assert asyncio.run(ids()) == [worker_id]  # `jetbatch status` shows the name `up` printed
        with pytest.raises(sdk.ConnectionFailed):
            asyncio.run(_connect(url))  # no credentials, no connection

        async def ask() -> sdk.Result:
            x, truth = sample_inputs(1, seed=5)
            async with sdk.Client.connect(url, **app) as client:
                return await client.infer_result(Tensor.from_torch(x[0]), model=truth[0], timeout=30)

        result = asyncio.run(ask())
        assert isinstance(result.output, Tensor)
        probs = result.output.to_torch()
        assert abs(float(probs.sum()) - 1.0) < 1e-4  # the example models end in a softmax
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130  # interrupted, as docs/cli.md promises for every command
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        proc.communicate(timeout=10)  # closes the pipes
    # The embedded server is gone with it: nothing listens on its port any more.
    with pytest.raises(sdk.ConnectionFailed):
        asyncio.run(_connect(url))


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill a process started in a session of its own, and everything it started: a test that
    fails half-way leaves no nats-server or sidecar running without a parent."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _connect(url: str) -> None:
    client = await sdk.Client.connect(url, connect_timeout_s=0.5)
    await client.close()


def test_a_taken_http_port_stops_the_sidecar_with_one_line(examples_dir: Path, tmp_path: Path) -> None:
    """Two workers on one host with the same [http] port: the second says why and exits 2
    instead of running without the health checks its supervisor relies on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "jetbatch", "worker", "--config", str(examples_dir / "models.toml"),
             "--nats-url", "nats://127.0.0.1:1", "--http-port", str(port)],
            capture_output=True, text=True, timeout=120, env=_env(tmp_path),
        )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"jetbatch worker: cannot listen on 127.0.0.1:{port} for /healthz, /readyz and /metrics: Address already in use "
        "(another process has the port? choose one with --http-port or [http], 0 for any free port, off for none)"
    ]


def _taken_port_before_a_free_one() -> socket.socket:
    """A listening socket on a port whose next port was free a moment ago (``jetbatch up`` gives
    the classifier the worker's HTTP port + 1: taken by another test's process, it failed too,
    and said so in a second line)."""
    for _ in range(50):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", taken.getsockname()[1] + 1))
            except OSError:
                taken.close()
                continue
        return taken
    raise AssertionError("no port with a free next one")


def test_up_with_a_taken_http_port_says_it_in_the_sidecars_one_line(examples_dir: Path, tmp_path: Path) -> None:
    """`jetbatch up` added "worker0 exited with status 2" and a blank line below the worker's own
    line (found by an independent attack on the CLI): the worker's line is the one line."""
    with _taken_port_before_a_free_one() as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "jetbatch", "up", "--config", str(examples_dir / "up.toml"), "--port", "0", "--http-port", str(port)],
            capture_output=True, text=True, timeout=120, env=_env(tmp_path),
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jetbatch worker: cannot listen on 127.0.0.1:{port}"), proc.stderr


def test_a_taken_nats_port_is_reported_without_waiting(tmp_path: Path) -> None:
    from jetbatch.sidecar.dev.natsserver import EmbeddedNats, NatsServerError

    with EmbeddedNats() as first:
        second = EmbeddedNats(port=first.port, startup_timeout_s=60)
        started = time.monotonic()
        with pytest.raises(NatsServerError, match=f"port {first.port} on 127.0.0.1 is taken"):
            second.start()
        # Not the startup timeout: the server's exit ends the wait (a state, not a time margin:
        # the timeout is a minute, and the error came from the exited server's log).
        assert time.monotonic() - started < second.startup_timeout_s


def test_demo_runs_and_summarises(examples_dir: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jetbatch", "demo", "--requests", "60", "--dir", str(examples_dir)],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"answered\s+60\b", out), out
    assert re.search(r"errors\s+0\b", out), out
    # The seconds the sidecars take to start are not silent.
    assert re.search(r"waiting for the sidecars: \d+ of 1 workers", out), out
    batch_lines = [line for line in out.splitlines() if line.startswith("batch ")]
    assert batch_lines and all("model=" in line and "size=" in line for line in batch_lines)
    sizes = [int(re.search(r"size=\s*(\d+)", line).group(1)) for line in batch_lines]  # type: ignore[union-attr]
    assert sum(sizes) == 60 and len(sizes) < 60  # every request shows up in exactly one batch line
    assert "Traceback" not in proc.stderr
    # jetbatch's default path calls no deprecated API: a newcomer's demo prints no warnings.
    assert "Warning" not in proc.stderr and "Warning" not in proc.stdout, proc.stderr
    assert time.monotonic() - started < 180


def test_demo_with_requests_unanswered_says_so_and_exits_1(examples_dir: Path, tmp_path: Path) -> None:
    """docs/cli.md: `demo` exits 1 when some requests go unanswered. One example model's file is
    broken after it was built: its requests are answered model_failed, the summary counts them as
    errors, and the exit status says the run was not clean."""
    import shutil

    broken = tmp_path / "examples"
    shutil.copytree(examples_dir, broken)
    victim = next(p for p in sorted(broken.iterdir()) if p.suffix in (".pt2", ".safetensors") and p.stem != "router")
    victim.write_bytes(b"not a model")
    proc = subprocess.run(
        [sys.executable, "-m", "jetbatch", "demo", "--requests", "30", "--quiet", "--dir", str(broken)],
        capture_output=True, text=True, timeout=180, env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"errors\s+model_failed=\d+", proc.stdout), proc.stdout
    assert "Traceback" not in proc.stderr


def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (Linux /proc)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_demo_stopped_by_sigterm_leaves_nothing_running(examples_dir: Path, tmp_path: Path) -> None:
    """`kill` (or `docker stop`, or a CI timeout) on the demo stops its nats-server, worker and
    classifier too: they were left running without a parent, with the server's store on disk."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetbatch", "demo", "--requests", "100000", "--concurrency", "1", "--quiet", "--dir", str(examples_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path), start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 120
        while "sending" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "sending" in line, line
        url = re.search(r"NATS at (nats://\S+);", line).group(1)  # type: ignore[union-attr]
        started = _descendants(proc.pid)
        assert len(started) >= 3, started  # nats-server, the worker, the classifier
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err, err
    assert not [pid for pid in started if _alive(pid)], "left running after the demo stopped"
    with pytest.raises(sdk.ConnectionFailed):
        asyncio.run(_connect(url))


def test_a_second_up_on_a_running_ones_store_refuses_in_one_line(examples_dir: Path, tmp_path: Path) -> None:
    """A second `jetbatch up --port 0` (what the port-taken message suggested) started a
    nats-server on the running one's JetStream store, rewrote its nats-server.conf, then failed
    on the first one's HTTP port. It is refused before anything starts, and told how to join the
    running server or run a second deployment; the first server keeps serving."""
    from jetbatch.sidecar.dev.natsserver import EmbeddedNats, NatsStoreInUse

    store = tmp_path / "home" / "nats"  # where `jetbatch up` keeps its store under JETBATCH_HOME
    with EmbeddedNats(store_dir=store) as first:
        conf = (store / "nats-server.conf").read_text()
        with pytest.raises(NatsStoreInUse, match=re.escape(first.url)):
            EmbeddedNats(store_dir=store).start()
        proc = subprocess.Popen(
            [sys.executable, "-m", "jetbatch", "up", "--config", str(examples_dir / "models.toml"), "--port", "0", "--http-port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path), start_new_session=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:  # it started a deployment on the store: the bug
                _kill_group(proc)
                proc.communicate(timeout=10)
        assert proc.returncode == 2, out + err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"jetbatch up: the NATS store {store} is in use"), err
        assert f"--nats-url {first.url}" in lines[0] and "JETBATCH_HOME" in lines[0]
        assert (store / "nats-server.conf").read_text() == conf
        asyncio.run(_connect(first.url))  # still serving
    with EmbeddedNats(store_dir=store):  # the lock went with the server: the store is free again
        pass
