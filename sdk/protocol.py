"""The jetbatch wire contract, shared by the SDK and the sidecar.

Everything a client in another language needs lives here and in docs/protocol.md: subject names,
header names, error codes and payload encodings. This module must import without torch or the
sidecar; tensors are described by :class:`Tensor` (dtype, shape, raw little-endian bytes).
"""

from __future__ import annotations

import enum
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping

import msgspec

from .errors import JetbatchError

__all__ = [
    "DEFAULT_PREFIX",
    "BatchInfo",
    "ContentType",
    "ErrorBody",
    "ErrorCode",
    "Headers",
    "ProtocolError",
    "Status",
    "Subjects",
    "Tensor",
    "TENSOR_DTYPES",
    "batch_info_from_headers",
    "decode_payload",
    "deadline_from_headers",
    "deadline_header",
    "encode_error",
    "decode_error",
    "encode_payload",
    "validate_model_name",
    "validate_token",
    "DEFAULT_REPLY_PREFIXES",
    "DEFAULT_TENANT_REPLY_PREFIX",
    "JS_MSG_TOO_BIG",
    "JS_STREAM_FULL",
    "MAX_REPLY_SUBJECT_BYTES",
    "ReplyPolicy",
    "SidecarReport",
    "RequestMeta",
    "error_headers",
    "header_bytes",
    "message_bytes",
    "parse_request_headers",
]

DEFAULT_PREFIX = "jetbatch"


class Headers:
    """NATS header names. Routing metadata travels in headers so the `nats` CLI and tracing see it."""

    MSG_ID = "Nats-Msg-Id"  # request id; JetStream dedupes republished/retried messages on it
    REPLY_TO = "Jetbatch-Reply-To"  # caller's inbox; the JetStream publish reply field carries the PubAck
    DEADLINE = "Jetbatch-Deadline"  # absolute Unix time in integer milliseconds
    CONTENT_TYPE = "Content-Type"
    MODEL = "Jetbatch-Model"  # on requests to jetbatch.in: the producer's model choice; on replies: the model that served
    TRACEPARENT = "traceparent"
    TRACESTATE = "tracestate"
    # Reply headers.
    STATUS = "Jetbatch-Status"  # "ok" or "error"
    ERROR_CODE = "Jetbatch-Error-Code"
    REQUEST_ID = "Jetbatch-Request-Id"
    BATCH_ID = "Jetbatch-Batch-Id"
    BATCH_SIZE = "Jetbatch-Batch-Size"
    QUEUE_WAIT_MS = "Jetbatch-Queue-Wait-Ms"
    MODEL_LOADED = "Jetbatch-Model-Loaded"  # "true" when this batch paid a model load
    TRACE_ID = "Jetbatch-Trace-Id"  # the batch span's trace id (hex), when tracing is on
    WORKER = "Jetbatch-Worker"
    # Set by the classifier from the ingress subject a request arrived on (<prefix>.in.<tenant>),
    # which the server's permissions tie to the producer's identity; a producer's own value is dropped.
    TENANT = "Jetbatch-Tenant"
    # Dead-letter headers.
    DLQ_REASON = "Jetbatch-Dlq-Reason"
    DLQ_STAGE = "Jetbatch-Dlq-Stage"
    DLQ_SUBJECT = "Jetbatch-Dlq-Subject"
    DLQ_DELIVERIES = "Jetbatch-Dlq-Deliveries"


class Status(str, enum.Enum):
    OK = "ok"
    ERROR = "error"


class ErrorCode(str, enum.Enum):
    """Typed error codes carried by error replies (`Jetbatch-Status: error`)."""

    BAD_REQUEST = "bad_request"
    UNKNOWN_MODEL = "unknown_model"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    MODEL_FAILED = "model_failed"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


class ContentType(str, enum.Enum):
    """Payload encodings understood by the sidecar (the `Content-Type` header)."""

    TENSOR = "application/vnd.jetbatch.tensor+msgpack"
    MSGPACK = "application/msgpack"
    JSON = "application/json"
    BYTES = "application/octet-stream"


class ProtocolError(JetbatchError, ValueError):
    """A message does not follow the wire contract. Maps to a `bad_request` reply."""

    code = "bad_request"


_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_token(value: str, what: str) -> str:
    """Return ``value`` if it is one safe subject token (1-64 of ``[A-Za-z0-9_-]``), else raise
    :class:`ProtocolError` naming ``what``."""
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        shown = value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value
        raise ProtocolError(f"invalid {what} {shown!r}: use 1-64 characters from A-Z a-z 0-9 _ -")
    return value


def validate_model_name(name: str) -> str:
    """Return ``name`` if it is a valid single NATS subject token, else raise :class:`ProtocolError`.

    Model names become the last token of ``<prefix>.model.<name>``: no dots, spaces, wildcards
    (``*``, ``>``) or other characters outside ``[A-Za-z0-9_-]``; 1 to 64 characters.
    """
    if not isinstance(name, str) or not _TOKEN_RE.match(name):
        raise ProtocolError(
            f"invalid model name {name!r}: use 1-64 characters from A-Z a-z 0-9 _ - "
            "(no dots, spaces or wildcards)"
        )
    return name


_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


@dataclass(frozen=True)
class Subjects:
    """All subject and stream names under one prefix (default ``jetbatch``)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ProtocolError(f"invalid subject prefix {self.prefix!r}: dot-separated tokens of A-Z a-z 0-9 _ -")

    @property
    def ingress(self) -> str:
        """Requests whose model is decided by the classifier."""
        return f"{self.prefix}.in"

    def tenant_ingress(self, tenant: str) -> str:
        """A tenant's own ingress subject: the server's permissions tie it to the producer, so the
        sidecars learn the tenant from where a request arrived, not from what it claims."""
        return f"{self.prefix}.in.{validate_token(tenant, 'tenant')}"

    @property
    def tenant_ingress_wildcard(self) -> str:
        return f"{self.prefix}.in.*"

    def tenant_from_subject(self, subject: str) -> str | None:
        """The tenant of a request that arrived on ``<prefix>.in.<tenant>`` (None on ``<prefix>.in``)."""
        head = f"{self.prefix}.in."
        if subject.startswith(head):
            tenant = subject[len(head) :]
            return tenant if _TOKEN_RE.match(tenant) else None
        return None

    def result(self, request_id: str, tenant: str | None = None) -> str:
        """Where a request's final answer is stored (the results stream), so a caller that missed
        the reply (a reconnect, a retry with the same request id) can fetch it by id."""
        rid = validate_token(request_id, "request id")
        if tenant:
            return f"{self.prefix}.result.{validate_token(tenant, 'tenant')}.{rid}"
        return f"{self.prefix}.result.{rid}"

    @property
    def results_wildcard(self) -> str:
        return f"{self.prefix}.result.>"

    def model(self, name: str) -> str:
        """The per-model queue subject."""
        return f"{self.prefix}.model.{validate_model_name(name)}"

    @property
    def models_wildcard(self) -> str:
        return f"{self.prefix}.model.>"

    def model_from_subject(self, subject: str) -> str | None:
        head = f"{self.prefix}.model."
        if subject.startswith(head):
            return subject[len(head) :]
        return None

    def dead_letter(self, stage: str) -> str:
        return f"{self.prefix}.dlq.{stage}"

    @property
    def dead_letter_wildcard(self) -> str:
        return f"{self.prefix}.dlq.>"

    @property
    def _stream_base(self) -> str:
        return re.sub(r"[^A-Za-z0-9_-]", "_", self.prefix).upper()

    @property
    def ingress_stream(self) -> str:
        return f"{self._stream_base}_IN"

    @property
    def models_stream(self) -> str:
        return f"{self._stream_base}_MODELS"

    @property
    def dead_letter_stream(self) -> str:
        return f"{self._stream_base}_DLQ"

    @property
    def results_stream(self) -> str:
        return f"{self._stream_base}_RESULTS"

    @property
    def attempts_bucket(self) -> str:
        """Key-value bucket where workers record which redelivered request they ran alone (the
        evidence behind poison verdicts)."""
        return f"{self._stream_base}_ATTEMPTS"

    @property
    def kv_bucket(self) -> str:
        """Key-value bucket where workers advertise what they hold."""
        return f"{self._stream_base}_WORKERS"

    @property
    def status_subject(self) -> str:
        """Every sidecar answers status requests here (see `jetbatch status`)."""
        return f"{self.prefix}.status"


# --- Typed bodies -------------------------------------------------------------------------------

TENSOR_DTYPES: frozenset[str] = frozenset(
    {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
_DTYPE_SIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


class Tensor(msgspec.Struct, frozen=True):
    """A dense tensor on the wire: dtype name, shape and raw little-endian C-order bytes.

    Decoding gives ``data`` as a read-only ``memoryview`` into the received message (no copy);
    :meth:`to_torch` wraps it with ``torch.frombuffer`` (no copy either).
    """

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def validate(self) -> "Tensor":
        """Check dtype and that shape and byte length agree; raise :class:`ProtocolError` if not."""
        if self.dtype not in TENSOR_DTYPES:
            raise ProtocolError(f"$.dtype: unsupported tensor dtype {self.dtype!r}; expected one of {sorted(TENSOR_DTYPES)}")
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise ProtocolError(f"$.shape: negative dimension in {list(self.shape)}")
            count *= dim
        expected = count * _DTYPE_SIZE[self.dtype]
        if len(self.data) != expected:
            raise ProtocolError(
                f"$.data: {len(self.data)} bytes do not match shape {list(self.shape)} of {self.dtype} ({expected} bytes)"
            )
        return self

    @classmethod
    def from_torch(cls, tensor: Any) -> "Tensor":
        """Encode a torch tensor (moved to CPU, made contiguous). Needs torch only if you pass one."""
        import ctypes

        t = tensor.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in TENSOR_DTYPES:
            raise ProtocolError(f"unsupported tensor dtype {dtype!r}")
        nbytes = t.numel() * t.element_size()
        raw = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
        return cls(dtype=dtype, shape=tuple(t.shape), data=memoryview(_to_little_endian(raw, t.element_size())))

    @classmethod
    def from_numpy(cls, array: Any) -> "Tensor":
        """Encode a numpy array (converted to little-endian, C order)."""
        dtype = str(array.dtype)
        if dtype not in TENSOR_DTYPES:
            raise ProtocolError(f"unsupported array dtype {dtype!r}")
        arr = array.astype(array.dtype.newbyteorder("<"), copy=False)
        import numpy

        arr = numpy.ascontiguousarray(arr)
        return cls(dtype=dtype, shape=tuple(arr.shape), data=memoryview(arr).cast("B"))

    def to_torch(self) -> Any:
        """A torch tensor viewing ``data`` without copying (read-only memory: do not write in place)."""
        import importlib

        torch = importlib.import_module("torch")
        self.validate()
        dtype = getattr(torch, self.dtype)
        if len(self.data) == 0:
            return torch.empty(self.shape, dtype=dtype)
        global _frombuffer_warned
        if _frombuffer_warned:
            flat = torch.frombuffer(self.data, dtype=dtype)
        else:
            import warnings

            with warnings.catch_warnings():
                # Read-only by design: the tensor views the received message without copying.
                # torch warns once per process; silence that one and skip the (costly) guard after.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(self.data, dtype=dtype)
            _frombuffer_warned = True
        if sys.byteorder != "little":  # pragma: no cover - wire order is little-endian
            flat = flat.byteswap()
        return flat.reshape(self.shape)


_frombuffer_warned = False


def _to_little_endian(raw: bytes, itemsize: int) -> bytes:
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    import array  # pragma: no cover

    arr = array.array({2: "H", 4: "I", 8: "Q"}[itemsize], raw)  # pragma: no cover
    arr.byteswap()  # pragma: no cover
    return arr.tobytes()  # pragma: no cover


class ErrorBody(msgspec.Struct, frozen=True):
    """Body of an error reply, JSON-encoded so any client and the `nats` CLI can read it."""

    code: str
    message: str
    request_id: str = ""


@dataclass(frozen=True)
class BatchInfo:
    """How a request was batched, read from the reply's headers."""

    batch_id: str
    batch_size: int
    queue_wait_ms: float
    model_loaded: bool
    model: str
    worker: str = ""
    trace_id: str = ""


class SidecarReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a sidecar reports about itself, in one shape for every reader: the answer to a status
    request (``jetbatch status``, readiness checks), and a worker's advert in the cluster's
    key-value bucket (what its peers schedule around). JSON on the wire."""

    role: str  # "worker" or "classifier"
    id: str
    version: str = ""
    models: list[str] = []  # served models
    resident: list[str] = []  # on the device now
    warm: list[str] = []  # evicted but in host memory: a cheap reload
    loading: str | None = None  # being loaded now (counts as served for peers)
    broken: dict[str, str] = {}  # models that cannot load, and why
    backlog: dict[str, int] = {}  # requests waiting per model, as this sidecar sees them
    in_flight: dict[str, int] = {}  # messages held unacked per model
    unfetchable: dict[str, int] = {}  # delivered-but-unacked messages found unfetchable
    drain_rps: dict[str, float] = {}  # requests/s it can drain per resident model
    load_cost_s: dict[str, float] = {}  # estimated cost to (re)load each model from its tier
    memory_bytes: int = 0  # device bytes of the resident models (measured)
    memory_budget_bytes: int | None = None
    host_memory_bytes: int = 0  # host bytes of the warm tier
    host_memory_budget_bytes: int | None = None
    stats: dict[str, int] = {}
    started_at: float = 0.0  # Unix seconds
    updated_at: float = 0.0  # Unix seconds, when this report was made
    valid_s: float = 0.0  # a report older than this is stale (0: no limit)


# --- Encoders built once and reused -------------------------------------------------------------

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
_tensor_decoder = msgspec.msgpack.Decoder(Tensor)
_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder()
_error_decoder = msgspec.json.Decoder(ErrorBody)


def encode_payload(obj: Any, content_type: ContentType | str | None = None) -> tuple[bytes, ContentType]:
    """Encode a request or result body and pick its content type.

    ``bytes`` are sent as they are (labelled ``content_type``, default octet-stream: a body the
    caller encoded itself), a :class:`Tensor` (or torch tensor, or numpy array) as the tensor
    encoding, anything else as msgpack unless ``content_type`` asks for JSON.
    """
    ctype = ContentType(content_type) if content_type is not None else None
    if isinstance(obj, (bytes, bytearray, memoryview)):
        # Bytes with an explicit content type are a body the caller already encoded.
        return bytes(obj), ctype or ContentType.BYTES
    tensor = _as_tensor(obj)
    if tensor is not None and ctype in (None, ContentType.TENSOR):
        return _msgpack_encoder.encode(tensor), ContentType.TENSOR
    if ctype is ContentType.JSON:
        try:
            return _json_encoder.encode(obj), ContentType.JSON
        except TypeError as exc:
            raise ProtocolError(f"cannot encode payload as JSON: {exc}") from exc
    try:
        return _msgpack_encoder.encode(obj), ContentType.MSGPACK
    except TypeError as exc:
        raise ProtocolError(f"cannot encode payload as msgpack: {exc}") from exc


def _as_tensor(obj: Any) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj
    module = type(obj).__module__
    if module.startswith("torch") and hasattr(obj, "data_ptr"):
        return Tensor.from_torch(obj)
    if module == "numpy" and type(obj).__name__ == "ndarray":
        return Tensor.from_numpy(obj)
    return None


def decode_payload(data: bytes, content_type: str | None) -> Any:
    """Decode a body by its content type; raise :class:`ProtocolError` naming what is wrong."""
    ctype = (content_type or ContentType.BYTES.value).split(";")[0].strip().lower()
    try:
        if ctype == ContentType.BYTES.value:
            return data
        if ctype == ContentType.TENSOR.value:
            return _tensor_decoder.decode(data).validate()
        if ctype == ContentType.MSGPACK.value:
            return _msgpack_decoder.decode(data)
        if ctype == ContentType.JSON.value:
            return _json_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable {ctype} payload: {exc}") from exc
    raise ProtocolError(f"unsupported content type {content_type!r}; expected one of {[c.value for c in ContentType]}")


def encode_error(code: ErrorCode, message: str, request_id: str = "") -> bytes:
    return _json_encoder.encode(ErrorBody(code=code.value, message=message, request_id=request_id))


def decode_error(data: bytes) -> ErrorBody:
    try:
        return _error_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ErrorBody(code=ErrorCode.INTERNAL.value, message=data[:200].decode("utf-8", "replace"))


def deadline_header(timeout_s: float, now: float | None = None) -> str:
    """Header value for a deadline ``timeout_s`` seconds from now."""
    return str(int(((time.time() if now is None else now) + timeout_s) * 1000))


def batch_info_from_headers(headers: Mapping[str, str] | None) -> BatchInfo:
    """Read the batch metadata a worker puts on every reply."""
    h = headers or {}

    def num(key: str, cast: Any, default: Any) -> Any:
        try:
            return cast(h[key])
        except (KeyError, TypeError, ValueError):
            return default

    return BatchInfo(
        batch_id=h.get(Headers.BATCH_ID, ""),
        batch_size=num(Headers.BATCH_SIZE, int, 0),
        queue_wait_ms=num(Headers.QUEUE_WAIT_MS, float, 0.0),
        model_loaded=h.get(Headers.MODEL_LOADED, "false").lower() == "true",
        model=h.get(Headers.MODEL, ""),
        worker=h.get(Headers.WORKER, ""),
        trace_id=h.get(Headers.TRACE_ID, ""),
    )


# --- Hostile input: request headers parsed with limits --------------------------------------------
#
# Every header of a request is attacker-controlled. The sidecars parse them here, once, with
# length and range limits, and never let a request choose where they publish except through a
# reply policy (an allowlist of reply prefixes).

MAX_REPLY_SUBJECT_BYTES = 255  # far under the server's 4 KiB control line (subject + reply + sizes)
MAX_CONTENT_TYPE_BYTES = 128
MAX_TRACEPARENT_BYTES = 256
MAX_TRACESTATE_BYTES = 512  # the W3C limit a propagator must keep
MAX_DEADLINE_DIGITS = 15  # Unix milliseconds up to the year 33658
DEFAULT_REPLY_PREFIXES: tuple[str, ...] = ("_INBOX",)
DEFAULT_TENANT_REPLY_PREFIX = "_INBOX.{tenant}"

_SUBJECT_CHARS_RE = re.compile(r"^[!-~]+$")  # printable ASCII, no spaces or control characters
_DEADLINE_RE = re.compile(r"^[0-9]{1,%d}$" % MAX_DEADLINE_DIGITS)
_TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[!-~]*)?$")


def _subject_tokens_ok(subject: str) -> bool:
    if len(subject.encode("utf-8", "replace")) > MAX_REPLY_SUBJECT_BYTES or not _SUBJECT_CHARS_RE.match(subject):
        return False
    tokens = subject.split(".")
    return all(tok and "*" not in tok and ">" not in tok for tok in tokens)


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
        if subject.startswith("$") or any(subject == f or subject.startswith(f + ".") for f in self.forbidden_prefixes):
            raise ProtocolError(f"header {Headers.REPLY_TO}: replies to {subject.split('.')[0]}.* are not allowed")
        if tenant is not None:
            allowed: tuple[str, ...] = (self.tenant_prefix.format(tenant=tenant),)
        else:
            allowed = self.allowed_prefixes
        if not any(subject.startswith(p + ".") and len(subject) > len(p) + 1 for p in allowed):
            raise ProtocolError(f"header {Headers.REPLY_TO}: reply subjects must lie under {' or '.join(p + '.' for p in allowed)}")
        return subject


@dataclass(frozen=True)
class RequestMeta:
    """What a sidecar takes from a request's headers, each value checked.

    ``problem`` is set when a header is invalid: the request gets ``bad_request`` (sent to
    ``reply_to`` only when the reply subject itself passed the policy) and is not run.
    """

    request_id: str
    reply_to: str | None
    deadline: float | None  # Unix seconds
    content_type: str | None
    model: str | None
    tenant: str | None
    problem: str | None = None


def parse_request_headers(
    headers: Mapping[str, str] | None, *, policy: ReplyPolicy, tenant: str | None = None, fallback_id: str = ""
) -> RequestMeta:
    """Parse a request's headers with limits; never raises. ``tenant`` is what the sidecar knows
    from the subject (classifier) or the classifier's header (worker), never the producer's word."""
    h = headers or {}
    problems: list[str] = []
    rid = h.get(Headers.MSG_ID) or fallback_id
    try:
        validate_token(rid, f"request id ({Headers.MSG_ID})")
    except ProtocolError as exc:
        problems.append(str(exc))
        rid = fallback_id
    reply_to: str | None = None
    raw_reply = h.get(Headers.REPLY_TO)
    if raw_reply is not None:
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
    )


def deadline_from_headers(headers: Mapping[str, str] | None) -> float | None:
    """The request's deadline as Unix seconds, or None. Raises :class:`ProtocolError` if malformed."""
    if not headers or Headers.DEADLINE not in headers:
        return None
    raw = headers[Headers.DEADLINE]
    if not isinstance(raw, str) or not _DEADLINE_RE.match(raw):
        raise ProtocolError(f"header {Headers.DEADLINE}: expected Unix milliseconds as 1 to {MAX_DEADLINE_DIGITS} digits, got {_shorten(raw)!r}")
    return int(raw) / 1000.0


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
        total += len(key.encode()) + 2 + len(str(value).strip().encode()) + 2
    return total


def message_bytes(headers: Mapping[str, str] | None, data: bytes) -> int:
    """What the server counts against ``max_payload``: headers plus body."""
    return header_bytes(headers) + len(data)


def error_headers(code: ErrorCode, request_id: str, model: str | None = None) -> dict[str, str]:
    """The headers of an error reply (the body is :func:`encode_error`)."""
    headers = {
        Headers.STATUS: Status.ERROR.value,
        Headers.ERROR_CODE: code.value,
        Headers.REQUEST_ID: request_id,
        Headers.CONTENT_TYPE: ContentType.JSON.value,
    }
    if model:
        headers[Headers.MODEL] = model
    return headers


# JetStream API error codes that clients and sidecars must turn into typed errors.
JS_STREAM_FULL: frozenset[int] = frozenset({10077, 10078, 10047, 10048})  # max msgs / bytes / resources
JS_MSG_TOO_BIG: frozenset[int] = frozenset({10054})
