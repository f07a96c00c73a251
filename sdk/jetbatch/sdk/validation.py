"""Checks on what a caller passes to the SDK, before anything is sent."""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from .protocol import Headers, ProtocolError
from .protocol.requests import HEADER_NAME_CHARS

__all__ = ["MAX_TIMEOUT_S", "check_timeout", "user_headers"]

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a deadline further out is a bug, not a request
_HEADER_KEY_RE = re.compile(f"^[{HEADER_NAME_CHARS}]{{1,128}}$")  # what NATS can carry as a header name
_RESERVED_HEADERS = frozenset(h.lower() for h in (Headers.MSG_ID, Headers.REPLY_KEY, Headers.REPLY_TO, Headers.TENANT, Headers.PRIORITY))


def check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ProtocolError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0 or timeout > MAX_TIMEOUT_S:
        raise ProtocolError(f"timeout must be a finite number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {timeout!r}")
    return float(timeout)


def user_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The caller's extra headers, checked: names NATS can carry, string values, and none of the
    headers the SDK owns."""
    out: dict[str, str] = {}
    for key, value in (headers or {}).items():
        if not isinstance(key, str) or not _HEADER_KEY_RE.match(key):
            raise ProtocolError(f"invalid header name {key!r}")
        if not isinstance(value, str):
            raise ProtocolError(f"header {key}: value must be a string, got {type(value).__name__}")
        if key.lower() in _RESERVED_HEADERS:
            raise ProtocolError(f"header {key} is set by the SDK (use request_id= for the request id, priority= for the class)")
        out[key] = value
    return out
