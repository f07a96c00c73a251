"""``jetbatch probe``: ask a local sidecar's /readyz (or /healthz): for container health checks.

Standard library only and no torch import, so a probe every few seconds costs milliseconds.
Each port gets one deadline for the whole exchange (connect, request, answer) and the answer is
read up to 4 KiB: whatever listens there (the NATS port given by mistake, or anything hostile
that drips bytes or sends an endless body) cannot hold a health check past its timeout or make
it allocate.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
import time
import urllib.parse
from typing import Any

from ._common import EXIT_FAILED, EXIT_OK, CliError, port_number, positive_seconds, shown

# What of an answer is read: the sidecar's is one short line.
MAX_ANSWER_BYTES = 4096
# Labels of letters, digits, `-` and `_` (container names such as `app_worker_1`), a final dot allowed.
_HOST_NAME = re.compile(r"\A[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?\Z")
_STATUS_LINE = re.compile(rb"\AHTTP/1\.[01] (\d{3})(?: [^\r\n]*)?\Z")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "probe", help="check a local sidecar's /readyz (exit 0 when ready): for HEALTHCHECK",
        description="GET /readyz (or /healthz with --live) on the first port that answers; exit 0 when it says 200.",
    )  # fmt: skip
    p.add_argument("--port", type=port_number, action="append", metavar="PORT", help="port(s) to try, in order (default: 9464, then 9465)")
    p.add_argument("--host", default="127.0.0.1", help="host of the sidecar (default: 127.0.0.1)")
    p.add_argument("--live", action="store_true", help="ask /healthz (alive) instead of /readyz (ready to serve)")
    p.add_argument("--model", default=None, help="ask whether this one model can be served now (/readyz?model=M)")
    p.add_argument("--timeout", type=positive_seconds, default=2.0, metavar="S", help="seconds per port, the whole exchange (default: 2)")
    p.set_defaults(run=run)


def _host(text: str) -> tuple[str, str]:
    """The address to connect to and the host as a URL writes it; CliError if neither a host name
    nor an IP address (an IPv6 one bare or in brackets)."""
    host = text.strip()
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(inner)
    except ValueError:
        if host is inner and len(host) <= 253 and _HOST_NAME.match(host):
            return host, host
        raise CliError(f"--host {shown(text)[:80]!r}: expected a host name or address") from None
    return str(address), f"[{address}]" if address.version == 6 else str(address)


class _Answer(Exception):
    """The exchange ended without an HTTP answer: why, in a few words."""


def _exchange(address: str, port: int, url_host: str, path: str, timeout_s: float) -> tuple[int, str]:
    """GET ``path`` within ``timeout_s`` in all; the status and the first line of the body."""
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Answer(f"no answer within {timeout_s:g} s")
        return remaining

    data = b""
    try:
        with socket.create_connection((address, port), timeout=left()) as sock:
            sock.settimeout(left())
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {url_host}:{port}\r\nConnection: close\r\n\r\n".encode())
            while len(data) < MAX_ANSWER_BYTES:
                sock.settimeout(left())
                chunk = sock.recv(MAX_ANSWER_BYTES - len(data))
                if not chunk:
                    break
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                if sep and _body_complete(head, body):
                    break
    except (TimeoutError, _Answer):
        if b"\r\n\r\n" not in data:
            raise _Answer(f"no answer within {timeout_s:g} s") from None
        # The status came in time; a body still coming at the deadline is read no further.
    except OSError as exc:
        raise _Answer(str(exc.strerror or exc)[:120]) from None
    head, sep, body = data.partition(b"\r\n\r\n")
    status = _STATUS_LINE.match(head.split(b"\r\n", 1)[0])
    if not sep or status is None:
        raise _Answer(f"not an HTTP answer ({shown(data[:40].decode('latin-1'))!r})")
    line = body.decode("utf-8", "replace").strip().split("\n", 1)[0]
    return int(status.group(1)), shown(line)[:200]


def _body_complete(head: bytes, body: bytes) -> bool:
    """Whether the body announced by ``Content-Length`` is all here (else read on to the close,
    the limit or the deadline)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return len(body) >= int(value.strip())
            except ValueError:
                return False
    return False


def run(args: argparse.Namespace) -> int:
    path = "/healthz" if args.live else "/readyz"
    if args.model is not None:
        if args.live:
            raise CliError("--model asks /readyz: it does not go with --live")
        from jetbatch.sdk.protocol import ProtocolError, validate_model_name

        try:
            validate_model_name(args.model)
        except ProtocolError:
            raise CliError(f"--model {shown(args.model)[:80]!r}: not a model name (1 to 64 of A-Z a-z 0-9 _ -)") from None
        path += "?model=" + urllib.parse.quote(args.model, safe="")
    address, url_host = _host(args.host)
    last = "no port answered"
    for port in args.port or [9464, 9465]:
        # Straight to the local sidecar: no proxy from the container's environment applies.
        url = f"http://{url_host}:{port}{path}"
        try:
            status, line = _exchange(address, port, url_host, path, args.timeout)
        except _Answer as why:
            last = f"{url}: {why}"
            continue
        print(f"{url}: {status} {line}")
        return EXIT_OK if status == 200 else EXIT_FAILED
    print(last)
    return EXIT_FAILED
