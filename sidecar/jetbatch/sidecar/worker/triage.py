"""A batch's requests sorted before anything runs, and an answer in the encoding its request
asked for. Pure: functions of the requests, the time and the predicted batch time."""

from __future__ import annotations

from typing import Any

import msgspec

from jetbatch.sdk.protocol import ContentType, ProtocolError, RequestMeta, decode_payload, encode_payload

from ..policy import cannot_finish
from .slots import Request

__all__ = ["as_asked", "too_late", "triage", "with_problem"]


def too_late(r: Request, now: float, predicted_s: float) -> str:
    """Why a request is answered ``deadline_exceeded`` instead of computed."""
    left_s = (r.meta.deadline or now) - now
    return f"deadline passed {-left_s:.3f}s before compute" if left_s < 0 else f"{left_s:.3f}s left, a batch takes about {predicted_s:.3f}s"


def with_problem(meta: RequestMeta, problem: str) -> RequestMeta:
    return msgspec.structs.replace(meta, problem=f"{meta.problem}; {problem}" if meta.problem else problem)


def triage(requests: list[Request], now: float, predicted_s: float) -> tuple[list[Request], list[Request], list[Request], list[Request]]:
    """Split a batch: malformed (answered bad_request, never retried), unable to finish before
    its deadline, first deliveries (computed together), redeliveries (suspects: computed apart,
    worker/quarantine.py)."""
    rejected: list[Request] = []
    expired: list[Request] = []
    fresh: list[Request] = []
    suspects: list[Request] = []
    for r in requests:
        if r.meta.problem is not None:
            rejected.append(r)
        elif cannot_finish(r.meta.deadline, now, predicted_s):
            expired.append(r)
        elif r.deliveries <= 1:
            fresh.append(r)
        else:
            suspects.append(r)
    return rejected, expired, fresh, suspects


def as_asked(body: bytes, ctype: ContentType, request_ctype: str | None) -> tuple[bytes, ContentType]:
    """A request sent as JSON gets its answer in JSON (a tensor as nested lists, plain values as
    they are), so a caller without the tensor or msgpack decoder (``nats sub``, curl through a
    gateway) can read it. A plain value JSON cannot hold (a msgpack extension) keeps msgpack."""
    if ctype not in (ContentType.TENSOR, ContentType.TENSORS, ContentType.MSGPACK) or (request_ctype or "").split(";")[0].strip().lower() != ContentType.JSON.value:
        return body, ctype
    value = decode_payload(body, ctype.value)
    if ctype is ContentType.MSGPACK:
        # Only what JSON holds as it is: bytes (base64 text), NaN (null) or integer keys (text)
        # would come back as something else, so such an output keeps msgpack.
        try:
            as_json, json_type = encode_payload(value, ContentType.JSON)
            if decode_payload(as_json, json_type.value) == value:
                return as_json, json_type
        except ProtocolError:
            pass
        return body, ctype
    if isinstance(value, dict):
        plain: Any = {k: v.to_torch().tolist() for k, v in value.items()}
    elif isinstance(value, tuple):
        plain = [v.to_torch().tolist() for v in value]
    else:
        plain = value.to_torch().tolist()
    return encode_payload(plain, ContentType.JSON)
