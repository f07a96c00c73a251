"""Names of the wire contract: subjects, streams, header names, status and error codes, content
types, and the token rules subjects are built from."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from ..errors import JetbatchError

DEFAULT_PREFIX = "jetbatch"
# A sidecar's id as the config allows it (config.SidecarId): a subject's tail, never a wildcard.
_SIDECAR_ID = re.compile(r"[A-Za-z0-9_=/-]{1,128}(\.[A-Za-z0-9_=/-]{1,128}){0,31}")


class Headers:
    """NATS header names. Routing metadata travels in headers so the `nats` CLI and tracing see it."""

    MSG_ID = "Nats-Msg-Id"  # request id; JetStream dedupes republished/retried messages on it
    REPLY_TO = "Jetbatch-Reply-To"  # protocol 2: caller's inbox; the JetStream publish reply field carries the PubAck
    # Protocol 3: the caller's key among its tenant's answers. The answer is published once, to
    # <prefix>.result.<tenant or _>.<key>.<request id>: stored there, and delivered live to the
    # caller subscribed to <prefix>.result.<tenant or _>.<key>.*.
    REPLY_KEY = "Jetbatch-Reply-Key"
    DEADLINE = "Jetbatch-Deadline"  # absolute Unix time in integer milliseconds
    PRIORITY = "Jetbatch-Priority"  # a Priority class; absent: interactive
    CONTENT_TYPE = "Content-Type"
    MODEL = "Jetbatch-Model"  # on requests to jetbatch.in: the producer's model choice; on replies: the model that served
    TRACEPARENT = "traceparent"
    TRACESTATE = "tracestate"
    # A worker's ring dump (`jetbatch ring`), one message a part: ``<index>/<parts>`` from 0, the
    # dump's size in bytes and SHA-256 (hex) on every part; or an error with an empty body.
    RING_PART = "Jetbatch-Ring-Part"
    RING_BYTES = "Jetbatch-Ring-Bytes"
    RING_SHA256 = "Jetbatch-Ring-Sha256"
    RING_ERROR = "Jetbatch-Ring-Error"
    # Reply headers.
    STATUS = "Jetbatch-Status"  # "ok" or "error"
    ERROR_CODE = "Jetbatch-Error-Code"
    REQUEST_ID = "Jetbatch-Request-Id"
    # The batch metadata of a reply, one header since protocol 2 (see docs/protocol.md):
    # ``id=<16 hex>;size=<n>;wait_ms=<ms>;loaded=<0|1>;worker=<id>[;trace=<32 hex>]``.
    BATCH = "Jetbatch-Batch"
    # Protocol 1 carried the same metadata as six headers; the SDK still reads them (one release).
    BATCH_ID = "Jetbatch-Batch-Id"
    BATCH_SIZE = "Jetbatch-Batch-Size"
    QUEUE_WAIT_MS = "Jetbatch-Queue-Wait-Ms"
    MODEL_LOADED = "Jetbatch-Model-Loaded"  # "true" when this batch paid a model load
    TRACE_ID = "Jetbatch-Trace-Id"  # the batch span's trace id (hex), when tracing is on
    WORKER = "Jetbatch-Worker"
    # Set by the classifier from the ingress subject a request arrived on (<prefix>.in.<tenant>),
    # which the server's permissions tie to the producer's identity; a producer's own value is dropped.
    TENANT = "Jetbatch-Tenant"
    # Set by the classifier on a request it moved to the batch line beyond its tenant's fair share
    # (docs/tenancy.md): "1". The worker counts the device time such excess takes apart.
    EXCESS = "Jetbatch-Excess"
    # Dead-letter headers.
    DLQ_REASON = "Jetbatch-Dlq-Reason"
    DLQ_STAGE = "Jetbatch-Dlq-Stage"
    DLQ_SUBJECT = "Jetbatch-Dlq-Subject"
    DLQ_DELIVERIES = "Jetbatch-Dlq-Deliveries"


class Status(str, enum.Enum):
    OK = "ok"
    ERROR = "error"


class Priority(str, enum.Enum):
    """A request's priority class (the ``Jetbatch-Priority`` header; absent means interactive).

    Interactive requests weigh more when the worker chooses which model comes next, so a queue
    with interactive work waiting is visited sooner; batch requests still get the same bounded
    wait (see docs/scheduler.md). Two classes on purpose: each class a scheduler weighs is one
    more way for its rules to fight, and two are what callers ask for (a person waiting, a job
    that is not)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class ErrorCode(str, enum.Enum):
    """Typed error codes carried by error replies (`Jetbatch-Status: error`)."""

    BAD_REQUEST = "bad_request"
    UNKNOWN_MODEL = "unknown_model"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    MODEL_FAILED = "model_failed"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


class ContentType(str, enum.Enum):
    """Payload encodings understood by the sidecar (the `Content-Type` header)."""

    TENSOR = "application/vnd.jetbatch.tensor+msgpack"
    # Several tensors: a msgpack map of name -> tensor (a mapping), or an array (a tuple).
    TENSORS = "application/vnd.jetbatch.tensors+msgpack"
    MSGPACK = "application/msgpack"
    JSON = "application/json"
    BYTES = "application/octet-stream"


class ProtocolError(JetbatchError, ValueError):
    """A message does not follow the wire contract. Maps to a `bad_request` reply."""

    code = "bad_request"


_TOKEN_RE = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")  # \Z: "$" would let a trailing newline in
# The tenant token of the answers of requests with no tenant (protocol 3): never a tenant's name,
# so a permission on <prefix>.result.<tenant>.> never covers them.
NO_TENANT = "_"
# The last token of a batch-class queue subject (model names have no dots: unambiguous).
BATCH_TOKEN = "batch"
_BATCH_SUFFIX = "." + BATCH_TOKEN


def validate_token(value: str, what: str) -> str:
    """Return ``value`` if it is one safe subject token (1-64 of ``[A-Za-z0-9_-]``), else raise
    :class:`ProtocolError` naming ``what``."""
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        shown = value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value
        raise ProtocolError(f"invalid {what} {shown!r}: use 1-64 characters from A-Z a-z 0-9 _ -")
    return value


def validate_tenant(name: str) -> str:
    """Return ``name`` if it can name a tenant: one subject token, not ``_`` (which stands for
    "no tenant" in answer subjects); else raise :class:`ProtocolError`."""
    validate_token(name, "tenant")
    if name == NO_TENANT:
        raise ProtocolError(f"invalid tenant {name!r}: {NO_TENANT!r} is reserved (it stands for no tenant)")
    return name


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
        return f"{self.prefix}.in.{validate_tenant(tenant)}"

    @property
    def tenant_ingress_wildcard(self) -> str:
        return f"{self.prefix}.in.*"

    def tenant_from_subject(self, subject: str) -> str | None:
        """The tenant of a request that arrived on ``<prefix>.in.<tenant>`` (None on ``<prefix>.in``)."""
        head = f"{self.prefix}.in."
        if subject.startswith(head):
            tenant = subject[len(head) :]
            return tenant if _TOKEN_RE.match(tenant) and tenant != NO_TENANT else None
        return None

    def answer(self, request_id: str, key: str, tenant: str | None = None) -> str:
        """Protocol 3: where a request's final answer is published, once. The results stream
        stores it, and the caller, subscribed to :meth:`answers` of its ``key``, receives it live:
        one publish, one PubAck, one delivery. The tenant comes first, so one server permission
        (``<prefix>.result.<tenant>.>``) gives a tenant its own answers and nobody else's."""
        scope = validate_tenant(tenant) if tenant else NO_TENANT
        return f"{self.prefix}.result.{scope}.{validate_token(key, 'reply key')}.{validate_token(request_id, 'request id')}"

    def answers(self, key: str, tenant: str | None = None) -> str:
        """What a caller with reply key ``key`` subscribes to: its own answers, live."""
        scope = validate_tenant(tenant) if tenant else NO_TENANT
        return f"{self.prefix}.result.{scope}.{validate_token(key, 'reply key')}.*"

    def answer_anywhere(self, request_id: str, tenant: str | None = None) -> str:
        """A request's answer under any caller's key: the filter of a direct get (last message by
        subject) that finds an answer a retry from another process (another key) was given."""
        scope = validate_tenant(tenant) if tenant else NO_TENANT
        return f"{self.prefix}.result.{scope}.*.{validate_token(request_id, 'request id')}"

    def result(self, request_id: str, tenant: str | None = None) -> str:
        """Protocol 2: where a request's final answer is stored when the caller gave a reply
        subject (``Jetbatch-Reply-To``) and no key; the live reply goes to that subject."""
        rid = validate_token(request_id, "request id")
        if tenant:
            return f"{self.prefix}.result.{validate_tenant(tenant)}.{rid}"
        return f"{self.prefix}.result.{rid}"

    @property
    def results_wildcard(self) -> str:
        return f"{self.prefix}.result.>"

    def model(self, name: str, priority: "Priority | str" = "interactive") -> str:
        """A model's queue subject: ``<prefix>.model.<name>`` for interactive requests,
        ``<prefix>.model.<name>.batch`` for the batch class. Two subjects, so that JetStream keeps
        the classes apart and a worker takes interactive requests first (docs/protocol.md)."""
        base = f"{self.prefix}.model.{validate_model_name(name)}"
        return base if Priority(priority) is Priority.INTERACTIVE else f"{base}.{BATCH_TOKEN}"

    @property
    def models_wildcard(self) -> str:
        return f"{self.prefix}.model.>"

    @property
    def queue_wildcards(self) -> list[str]:
        """The models stream's subjects: every model's two queues, whatever their number."""
        return [f"{self.prefix}.model.*", f"{self.prefix}.model.*.{BATCH_TOKEN}"]

    def model_from_subject(self, subject: str) -> str | None:
        return self._model_after("model", subject)

    def queue_from_subject(self, subject: str) -> tuple[str, Priority] | None:
        """The model and class of a queue subject (None for any other subject)."""
        return self._queue_after("model", subject)

    def arrived(self, name: str, priority: "Priority | str" = "interactive") -> str:
        """Where the models stream republishes the headers of each request it stored for ``name``
        (no payload): the workers' event feed of arrivals (``.batch`` for the batch class)."""
        base = f"{self.prefix}.arrived.{validate_model_name(name)}"
        return base if Priority(priority) is Priority.INTERACTIVE else f"{base}.{BATCH_TOKEN}"

    @property
    def arrivals_wildcard(self) -> str:
        return f"{self.prefix}.arrived.>"

    def model_from_arrival(self, subject: str) -> str | None:
        return self._model_after("arrived", subject)

    def queue_from_arrival(self, subject: str) -> tuple[str, Priority] | None:
        return self._queue_after("arrived", subject)

    def taken(self, name: str) -> str:
        """Where workers tell each other they fetched (``+n``) or settled (``-n``) requests of
        ``name``: the other half of the event feed, so a peer's backlog drops when one worker
        takes the requests, not at the next count."""
        return f"{self.prefix}.taken.{validate_model_name(name)}"

    @property
    def taken_wildcard(self) -> str:
        return f"{self.prefix}.taken.>"

    def model_from_taken(self, subject: str) -> str | None:
        return self._model_after("taken", subject)

    def _model_after(self, kind: str, subject: str) -> str | None:
        """The model token of ``<prefix>.<kind>.<model>`` (None for any other subject); for the
        queue and arrival subjects, ``.batch`` after it is the class, not part of the name."""
        head = f"{self.prefix}.{kind}."
        if not subject.startswith(head):
            return None
        name = subject[len(head) :]
        if kind in ("model", "arrived") and name.endswith(_BATCH_SUFFIX):
            return name[: -len(_BATCH_SUFFIX)]
        return name

    def _queue_after(self, kind: str, subject: str) -> tuple[str, Priority] | None:
        name = self._model_after(kind, subject)
        if name is None:
            return None
        return name, Priority.BATCH if subject.endswith(_BATCH_SUFFIX) else Priority.INTERACTIVE

    def cancel(self, tenant: str | None = None) -> str:
        """Where a caller that gave up says so (core NATS, the request id as the body):
        ``<prefix>.cancel``, or ``<prefix>.cancel.<tenant>``, which the server's permissions tie
        to the tenant's identity; a worker cancels only requests of the tenant of the subject."""
        if tenant:
            return f"{self.prefix}.cancel.{validate_tenant(tenant)}"
        return f"{self.prefix}.cancel"

    @property
    def cancel_wildcard(self) -> str:
        """Every tenant's cancel subject (``<prefix>.cancel`` itself needs its own subscription)."""
        return f"{self.prefix}.cancel.*"

    def tenant_from_cancel(self, subject: str) -> tuple[bool, str | None]:
        """(is a cancel subject, its tenant or None for ``<prefix>.cancel``)."""
        if subject == f"{self.prefix}.cancel":
            return True, None
        head = f"{self.prefix}.cancel."
        if subject.startswith(head) and _TOKEN_RE.match(subject[len(head) :]):
            return True, subject[len(head) :]
        return False, None

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
    def registry_bucket(self) -> str:
        """Key-value bucket of the models the workers register, a key each (docs/protocol.md#unknown-models)."""
        return f"{self._stream_base}_REGISTERED"

    @property
    def registry_stream(self) -> str:
        """The stream behind :attr:`registry_bucket` (what a direct get names)."""
        return f"KV_{self.registry_bucket}"

    def registry_key(self, model: str) -> str:
        """The subject of ``model``'s entry in :attr:`registry_bucket`."""
        return f"$KV.{self.registry_bucket}.{validate_model_name(model)}"

    @property
    def kv_bucket(self) -> str:
        """Key-value bucket where workers advertise what they hold."""
        return f"{self._stream_base}_WORKERS"

    @property
    def adverts(self) -> str:
        """Where the workers' adverts are published (each put into :attr:`kv_bucket`), as a
        core-NATS subscription reads them: ``$KV.<bucket>.>``."""
        return f"$KV.{self.kv_bucket}.>"

    @property
    def status_subject(self) -> str:
        """Every sidecar answers status requests here (see `jetbatch status`)."""
        return f"{self.prefix}.status"

    def ring(self, worker_id: str) -> str:
        """Where worker ``worker_id`` (a sidecar id: dot-separated tokens) answers requests for
        its ring of recent core events (``jetbatch ring``)."""
        if not _SIDECAR_ID.fullmatch(worker_id):
            raise ProtocolError(f"{worker_id!r} is not a worker id (dot-separated tokens of letters, digits, -, _, =, /)")
        return f"{self.prefix}.ring.{worker_id}"

    @property
    def rings(self) -> str:
        """Every worker's ring subject (what the worker role may subscribe to)."""
        return f"{self.prefix}.ring.>"



def subject_matches(pattern: str, subject: str) -> bool:
    """Whether the NATS subject filter ``pattern`` captures the literal ``subject``.

    Both are ``.``-separated tokens. In ``pattern``, a token ``*`` matches exactly one token and a
    last token ``>`` matches one or more trailing tokens; any other token (``a*`` included) matches
    only itself. A ``>`` that is not the last token makes the pattern invalid: it matches nothing.

    >>> subject_matches("jb.model.*", "jb.model.m1"), subject_matches("jb.>", "jb")
    (True, False)
    """
    want = pattern.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return i == len(want) - 1 and len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


# JetStream API error codes that clients and sidecars must turn into typed errors.
JS_STREAM_FULL: frozenset[int] = frozenset({10077, 10078, 10047, 10048})  # max msgs / bytes / resources
JS_MSG_TOO_BIG: frozenset[int] = frozenset({10054})
