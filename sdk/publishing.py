"""Publishing a request into JetStream with retries, shared by the SDK (producers) and the
classifier (republishing to model queues).

Every retry goes out under the same ``Nats-Msg-Id``, so JetStream's dedupe window makes it safe.
JetStream's answers become typed errors: a full stream is :class:`Overloaded`, a message too big
is :class:`PayloadTooLarge`; "no stream answered" is asked of ``no_stream`` (which knows whether
that means an unknown model, a missing stream, or JetStream being briefly unavailable).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import nats.errors
import nats.js.errors

from .errors import BadRequest, ConnectionFailed, JetbatchError, Overloaded, PayloadTooLarge, RequestTimeout
from .protocol import JS_MSG_TOO_BIG, JS_STREAM_FULL

__all__ = ["PUBLISH_ATTEMPTS", "publish_with_retries"]

PUBLISH_ATTEMPTS = 6


async def publish_with_retries(
    js: Any,
    subject: str,
    data: bytes,
    headers: dict[str, str],
    *,
    deadline: float,
    request_id: str = "",
    no_stream: Callable[[], Awaitable[JetbatchError | None]] | None = None,
    attempts: int = PUBLISH_ATTEMPTS,
) -> Any:
    """Publish until JetStream acknowledges (the PubAck is returned) or ``deadline`` (monotonic
    seconds) passes; raises a typed :class:`JetbatchError` otherwise."""
    last: Exception | None = None
    for attempt in range(attempts):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            return await js.publish(subject, data, timeout=min(remaining, 5.0), headers=headers)
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLarge(f"payload of {len(data)} bytes is over the server's max_payload", request_id=request_id) from exc
        except (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError) as exc:
            definite = await no_stream() if no_stream is not None else None
            if definite is not None:
                raise definite from exc
            last = exc  # JetStream did not answer (a leader election, a restart): retry
            await asyncio.sleep(min(0.1 * 2**attempt, max(deadline - time.monotonic(), 0)))
        except nats.js.errors.APIError as exc:
            if exc.err_code in JS_STREAM_FULL:
                raise Overloaded(f"queue {subject} is full: {exc.description}", request_id=request_id) from exc
            if exc.err_code in JS_MSG_TOO_BIG:
                raise PayloadTooLarge(f"payload of {len(data)} bytes is over the stream's max message size", request_id=request_id) from exc
            raise JetbatchError(f"JetStream refused the request: {exc.description}", request_id=request_id) from exc
        except nats.errors.ConnectionClosedError as exc:
            raise ConnectionFailed("connection to NATS is closed", request_id=request_id) from exc
        except nats.errors.BadHeaderError as exc:
            raise BadRequest(f"invalid header name: {exc}", request_id=request_id) from exc
        except (nats.errors.OutboundBufferLimitError, nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
            last = exc  # reconnecting, or no PubAck: retry, dedupe makes it safe
            await asyncio.sleep(min(0.05 * 2**attempt, max(deadline - time.monotonic(), 0)))
        except nats.errors.Error as exc:
            last = exc
            await asyncio.sleep(min(0.05 * 2**attempt, max(deadline - time.monotonic(), 0)))
    raise RequestTimeout(f"JetStream did not acknowledge the request ({last!r})" if last else "JetStream did not acknowledge the request in time", request_id=request_id)
