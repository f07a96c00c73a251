"""A worker's ring (``recording.RingRecorder``) asked for over NATS: ``jetbatch ring``.

A worker run with ``--ring-minutes`` answers requests on ``<prefix>.ring.<worker id>``
(``Subjects.ring``) with its dump, the same recording SIGUSR1 writes to a file: sent to the
request's reply inbox in parts of at most the server's ``max_payload`` (a ring is often MiBs),
each part with its index, the dump's size and SHA-256 in headers, so the asker knows when it has
all and that nothing was lost on the way (core NATS does not resend). Sent over NATS rather than
written to the worker's disk: a worker in a container has no disk an operator reads.

The request is input: its body is read with limits (at most :data:`MAX_REQUEST_BYTES`, a JSON
object whose one field ``chunk_bytes`` is bounded), an answer goes only to a reply subject the
worker's ``ReplyPolicy`` allows (inboxes, as for status), and nothing raises out of the handler.
Requests are answered one at a time and at most :data:`PENDING_REQUESTS` wait: a flood is
dropped by the client's pending limit, never a pile of dumps in memory.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from typing import Annotated, Any

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetbatch.sdk.protocol import Headers, ReplyPolicy, Subjects

from .errors import TRANSPORT_ERRORS, SidecarError
from .recording import RingRecorder
from .status import allowed_reply

__all__ = ["MAX_REQUEST_BYTES", "PENDING_REQUESTS", "RingRequest", "RingTransferError", "fetch_ring", "serve_ring"]

log = logging.getLogger("jetbatch.ring")

MAX_REQUEST_BYTES = 1024
PENDING_REQUESTS = 4
MIN_CHUNK_BYTES = 1024
# Room left in a part for its headers (index, size, digest: under 200 bytes) and the protocol line.
_HEADROOM_BYTES = 1024
# Parts published between two flushes: the outgoing buffer holds at most this many parts.
_FLUSH_EVERY = 8
_MAX_PARTS = 10_000_000
_DIGITS = re.compile(r"[0-9]{1,15}")


class RingTransferError(SidecarError):
    """A ring dump that could not be had: no worker answered, it answered an error, or the parts
    that came were not the whole dump."""


class RingRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A request's body (optional): ``chunk_bytes``, the largest part wanted (the server's
    ``max_payload`` is the most, and the default)."""

    chunk_bytes: Annotated[int, msgspec.Meta(ge=MIN_CHUNK_BYTES, le=64 * 1024 * 1024)] | None = None


_request_decoder = msgspec.json.Decoder(RingRequest)


def _chunk_bytes(body: bytes, max_payload: int) -> int:
    most = max(MIN_CHUNK_BYTES, max_payload - _HEADROOM_BYTES)
    if not body.strip():
        return most
    if len(body) > MAX_REQUEST_BYTES:
        raise RingTransferError(f"a ring request is at most {MAX_REQUEST_BYTES} bytes")
    try:
        asked = _request_decoder.decode(body).chunk_bytes
    except msgspec.DecodeError as exc:
        raise RingTransferError(f"not a ring request: {exc}") from None
    return most if asked is None else min(asked, most)


async def serve_ring(nc: NATS, subjects: Subjects, worker_id: str, ring: RingRecorder, policy: ReplyPolicy, *, out: NATS | None = None) -> Any:
    """Answer ring requests for ``worker_id`` with ``ring``'s dump; returns the subscription.
    ``out``: the connection answers go out on (the reply identity's, as for status)."""
    out = out or nc

    async def on_request(msg: Msg) -> None:
        if allowed_reply(msg, policy) is None:
            return
        try:
            await _answer(out, msg.reply, msg.data, ring)
        except TRANSPORT_ERRORS as exc:
            log.warning("ring dump to %s not sent: %s", msg.reply, exc)
        except Exception:  # the subscription must outlive any one request
            log.exception("ring dump to %s failed", msg.reply)

    # Room for a few requests of the largest size the server lets through: an oversized body is
    # answered (refused), not dropped unanswered; a flood beyond that is dropped.
    pending_bytes = PENDING_REQUESTS * max(nc.max_payload, MAX_REQUEST_BYTES)
    return await nc.subscribe(subjects.ring(worker_id), cb=on_request, pending_msgs_limit=PENDING_REQUESTS, pending_bytes_limit=pending_bytes)


async def _answer(out: NATS, reply: str, body: bytes, ring: RingRecorder) -> None:
    try:
        chunk = _chunk_bytes(body, out.max_payload)
        lines = ring.lines()  # on the event loop, between two events: a whole ring
    except SidecarError as exc:
        await out.publish(reply, b"", headers={Headers.RING_ERROR: str(exc)[:200]})
        return

    def join() -> tuple[bytes, str]:
        data = b"".join(line + b"\n" for line in lines)
        return data, hashlib.sha256(data).hexdigest()

    data, digest = await anyio.to_thread.run_sync(join)  # MiBs: off the event loop
    parts = max(1, math.ceil(len(data) / chunk))
    for i in range(parts):
        headers = {Headers.RING_PART: f"{i}/{parts}", Headers.RING_BYTES: str(len(data)), Headers.RING_SHA256: digest}
        await out.publish(reply, data[i * chunk : (i + 1) * chunk], headers=headers)
        if i % _FLUSH_EVERY == _FLUSH_EVERY - 1:
            await out.flush()
    await out.flush()
    log.info("ring dump sent to %s: %d bytes in %d parts", reply, len(data), parts)


async def fetch_ring(nc: NATS, subjects: Subjects, worker_id: str, *, timeout_s: float, chunk_bytes: int | None = None) -> bytes:
    """Ask worker ``worker_id`` for its ring dump; the recording's bytes, checked whole (every
    part, the size and the SHA-256). :class:`RingTransferError` otherwise, within ``timeout_s``."""
    subject = subjects.ring(worker_id)
    inbox = nc.new_inbox()
    parts: dict[int, bytes] = {}
    shape: list[tuple[int, int, str]] = []  # (parts, bytes, digest), as the first part said
    failure: list[str] = []
    done = anyio.Event()

    async def on_reply(msg: Msg) -> None:
        headers = msg.headers or {}
        if headers.get("Status") == "503":
            failure.append(f"no worker answers on {subject} (is {worker_id} running, with --ring-minutes?)")
        elif Headers.RING_ERROR in headers:
            failure.append(f"worker {worker_id}: {headers[Headers.RING_ERROR][:200]}")
        else:
            try:
                index, count, size, digest = _part_headers(headers)
            except ValueError as exc:
                failure.append(f"worker {worker_id}: a part that is not one: {exc}")
            else:
                shape[:] = shape or [(count, size, digest)]
                if shape[0] != (count, size, digest) or index >= count:
                    failure.append(f"worker {worker_id}: parts of two dumps")
                parts[index] = msg.data
                if len(parts) < count and not failure:
                    return
        done.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        body = b"" if chunk_bytes is None else msgspec.json.encode(RingRequest(chunk_bytes=chunk_bytes))
        await nc.publish(subject, body, reply=inbox)
        with anyio.move_on_after(timeout_s):
            await done.wait()
    finally:
        await sub.unsubscribe()
    if failure:
        raise RingTransferError(failure[0])
    if not shape:
        raise RingTransferError(f"no answer from worker {worker_id} on {subject} within {timeout_s:g} s")
    count, size, digest = shape[0]
    if len(parts) < count:
        raise RingTransferError(f"worker {worker_id}: {len(parts)} of {count} parts came within {timeout_s:g} s")
    data = b"".join(parts[i] for i in range(count))
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise RingTransferError(f"worker {worker_id}: the parts are not the dump it announced ({len(data)} of {size} bytes, or another digest)")
    return data


def _part_headers(headers: dict[str, str]) -> tuple[int, int, int, str]:
    index, _, count = headers.get(Headers.RING_PART, "").partition("/")
    size, digest = headers.get(Headers.RING_BYTES, ""), headers.get(Headers.RING_SHA256, "")
    if not (_DIGITS.fullmatch(index) and _DIGITS.fullmatch(count) and _DIGITS.fullmatch(size)):
        raise ValueError(f"{Headers.RING_PART} {headers.get(Headers.RING_PART, '')[:40]!r}")
    if not 0 < int(count) <= _MAX_PARTS or len(digest) != 64:
        raise ValueError("its count or digest is out of range")
    return int(index), int(count), int(size), digest
