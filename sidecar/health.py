"""Each sidecar's HTTP endpoints for the tools operators already run: ``/healthz`` (alive),
``/readyz`` (ready to serve) and ``/metrics`` (Prometheus text, rendered by the OpenTelemetry
Prometheus exporter's collector).

A deliberately small HTTP/1.1 server on anyio: GET only, one request per connection, a 4 KiB
request head read within 5 s, so a probe or a hostile client can neither hold the sidecar's event
loop nor make it allocate. Anything else gets 400, 404 or 405 and the connection closes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import anyio
import anyio.abc

__all__ = ["Check", "ProbeServer", "prometheus_text"]

log = logging.getLogger("jetbatch.health")

_MAX_HEAD = 4096
_READ_TIMEOUT_S = 5.0

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

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the bound port through ``task_status`` (``tg.start``)."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port, reuse_port=False)
        sock = listener.extra(anyio.abc.SocketAttribute.local_address)
        self.port = int(sock[1])  # type: ignore[index]
        log.info("health and metrics on http://%s:%d (/healthz, /readyz, /metrics)", self.host, self.port)
        task_status.started(self.port)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(_READ_TIMEOUT_S):
                    head = await _read_head(stream)
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

    def _respond(self, head: bytes | None) -> tuple[int, str, bytes]:
        if head is None:
            return 400, "text/plain", b"bad request\n"
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method != "GET":
            return 405, "text/plain", b"method not allowed\n"
        if target in ("/healthz", "/livez"):
            ok, why = self.alive()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        if target == "/readyz":
            ok, why = self.ready()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        if target == "/metrics" and self.metrics is not None:
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics()
        return 404, "text/plain", b"not found\n"


async def _read_head(stream: anyio.abc.SocketStream) -> bytes | None:
    """The request head (up to the blank line), or None when it is over the limit or cut short."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > _MAX_HEAD:
            return None
        try:
            chunk = await stream.receive(_MAX_HEAD)
        except anyio.EndOfStream:
            return None
        data += chunk
    return data


def _response(status: int, ctype: str, body: bytes) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error", 503: "Service Unavailable"}
    head = (
        f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n"
    )
    return head.encode("latin-1") + body


def prometheus_text() -> bytes:
    """The Prometheus exposition of everything the process's Prometheus registry collects (the
    OpenTelemetry Prometheus reader registers there; see sidecar/otel.py)."""
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY)
