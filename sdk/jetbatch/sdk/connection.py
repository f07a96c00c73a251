"""Opening a NATS connection with jetbatch's defaults, shared by the SDK and the sidecars."""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any, Sequence

import nats.aio.client as nats_client
from nats.aio.client import Client as NATS

from . import failures
from .errors import ConnectionFailed

__all__ = ["DEFAULT_URL", "MAX_HEADER_BLOCK_BYTES", "connect_nats", "guard_read_loop", "parse_header_lines", "redacted_url", "stopped_reading", "unreadable_messages"]

DEFAULT_URL = "nats://127.0.0.1:4222"


async def connect_nats(
    url: str | Sequence[str] | None = None, *, connect_timeout_s: float = 2.0, **nats_options: Any
) -> NATS:
    """Connect to NATS, failing fast with :class:`ConnectionFailed` if no server answers, and
    reconnecting forever afterwards (a server restart must not kill a long-running producer).

    ``url`` defaults to ``$NATS_URL`` or ``nats://127.0.0.1:4222``; a comma-separated string names
    several servers of a cluster. Other keyword arguments go to ``nats.connect``.
    """
    servers = url or os.environ.get("NATS_URL") or DEFAULT_URL
    if isinstance(servers, str):
        servers_list = [s.strip() for s in servers.split(",") if s.strip()]
    else:
        servers_list = list(servers)
    options: dict[str, Any] = {
        "connect_timeout": connect_timeout_s,
        # nats-py retries the *initial* connect forever when this is -1: try a couple of times,
        # then switch to reconnecting forever once connected (below).
        "max_reconnect_attempts": 2,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "error_cb": _quiet_error_cb,
    }
    options.update(nats_options)
    # nats-py's connect_timeout covers opening the socket, not the TLS handshake or the server's
    # first INFO/PONG: a nats:// URL against a TLS-only server could wait forever. The caller's
    # connect_timeout_s bounds the whole connect, every attempt and the waits between them
    # included (retries fit inside it when a server refuses at once).
    bound_s = connect_timeout_s
    nc = NATS()
    _use_fast_header_parser(nc)
    _use_fast_header_values()
    shown = ", ".join(redacted_url(s) for s in servers_list)
    try:
        await asyncio.wait_for(nc.connect(servers=servers_list, **options), timeout=bound_s)
    except asyncio.TimeoutError as exc:
        await _close_quietly(nc)
        raise ConnectionFailed(
            f"cannot connect to NATS at {shown}: no handshake within {bound_s:.1f}s "
            "(a tls:// server reached with nats://, or a server that does not answer?)"
        ) from exc
    except failures.NO_SERVERS + failures.TRANSPORT_ERRORS as exc:
        await _close_quietly(nc)
        raise ConnectionFailed(f"cannot connect to NATS at {shown}: {exc or type(exc).__name__}") from exc
    if "max_reconnect_attempts" not in nats_options:
        nc.options["max_reconnect_attempts"] = -1
    return nc


_WHITESPACE = re.compile(r"\s")  # what str.isspace() calls whitespace (sre's Unicode category)


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """The header lines of one message as nats-py 2.16 parses them (``NATS._parse_header_lines``,
    the same output for every input: a property test holds them together), faster.

    nats-py tests each header name for whitespace with a generator over its characters: in the
    worker's profile that generator was the most called function of all, two header blocks a
    request (the request's, and its arrival event's, which carries every header of the request
    and six of the server's). One regular-expression search per name does the same test, and an
    ASCII block (every block jetbatch sends, and the server's) is decoded once, not twice a line."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return _parse_bytes(raw)
    out: dict[str, str] = {}
    for line in text.split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep:
            continue
        key = name.strip(_ASCII_SPACE)  # what bytes.strip() strips, not str.strip()'s \x1c-\x1f
        if _WHITESPACE.search(key) is not None:
            continue
        out[key] = value.strip(_ASCII_SPACE)
    return out


_ASCII_SPACE = " \t\n\r\x0b\x0c"


def _parse_bytes(raw: bytes) -> dict[str, str]:
    """:func:`parse_header_lines` of a block with bytes beyond ASCII, a line at a time."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep:
            continue  # an empty line, or one without a colon
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _WHITESPACE.search(key) is not None:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def _use_fast_header_parser(nc: NATS) -> None:
    """Have ``nc`` parse header blocks with :func:`parse_header_lines` (nats-py calls
    ``self._parse_header_lines(raw)``; an attribute of the instance answers it), and drop a
    message it cannot read (:func:`guard_read_loop`). Only on connections jetbatch opens; a
    nats-py without those methods keeps its own."""
    if hasattr(type(nc), "_parse_header_lines"):
        nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]
    guard_read_loop(nc)


# The largest header block a connection reads: JetStream stores none over 65 535 bytes (a
# delivery, a stored answer), and its republish of one (an arrival event) adds a few of the
# server's headers; nothing jetbatch sends on core subjects comes near it.
MAX_HEADER_BLOCK_BYTES = 65_536 + 4_096


def guard_read_loop(nc: NATS) -> None:
    """Have ``nc`` drop a message nats-py cannot read instead of ending its read loop, and one
    whose header block is over :data:`MAX_HEADER_BLOCK_BYTES` before nats-py parses it. Done on
    every connection jetbatch opens, and on one a caller hands to ``Client.from_connection``
    (what it changes for that caller's other subscriptions: such a message is dropped, where
    before it stopped the connection reading anything). Once per connection; a nats-py without
    the method is left as it is. :func:`unreadable_messages` counts what was dropped."""
    process = getattr(nc, "_process_msg", None)
    if process is None or getattr(process, "_jetbatch_guard", None) is not None:
        return
    dropped = [0]

    async def msg_or_drop(sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        if headers is not None and len(headers) > MAX_HEADER_BLOCK_BYTES:
            # nats-py parses a header block into a dict inside the read loop, before any
            # subscription's limit or jetbatch's checks: an 8 MiB block of tiny headers (on a
            # core subject: a cancel, the status subject, a caller's answers) held the loop 0.7 s
            # and 82 MB, and a burst got the connection cut as a slow consumer.
            dropped[0] += 1
            return
        # nats-py 2.16 decodes a message's subject, reply subject and inline status line
        # ("NATS/1.0 <status> <description>") outside any try, in its read loop: one message
        # with bytes that are not UTF-8 there (any client may publish one to a subject a sidecar
        # listens to: a tenant to its cancel subject, with any reply subject) raised out of the
        # loop, which then stopped for good with the connection still "connected": no delivery,
        # PubAck or cancel was read again. The parser has consumed the message before this call,
        # so dropping it leaves the stream of messages intact.
        try:
            await process(sid, subject, reply, data, headers)
        except Exception:  # noqa: BLE001 - hostile bytes: this message is dropped, the loop goes on
            dropped[0] += 1

    msg_or_drop._jetbatch_guard = dropped  # type: ignore[attr-defined]
    nc._process_msg = msg_or_drop  # type: ignore[method-assign]


def unreadable_messages(*connections: NATS | None) -> int:
    """How many messages the connections dropped (each counted once; None is skipped) because
    nats-py could not read them, or their header block was too large to read
    (:func:`guard_read_loop`)."""
    total = 0
    for nc in {id(c): c for c in connections if c is not None}.values():
        dropped = getattr(getattr(nc, "_process_msg", None), "_jetbatch_guard", None)
        total += dropped[0] if dropped else 0
    return total


def stopped_reading(nc: NATS) -> bool:
    """Whether ``nc`` says it is connected while its read loop has ended: nats-py ends that loop
    on an error it does not expect, and nothing restarts it; such a connection sends, but reads no
    message again (no delivery, PubAck or reply), until the process restarts. The sidecars'
    ``/healthz`` fails on it. (During a reconnect the connection is not "connected", and a new
    loop starts with the new socket.)"""
    task = getattr(nc, "_reading_task", None)
    return bool(nc.is_connected and task is not None and task.done())


# What nats-py's ``str.translate`` table does to a header value (CR and LF become spaces), as a
# table indexed by code point: a character past its end raises IndexError, a LookupError, and is
# left as it is, as a character missing from nats-py's dict is.
_HEADER_VALUE_TABLE: tuple[str, ...] = tuple(" " if c in (10, 13) else chr(c) for c in range(128))
_NATS_HEADER_VALUE_TABLE = {10: " ", 13: " "}


def _use_fast_header_values() -> None:
    """Have nats-py clean header values with a tuple indexed by code point (the same string for every
    input: a property test holds them together). nats-py passes every value of every publish
    through ``str.translate`` with a dict, which looks each distinct character up as a Python
    object: 1.5 µs for a 74-character value, 3.6 times the tuple's cost. An answer's five headers
    paid about 3 µs of the worker's CPU a request (``bench.overhead.process_profiles --sampler py-spy``).
    The table is nats-py's module global, read at each publish: this swaps it for the whole
    process, only while it is the table this was written against."""
    if getattr(nats_client, "_HEADER_VALUE_NEWLINES", None) == _NATS_HEADER_VALUE_TABLE:
        nats_client._HEADER_VALUE_NEWLINES = _HEADER_VALUE_TABLE  # type: ignore[attr-defined]


async def _close_quietly(nc: NATS) -> None:
    try:
        # Short: the connect already failed; this only stops nats-py's tasks.
        await asyncio.wait_for(nc.close(), timeout=0.5)
    except Exception:  # noqa: BLE001 - a half-open connection may fail to close cleanly
        pass


def redacted_url(url: str) -> str:
    """``url`` as it may be printed or logged: a user name, password or token in it (``nats://
    alice:s3cret@host``) written as ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return url
    return f"{scheme}{sep}***@{host}" if userinfo else url


async def _quiet_error_cb(exc: Exception) -> None:
    # nats-py reports every failed reconnect attempt here; callers see failures as typed errors
    # on the calls that need the connection instead.
    return None
