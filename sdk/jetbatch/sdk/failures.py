"""The one module that names nats-py's exception classes: NATS and JetStream failures grouped by
what they mean to jetbatch (the way httpx maps its transports' errors in one place). Every other
module, in the SDK and the sidecars, catches these groups, so a nats-py release that moves or
renames a class is one edit here, and two call sites cannot disagree on what "timed out" or
"not found" covers.

Each group is a tuple of exception classes (``except TIMEOUTS:``; join groups with ``+``).
"""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors

__all__ = [
    "ALREADY_ACKED", "API_ERRORS", "BAD_HEADER", "BAD_REQUEST", "CLOSED", "CONFLICT", "DROPPED", "KEY_MISSING",
    "NOT_FOUND", "NO_KEYS", "NO_SERVERS", "NO_STREAM", "SLOW", "TIMEOUTS", "TOO_LARGE", "TRANSPORT_ERRORS", "UNAVAILABLE",
    "UNREADABLE_REPLY", "api_error",
]  # fmt: skip

Errors = tuple[type[BaseException], ...]

# Anything a call to NATS or JetStream raises when the server, the connection or an election is
# in the way (not a bug of ours).
TRANSPORT_ERRORS: Errors = (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, TimeoutError)
# No answer within the call's deadline (a request, a fetch, an API call).
TIMEOUTS: Errors = (nats.errors.TimeoutError, asyncio.TimeoutError, TimeoutError)
# JetStream answered with an error (``.code``, ``.err_code``, ``.description``).
API_ERRORS: Errors = (nats.js.errors.APIError,)
# A stream, consumer or bucket that does not exist (404 from the JetStream API).
NOT_FOUND: Errors = (nats.js.errors.NotFoundError,)
# A key-value entry that does not exist or was deleted.
KEY_MISSING: Errors = (nats.js.errors.KeyNotFoundError,)
# A key-value bucket with no keys (``keys()`` on an empty bucket).
NO_KEYS: Errors = (nats.js.errors.NoKeysError,)
# The request was malformed or conflicts with what exists (400: a config that cannot be updated).
BAD_REQUEST: Errors = (nats.js.errors.BadRequestError,)
# A compare-and-set lost: someone else wrote the key first.
CONFLICT: Errors = (nats.js.errors.KeyWrongLastSequenceError,)
# JetStream is not available now (no quorum, no meta leader, an election).
UNAVAILABLE: Errors = (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError)
# A publish that no stream captured.
NO_STREAM: Errors = (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError)
# The connection is closed for good.
CLOSED: Errors = (nats.errors.ConnectionClosedError,)
# The payload is over the server's max_payload.
TOO_LARGE: Errors = (nats.errors.MaxPayloadError,)
# A header nats-py refuses to write.
BAD_HEADER: Errors = (nats.errors.BadHeaderError,)
# A reply nats-py could not read as a PubAck (js.publish parses whatever comes first to the
# request's inbox: junk JSON, a list, a body nested too deep, a stream that is not a name).
UNREADABLE_REPLY: Errors = (ValueError, TypeError, KeyError, AttributeError, RecursionError)
# The client could not get a publish out or acknowledged in time (its buffer is full, or no PubAck).
SLOW: Errors = (nats.errors.OutboundBufferLimitError, nats.errors.TimeoutError, asyncio.TimeoutError)
# No server could be reached at connect.
NO_SERVERS: Errors = (nats.errors.NoServersError, OSError)
# An ack or nak of a message already acknowledged.
ALREADY_ACKED: Errors = (nats.errors.MsgAlreadyAckdError,)
# A message a subscription's pending limit dropped (reported to the error callback, not raised).
DROPPED: Errors = (nats.errors.SlowConsumerError,)


def api_error(code: int, err_code: int, description: str) -> BaseException:
    """The exception nats-py raises for a JetStream API answer's ``error`` (404 a
    ``NOT_FOUND``, 503 ``UNAVAILABLE``, ...), for an answer read without nats-py's parser."""
    try:
        nats.js.errors.APIError.from_error({"code": code, "err_code": err_code, "description": description})
    except nats.js.errors.APIError as exc:
        return exc
    return nats.js.errors.APIError(code=code, err_code=err_code, description=description)  # pragma: no cover: from_error always raises
