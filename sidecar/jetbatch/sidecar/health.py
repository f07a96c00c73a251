"""Each sidecar's HTTP endpoints for the tools operators already run: ``/healthz`` (alive),
``/readyz`` (ready to serve) and ``/metrics`` (Prometheus text, rendered by the OpenTelemetry
Prometheus exporter's collector).

A deliberately small HTTP/1.1 server on anyio: GET only, one request per connection, a 4 KiB
request head read within 1 s and the whole exchange within 5 s, at most 32 connections (a new one
ends the oldest still silent), so a probe or a hostile client can neither hold the sidecar's event
loop nor make it allocate, nor keep the probes out. Anything else gets 400, 404 or 405 and the connection closes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import urllib.parse

import anyio
import anyio.abc

from jetbatch.sdk.protocol import ProtocolError, validate_model_name

__all__ = ["Check", "ProbeServer", "prometheus_text"]

log = logging.getLogger("jetbatch.health")

_MAX_HEAD = 4096
_HEAD_TIMEOUT_S = 1.0  # a probe sends its request at once; a client that does not is dropped
_TIMEOUT_S = 5.0  # a whole exchange, read and write: a client that stops reading is dropped
# Probes and scrapes need a handful; past this a new connection ends the oldest one still
# sending its request (or, if none is, is refused). Refusing them all let 32 idle sockets,
# renewed every 5 s, fail every liveness and readiness probe.
_MAX_CONNECTIONS = 32

# A check returns (ok, one line saying why).
Check = Callable[[], tuple[bool, str]]


@dataclass
class ProbeServer:
    """Serves ``/healthz`` from ``alive``, ``/readyz`` from ``ready`` and ``/metrics`` from
    ``metrics`` (None: 404) on ``host:port`` (port 0: any free port; see :attr:`port`)."""

    host: str
    port: int
    alive: Check
    ready: Check
    metrics: Callable[[], bytes] | None = None
    # /readyz?model=<m>: (status, one line) for one model (404: not served here); None: no models.
    model_ready: Callable[[str], tuple[int, str]] | None = None
    _open: int = field(default=0, init=False, repr=False)  # connections being served now
    # The connections still reading their request head, oldest first (each one's cancel scope).
    _reading: dict[int, anyio.CancelScope] = field(default_factory=dict, init=False, repr=False)
    _accepted: int = field(default=0, init=False, repr=False)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the bound port through ``task_status`` (``tg.start``).
        Nothing a client does (nor running out of file descriptors) ends it with an error: the
        endpoints must never take the sidecar down."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port, reuse_port=False)
        sock = listener.extra(anyio.abc.SocketAttribute.local_address)
        self.port = int(sock[1])  # type: ignore[index]
        log.info("health and metrics on http://%s:%d (/healthz, /readyz, /metrics)", self.host, self.port)
        task_status.started(self.port)
        async with listener, anyio.create_task_group() as tg:
            # One accept loop per bound socket (a host name may bind IPv4 and IPv6).
            for sock_listener in getattr(listener, "listeners", [listener]):
                tg.start_soon(self._accept_loop, sock_listener, tg)

    async def _accept_loop(self, listener: Any, tg: anyio.abc.TaskGroup) -> None:
        failures = 0
        while True:
            try:
                stream = await listener.accept()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - EMFILE and friends, or a bug: wait, go on
                failures += 1
                if failures == 1:
                    log.warning("health endpoint cannot accept a connection: %r", exc)
                await anyio.sleep(min(1.0, 0.05 * failures))
                continue
            if self._open >= _MAX_CONNECTIONS:
                if not self._reading:
                    await _close(stream)
                    continue
                self._reading.pop(next(iter(self._reading))).cancel()  # the oldest still silent
            self._open += 1
            self._accepted += 1
            tg.start_soon(self._handle_counted, stream, self._accepted)

    async def _handle_counted(self, stream: anyio.abc.SocketStream, key: int) -> None:
        try:
            await self._handle(stream, key)
        finally:
            self._open -= 1

    async def _handle(self, stream: anyio.abc.SocketStream, key: int) -> None:
        async with stream:
            try:
                with anyio.fail_after(_TIMEOUT_S):
                    with anyio.CancelScope() as reading:
                        self._reading[key] = reading
                        try:
                            with anyio.fail_after(_HEAD_TIMEOUT_S):
                                head = await _read_head(stream)
                        finally:
                            self._reading.pop(key, None)
                    if reading.cancelled_caught:
                        return  # made room for a newer connection
                    status, ctype, body = self._respond(head)
                    await stream.send(_response(status, ctype, body))
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
            except Exception:  # noqa: BLE001 - a probe must never take the sidecar down
                log.exception("health endpoint failed")
                try:
                    await stream.send(_response(500, "text/plain", b"internal error\n"))
                except Exception:  # noqa: BLE001
                    pass

    def _model_ready(self, model: str) -> tuple[int, str, bytes]:
        try:
            validate_model_name(model)
        except ProtocolError:
            return 400, "text/plain", b"bad request: not a model name\n"
        if self.model_ready is None:
            return 404, "text/plain", b"no models are served here\n"
        ok, why = self.ready()
        if not ok:
            return 503, "text/plain", (why + "\n").encode()
        status, line = self.model_ready(model)
        return status, "text/plain", (line + "\n").encode()

    def _respond(self, head: bytes | None) -> tuple[int, str, bytes]:
        if head is None:
            return 400, "text/plain", b"bad request\n"
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "text/plain", b"bad request\n"
        path, _, query = parts[1].partition("?")
        method, target = parts[0], path
        if method != "GET":
            return 405, "text/plain", b"method not allowed: GET only\n"
        if target in ("/healthz", "/livez"):
            ok, why = self.alive()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        if target == "/readyz":
            model = _query_model(query)
            if model is not None:
                return self._model_ready(model)
            ok, why = self.ready()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        if target == "/metrics" and self.metrics is not None:
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics()
        return 404, "text/plain", b"not found\n"


def _query_model(query: str) -> str | None:
    """The ``model`` of a query string (``model=m1``), else None. Hostile input: the value is
    checked as a model name by the caller before anything uses it."""
    for pair in query.split("&")[:8]:
        key, _, value = pair.partition("=")
        if key == "model":
            return urllib.parse.unquote(value)[:256]
    return None


async def _read_head(stream: anyio.abc.SocketStream) -> bytes | None:
    """The request head (up to the blank line), or None when it is over the limit or cut short."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        try:
            chunk = await stream.receive(_MAX_HEAD + 1 - len(data))  # never more than the limit and one byte
        except anyio.EndOfStream:
            return None
        data += chunk
        if len(data) > _MAX_HEAD:
            return None
    return data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")


async def _close(stream: anyio.abc.SocketStream) -> None:
    try:
        await stream.aclose()
    except Exception:  # noqa: BLE001
        pass


def _response(status: int, ctype: str, body: bytes) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error", 503: "Service Unavailable"}
    head = (
        f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\nCache-Control: no-store\r\n"
        + ("Allow: GET\r\n" if status == 405 else "")
        + "\r\n"
    )
    return head.encode("latin-1") + body


def prometheus_text() -> bytes:
    """The Prometheus exposition of everything the process's Prometheus registry collects (the
    OpenTelemetry Prometheus reader registers there; see sidecar/otel.py)."""
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY)
