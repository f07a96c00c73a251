"""Hostile input: request headers parsed once, with limits, and the reply policy that decides
where a sidecar may answer.

Every header of a request is attacker-controlled. The sidecars parse them here, once, with
length and range limits, and never let a request choose where they publish except through a
reply policy (an allowlist of reply prefixes).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from .names import Headers, Priority, ProtocolError, validate_model_name, validate_token

MAX_REPLY_SUBJECT_BYTES = 255  # far under the server's 4 KiB control line (subject + reply + sizes)
MAX_CONTENT_TYPE_BYTES = 128
MAX_TRACEPARENT_BYTES = 256
MAX_TRACESTATE_BYTES = 512  # the W3C limit a propagator must keep
MAX_DEADLINE_DIGITS = 15  # Unix milliseconds up to the year 33658
DEFAULT_REPLY_PREFIXES: tuple[str, ...] = ("_INBOX",)
# Every sidecar connection makes its inboxes under a token that starts with this (below its
# configured inbox prefix: ``_INBOX._jbs<12 hex>.``), and no sidecar answers there: its pull
# requests, PubAcks and watchers are answered there, and their subjects are not secret (an
# answer's own publish carries the worker's PubAck subject as its reply, in its caller's sight).
# Callers' inboxes never have such a token (nats-py's are ``_INBOX.<22 alphanumerics>``).
SIDECAR_INBOX_MARK = "_jbs"
DEFAULT_TENANT_REPLY_PREFIX = "_INBOX.{tenant}"

# A replayed dead letter's id ends in this and the letter's sequence (see replay_id).
REPLAY_MARK = ".replay-"
_REPLAY_RE = re.compile(r"\.replay-[0-9]{1,20}\Z")
_SUBJECT_CHARS_RE = re.compile(r"^[!-~]+$")  # printable ASCII, no spaces or control characters
_DEADLINE_RE = re.compile(r"^[0-9]{1,%d}$" % MAX_DEADLINE_DIGITS)
_TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[!-~]*)?$")


def _subject_tokens_ok(subject: str) -> bool:
    """Printable ASCII within the length limit, no wildcard, no empty token."""
    if len(subject) > MAX_REPLY_SUBJECT_BYTES or not _SUBJECT_CHARS_RE.match(subject):
        return False  # (the pattern admits ASCII only, so characters are bytes here)
    return "*" not in subject and ">" not in subject and ".." not in subject and subject[0] != "." and subject[-1] != "."


@dataclass(frozen=True)
class ReplyPolicy:
    """Where a sidecar may send a request's answer: only under one of ``allowed_prefixes`` (a
    subject prefix followed by at least one more token), never under ``$`` (the JetStream, KV and
    system APIs) nor under ``forbidden_prefixes`` (the deployment's own ``<prefix>.``), whatever
    the allowlist says. A request that arrived on a tenant's ingress may only be answered under
    ``tenant_prefix`` with its tenant filled in.
    """

    allowed_prefixes: tuple[str, ...] = DEFAULT_REPLY_PREFIXES
    tenant_prefix: str = DEFAULT_TENANT_REPLY_PREFIX
    forbidden_prefixes: tuple[str, ...] = ()

    def check(self, subject: str, *, tenant: str | None = None) -> str:
        """Return ``subject`` if the policy allows answering there, else raise :class:`ProtocolError`."""
        if not isinstance(subject, str) or not _subject_tokens_ok(subject):
            shown = subject[:60] + "..." if isinstance(subject, str) and len(subject) > 60 else subject
            raise ProtocolError(
                f"header {Headers.REPLY_TO}: {shown!r} is not a valid reply subject "
                f"(printable ASCII, no wildcards or empty tokens, at most {MAX_REPLY_SUBJECT_BYTES} bytes)"
            )
        if subject.startswith("$") or subject in self.forbidden_prefixes or subject.startswith(self._forbidden_heads):
            raise ProtocolError(f"header {Headers.REPLY_TO}: replies to {subject.split('.')[0]}.* are not allowed")
        if "." + SIDECAR_INBOX_MARK in subject:
            raise ProtocolError(f"header {Headers.REPLY_TO}: replies to a sidecar's own inbox ({SIDECAR_INBOX_MARK}...) are not allowed")
        # A subject "under" a prefix has at least one more token, and tokens are never empty.
        heads = (self.tenant_prefix.format(tenant=tenant) + ".",) if tenant is not None else self._allowed_heads
        if not subject.startswith(heads):
            raise ProtocolError(f"header {Headers.REPLY_TO}: reply subjects must lie under {' or '.join(heads)}")
        return subject

    @functools.cached_property
    def _allowed_heads(self) -> tuple[str, ...]:
        return tuple(p + "." for p in self.allowed_prefixes)

    @functools.cached_property
    def _forbidden_heads(self) -> tuple[str, ...]:
        return tuple(f + "." for f in self.forbidden_prefixes)


class RequestMeta(msgspec.Struct, frozen=True):
    """What a sidecar takes from a request's headers, each value checked (a Struct: built once a
    request, where a frozen dataclass's ``__init__`` cost ten times as much).

    ``problem`` is set when a header is invalid: the request gets ``bad_request`` (sent to
    ``reply_to`` only when the reply subject itself passed the policy) and is not run.
    ``reply_key`` (protocol 3) names where the answer goes: :meth:`Subjects.answer`, under the
    deployment's own prefix and the request's tenant, so no header can aim it anywhere else.
    """

    request_id: str
    reply_to: str | None
    deadline: float | None  # Unix seconds
    content_type: str | None
    model: str | None
    tenant: str | None
    problem: str | None = None
    priority: Priority = Priority.INTERACTIVE
    reply_key: str | None = None


def dedupe_id(tenant: str | None, request_id: str) -> str:
    """The ``Nats-Msg-Id`` a request is published under. JetStream dedupes on it across a whole
    stream, so a tenant's ids carry the tenant (``<tenant>.<request id>``): two tenants that
    choose the same request id are two requests, not a retry of one."""
    return f"{tenant}.{request_id}" if tenant else request_id


def replay_id(msg_id: str, letter_seq: int) -> str:
    """The ``Nats-Msg-Id`` a dead letter is replayed under: its request's own (a replay mark it
    already had taken off) plus ``.replay-<dead-letter sequence>``. JetStream drops a publish whose
    id it saw within the duplicate window, so a replay under the original id soon after it was
    lost; this id is new to the stream, yet the same letter replayed twice is one message."""
    return f"{_REPLAY_RE.sub('', msg_id)}{REPLAY_MARK}{letter_seq}"


def request_id_of(msg_id: str | None, tenant: str | None) -> str | None:
    """The request id in a ``Nats-Msg-Id`` (see :func:`dedupe_id` and :func:`replay_id`): the
    tenant's prefix taken off when ``tenant`` is the request's (from the subject or the
    classifier, never the producer's word), and a replay mark taken off. Any other dot is left in
    place, so the id fails validation as it should."""
    if msg_id and REPLAY_MARK in msg_id:
        msg_id = _REPLAY_RE.sub("", msg_id)
    if msg_id and tenant and msg_id.startswith(f"{tenant}."):
        return msg_id[len(tenant) + 1 :]
    return msg_id


def new_request_id() -> str:
    """A fresh request id: 32 hex characters, 128 random bits (``uuid4().hex`` costs four
    times as much for six fixed bits, once a request)."""
    return os.urandom(16).hex()


# What a refusal names (built once: they are arguments of every request's checks).
_RID_WHAT = f"request id ({Headers.MSG_ID})"
_KEY_WHAT = f"header {Headers.REPLY_KEY}:"


def parse_request_headers(
    headers: Mapping[str, str] | None,
    *,
    policy: ReplyPolicy,
    tenant: str | None = None,
    fallback_id: str | Callable[[], str] = "",
) -> RequestMeta:
    """Parse a request's headers with limits; never raises. ``tenant`` is what the sidecar knows
    from the subject (classifier) or the classifier's header (worker), never the producer's word.
    ``fallback_id`` (or a function making one, called only when needed) names a request whose
    ``Nats-Msg-Id`` is missing or invalid."""
    h = headers or {}
    problems: list[str] = []
    rid = request_id_of(h.get(Headers.MSG_ID), tenant)
    if rid is None or rid == "":
        rid = fallback_id() if callable(fallback_id) else fallback_id
    try:
        validate_token(rid, _RID_WHAT)
    except ProtocolError as exc:
        problems.append(str(exc))
        rid = fallback_id() if callable(fallback_id) else fallback_id
    reply_key: str | None = None
    raw_key = h.get(Headers.REPLY_KEY)
    if raw_key is not None:
        try:
            reply_key = validate_token(raw_key, _KEY_WHAT)
        except ProtocolError as exc:
            problems.append(str(exc))
    reply_to: str | None = None
    raw_reply = h.get(Headers.REPLY_TO)
    if raw_reply is not None and raw_key is None:
        # With a key (protocol 3) the answer goes to the key's subject: a reply subject beside
        # it is never used, so it is not checked either.
        try:
            reply_to = policy.check(raw_reply, tenant=tenant)
        except ProtocolError as exc:
            problems.append(str(exc))
    deadline: float | None = None
    raw_deadline = h.get(Headers.DEADLINE)
    if raw_deadline is not None:
        if isinstance(raw_deadline, str) and _DEADLINE_RE.match(raw_deadline):
            deadline = int(raw_deadline) / 1000.0
        else:
            problems.append(
                f"header {Headers.DEADLINE}: expected Unix milliseconds as 1 to {MAX_DEADLINE_DIGITS} digits, "
                f"got {_shorten(raw_deadline)!r}"
            )
    content_type = h.get(Headers.CONTENT_TYPE)
    if content_type is not None and (len(content_type) > MAX_CONTENT_TYPE_BYTES or not _SUBJECT_CHARS_RE.match(content_type.replace(" ", "x"))):
        problems.append(f"header {Headers.CONTENT_TYPE}: {_shorten(content_type)!r} is not a media type")
        content_type = None
    model = h.get(Headers.MODEL) or None
    if model is not None:
        try:
            validate_model_name(model)
        except ProtocolError as exc:
            problems.append(f"header {Headers.MODEL}: {exc}")
            model = None
    priority = Priority.INTERACTIVE
    raw_priority = h.get(Headers.PRIORITY)
    if raw_priority is not None:
        try:
            priority = Priority(raw_priority)
        except ValueError:
            problems.append(f"header {Headers.PRIORITY}: expected one of {', '.join(p.value for p in Priority)}, got {_shorten(raw_priority)!r}")
    traceparent = h.get(Headers.TRACEPARENT)
    if traceparent is not None and (len(traceparent) > MAX_TRACEPARENT_BYTES or not _TRACEPARENT_RE.match(traceparent)):
        problems.append(f"header {Headers.TRACEPARENT}: not a W3C trace context")
    tracestate = h.get(Headers.TRACESTATE)
    if tracestate is not None and len(tracestate) > MAX_TRACESTATE_BYTES:
        problems.append(f"header {Headers.TRACESTATE}: over {MAX_TRACESTATE_BYTES} characters")
    return RequestMeta(
        request_id=rid,
        reply_to=reply_to,
        deadline=deadline,
        content_type=content_type,
        model=model,
        tenant=tenant,
        problem="; ".join(problems) if problems else None,
        priority=priority,
        reply_key=reply_key,
    )


def deadline_from_headers(headers: Mapping[str, str] | None) -> float | None:
    """The request's deadline as Unix seconds, or None. Raises :class:`ProtocolError` if malformed."""
    if not headers or Headers.DEADLINE not in headers:
        return None
    raw = headers[Headers.DEADLINE]
    if not isinstance(raw, str) or not _DEADLINE_RE.match(raw):
        raise ProtocolError(f"header {Headers.DEADLINE}: expected Unix milliseconds as 1 to {MAX_DEADLINE_DIGITS} digits, got {_shorten(raw)!r}")
    return int(raw) / 1000.0


def forwardable_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """A request's headers as a sidecar may copy them onto its own publish (a republish, a dead
    letter): every ``Nats-*`` header dropped, whatever its case. The server acts on those
    (``Nats-Expected-Stream``, ``Nats-Expected-Last-Sequence``, ``Nats-Rollup``, ``Nats-TTL``,
    ``Nats-Msg-Id``, …), so a producer's value would steer the sidecar's publish: refuse it, or
    worse. The sidecar sets the ones it needs itself."""
    return {k: v for k, v in (headers or {}).items() if not k[:5].lower() == "nats-"}


# The characters of a header name nats-py writes (an RFC 7230 token, after stripping); it refuses
# any other with BadHeaderError, and with it the whole publish.
HEADER_NAME_CHARS = r"!#$%&'*+\-.^_`|~0-9A-Za-z"
_WRITABLE_NAME = re.compile(f"[{HEADER_NAME_CHARS}]+")


def unwritable_header_names(headers: Mapping[str, str]) -> list[str]:
    """The names among ``headers`` that nats-py refuses to publish (not a token: ``a(b``, ``é``).
    A producer's raw headers may carry them (the server passes them on); a sidecar copying such
    headers onto its own publish must drop them first, or lose the publish."""
    return [k for k in headers if k.strip() and not _WRITABLE_NAME.fullmatch(k.strip())]


def _shorten(value: object, limit: int = 40) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def header_bytes(headers: Mapping[str, str] | None) -> int:
    """Bytes the headers take on the wire (``NATS/1.0`` block), which the server counts against
    ``max_payload`` together with the body."""
    if not headers:
        return 0
    total = len(b"NATS/1.0\r\n") + 2
    for key, value in headers.items():
        text = (value if isinstance(value, str) else str(value)).strip()
        total += (len(key) if key.isascii() else len(key.encode())) + 4 + (len(text) if text.isascii() else len(text.encode()))
    return total


def message_bytes(headers: Mapping[str, str] | None, data: bytes) -> int:
    """What the server counts against ``max_payload``: headers plus body."""
    return header_bytes(headers) + len(data)

