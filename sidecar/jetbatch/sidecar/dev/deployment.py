"""``jetbatch up``: the sidecars of one config in one process tree, with an embedded NATS server
when no URL is given. :class:`Deployment` is also what the demo, the benchmarks and the tests use.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Callable, Sequence

from jetbatch.sdk.protocol import SidecarReport

from ..config import load_config
from ..errors import SidecarError
from ..interrupts import run_interruptible
from ..runtime import READY_LINE_ENV
from . import credentials as creds
from .natsserver import EmbeddedNats

__all__ = ["Deployment", "DeploymentError"]


class DeploymentError(SidecarError):
    """A sidecar exited or did not become ready; the message ends with its log tail. ``shown``:
    the sidecar exited on a user error it printed itself, in one line, to this terminal."""

    def __init__(self, message: str, *, shown: bool = False) -> None:
        super().__init__(message)
        self.shown = shown


class Deployment:
    """A NATS server (embedded unless ``nats_url`` is given), a worker process per config, and a
    classifier process when the config has a ``[classifier]`` section and ``classifier`` is True.

    With ``credentials_dir``, an embedded server admits only the roles of
    :mod:`~jetbatch.sidecar.dev.credentials` (passwords kept in that folder, made on first use),
    and each sidecar connects as its role; an external server is used as it is."""

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        nats_url: str | None = None,
        classifier: bool = True,
        workers: int = 1,
        store_dir: str | os.PathLike[str] | None = None,
        log_level: str = "WARNING",
        extra_env: dict[str, str] | None = None,
        worker_config_paths: Sequence[str | os.PathLike[str]] | None = None,
        capture_output: bool = True,
        port: int = -1,
        configured_http: bool = False,
        http_port: int | None = None,
        progress: Callable[[str], None] | None = None,
        credentials_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        # Told how the start goes (the demo prints it: sidecars take seconds to import torch and
        # set up, and a silent terminal looks hung).
        self.progress = progress
        self.config = load_config(self.config_path)
        self.nats_url = nats_url or self.config.nats.url
        self.with_classifier = classifier and self.config.classifier is not None
        self.workers = workers
        self.worker_config_paths = [Path(p) for p in worker_config_paths] if worker_config_paths else None
        self.store_dir = store_dir
        self.log_level = log_level
        self.extra_env = extra_env or {}
        self.capture_output = capture_output
        self.port = port  # of the embedded server: -1 picks a free one
        # HTTP endpoints: the config's ports for the first worker and the classifier (`jetbatch up`),
        # else any free port (tests and benchmarks run several deployments on one host).
        self.configured_http = configured_http
        # `jetbatch up --http-port P`: worker0 on P, the classifier on P + 1 (0: free ports; -1: off).
        self.http_port = http_port
        self.credentials_dir = Path(credentials_dir) if credentials_dir is not None else None
        # Each role's password, once an embedded server with authorization runs (else empty).
        self.passwords: dict[str, str] = {}
        self.server: EmbeddedNats | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # Each sidecar's id (what `jetbatch status` shows): the config's, else <host>-<name>.
        self.ids: dict[str, str] = {}
        # Each sidecar's last report, by name, as read when it became ready.
        self.reports: dict[str, SidecarReport] = {}
        self._host = _token(socket.gethostname())
        self._logs: dict[str, Path] = {}
        self._log_dir = Path(tempfile.mkdtemp(prefix="jetbatch-up-"))

    @property
    def url(self) -> str:
        assert self.nats_url is not None, "start() first"
        return self.nats_url

    def connect_options(self, role: str) -> dict[str, str]:
        """Keyword arguments for ``sdk.Client.connect`` that connect as ``role`` (``app``,
        ``admin``, ...); none when the server admits anyone."""
        if role not in self.passwords:
            return {}
        return creds.connect_options(role, self.passwords[role])

    def _spawn(self, name: str, args: list[str], ids: dict[str, str] | None = None) -> None:
        env = dict(os.environ)
        env.update(self.extra_env)
        role = name.rstrip("0123456789")
        if role in self.passwords:
            env.update(creds.sidecar_env(role, self.passwords[role]))
        for var, value in (ids or {}).items():
            env.setdefault(var, value)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # The deployment says what it started in its own lines (scripts read them): a sidecar's
        # own ready line would come first and say less.
        env[READY_LINE_ENV] = "0"
        log_path = self._log_dir / f"{name}.log"
        self._logs[name] = log_path
        out = open(log_path, "wb") if self.capture_output else None
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "jetbatch", *args, "--nats-url", self.url, "--log-level", self.log_level],
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env=env,
        )
        if out is not None:
            out.close()

    def _http_args(self, offset: int) -> list[str]:
        if self.http_port is None:
            return []  # the config's ports
        if self.http_port < 0:
            return ["--http-port", "off"]
        return ["--http-port", str(self.http_port + offset if self.http_port else 0)]

    def start_worker(self, index: int) -> str:
        name = f"worker{index}"
        path = self.worker_config_paths[index] if self.worker_config_paths else self.config_path
        http = self._http_args(0) if self.configured_http and index == 0 else ["--http-port", "0"]
        # load_config applies the environment too: a JETBATCH_WORKER__ID already set wins.
        configured = (load_config(path) if self.worker_config_paths else self.config).worker.id
        self.ids[name] = self.extra_env.get("JETBATCH_WORKER__ID") or configured or f"{self._host}-{name}"
        self._spawn(name, ["worker", "--config", str(path), *http], {"JETBATCH_WORKER__ID": self.ids[name]})
        return name

    def start_classifier(self, index: int = 0) -> str:
        name = f"classifier{index}"
        http = self._http_args(1) if self.configured_http else ["--http-port", "0"]
        configured = self.config.classifier.id if self.config.classifier is not None else None
        self.ids[name] = self.extra_env.get("JETBATCH_CLASSIFIER__ID") or configured or f"{self._host}-{name}"
        self._spawn(name, ["classifier", "--config", str(self.config_path), *http], {"JETBATCH_CLASSIFIER__ID": self.ids[name]})
        return name

    def start(self, ready_timeout_s: float = 60.0) -> "Deployment":
        if self.nats_url is None:
            extra = ""
            if self.credentials_dir is not None:
                self.passwords = creds.load_or_create(self.credentials_dir)
                extra = creds.authorization_block(self.config.subjects, self.passwords)
            self.server = EmbeddedNats(store_dir=self.store_dir, port=self.port, extra_config=extra).start()
            self.nats_url = self.server.url
        try:
            for i in range(self.workers):
                self.start_worker(i)
            if self.with_classifier:
                self.start_classifier()
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until every stream the sidecars create exists (requests can be published), or a child
        dies (its log tail is raised)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            run_interruptible(self._wait_ready(timeout_s))
            return
        # Called from async code (a benchmark, a test): check on a private loop in a thread.
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, self._wait_ready(timeout_s)).result()

    async def _wait_ready(self, timeout_s: float) -> None:
        from jetbatch.sdk.connection import connect_nats

        from ..status import collect_status

        want_workers = len(self.worker_config_paths or []) or self.workers
        deadline = time.monotonic() + timeout_s
        began = time.monotonic()
        told, next_tell = (-1, -1), began
        nc = await connect_nats(self.url, **self.connect_options("admin"))
        try:
            while True:
                self._check_children()
                reports = await collect_status(nc, self.config.subjects, wait_s=0.2)
                workers = sum(1 for r in reports if r.role == "worker")
                classifiers = sum(1 for r in reports if r.role == "classifier")
                counts = (workers, classifiers)
                if self.progress is not None and (counts != told or time.monotonic() >= next_tell):
                    told, next_tell = counts, time.monotonic() + 2.0
                    also = f", {classifiers} of 1 classifier" if self.with_classifier else ""
                    self.progress(f"  waiting for the sidecars: {workers} of {want_workers} workers{also} ready ({time.monotonic() - began:.0f} s)")
                if workers >= want_workers and classifiers >= (1 if self.with_classifier else 0):
                    by_id = {r.id: r for r in reports}
                    self.reports = {name: by_id[i] for name, i in self.ids.items() if i in by_id}
                    return
                if time.monotonic() > deadline:
                    raise DeploymentError(
                        f"sidecars not ready after {timeout_s:.0f}s ({workers} workers, {classifiers} classifiers answered)\n"
                        + self.logs_tail()
                    )
        finally:
            await nc.close()

    def _check_children(self) -> None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                tail = self.logs_tail(name)
                # Status 2 is a user error the sidecar printed in one line; with no log file here,
                # that line went to this terminal already.
                raise DeploymentError(f"{name} exited with status {code}" + (f"\n{tail}" if tail else ""), shown=code == 2 and not tail)

    def logs_tail(self, name: str | None = None, lines: int = 20) -> str:
        parts = []
        for n, path in self._logs.items():
            if name is not None and n != name:
                continue
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {n} ---\n" + "\n".join(text))
        return "\n".join(parts)

    def stop_process(self, name: str, *, kill: bool = False, timeout_s: float = 30.0) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        if kill:
            proc.kill()
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=10)

    def stop(self) -> None:
        for name in list(self.procs):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name in list(self.procs):
            self.stop_process(name)
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> "Deployment":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _token(text: str) -> str:
    """A host name as one subject token (ids name key-value keys and discovery endpoints)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text) or "host"
