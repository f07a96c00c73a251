"""Sidecar configuration: msgspec Structs decoded from TOML, overridable by environment variables.

All defaults live in the Structs below. One file format serves every role: a worker reads
``[models.*]``, a classifier reads ``[classifier]``, ``jetbatch up`` reads both.

Environment overrides: ``JETBATCH_<SECTION>__<KEY>=value`` (double underscore between levels, the
way the ``dynamic-batcher`` package reads ``DYNAMIC_BATCHER__BATCH_SIZE``), e.g.
``JETBATCH_WORKER__POLICY=fifo`` or ``JETBATCH_MODELS__m1__MAX_BATCH_SIZE=32`` (section and key
names are case-insensitive; model names keep their case). ``NATS_URL`` sets ``nats.url``.
"""

from __future__ import annotations

import os
import select
import stat
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import msgspec
from msgspec import Meta

import re

from .errors import SidecarError
from jetbatch.sdk.protocol import DEFAULT_PREFIX, ProtocolError, ReplyPolicy, Subjects, validate_model_name, validate_tenant

__all__ = [
    "ClassifierConfig",
    "Config",
    "ConfigError",
    "ModelConfig",
    "NatsConfig",
    "NatsIdentity",
    "RepliesConfig",
    "StreamsConfig",
    "HttpConfig",
    "TelemetryConfig",
    "TenantsConfig",
    "WorkerConfig",
    "describe_validation_error",
    "load_config",
    "parse_config",
]

# Every integer in the file goes to nats-server or torch as a 64-bit integer at most (TOML takes
# 10**30, and a batch size nats-server could not read left a worker serving nothing).
INT64_MAX = 2**63 - 1
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
NonNegInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
# A batch: far above any device's, and what one fetch may ask nats-server for.
BatchSize = Annotated[int, Meta(ge=1, le=1_000_000)]
# Every float in the file is seconds (or their milliseconds) or a cost: finite (TOML's inf
# passed, and a batch window of inf never closed).
NonNegFloat = Annotated[float, Meta(ge=0, le=1e9)]
PositiveFloat = Annotated[float, Meta(gt=0, le=1e9)]
# A sidecar's id is the key of its advert in the workers' key-value bucket: what a key may be
# (dot-separated tokens of letters, digits, `-`, `_`, `=`, `/`), so an id such as `evil.>` is
# refused here, not left serving with every advert failing and no peer seeing it.
SidecarId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_=/-]+(\.[A-Za-z0-9_=/-]+)*$", max_length=128)]
# A period something is done again after (an advert, an idle model's unload): at least 10 ms, so
# a typo (1e-20) cannot make it a busy loop.
Interval = Annotated[float, Meta(ge=0.01, le=1e9)]
MiB = 1024 * 1024
_OWN_KEY_RE = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.DOTALL)
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


class ConfigError(SidecarError):
    """A configuration file or environment variable is invalid. ``str()`` is one line for the CLI."""


class _Base(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


DEFAULT_MAX_DELAY_S = 0.005
MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a config file is kilobytes; past this it is not one


def _seconds_from_ms(section: Any, key: str) -> None:
    """``<key>_ms`` (the 0.2 spelling) sets ``<key>_s``; both set must agree."""
    ms = getattr(section, f"{key}_ms")
    if ms is None:
        return
    seconds = getattr(section, f"{key}_s")
    default = DEFAULT_MAX_DELAY_S if key == "max_delay" else None
    if seconds is not None and seconds != default and abs(seconds - ms / 1000.0) > 1e-9:
        raise ValueError(f"{key}_s: {seconds} s and {key}_ms: {ms} ms disagree; keep {key}_s (the _ms spelling is retired)")
    msgspec.structs.force_setattr(section, f"{key}_s", ms / 1000.0)


class NatsIdentity(_Base):
    """Credentials of a second connection (see ``nats.reply_identity``)."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkeys_seed_file: str | None = None
    creds_file: str | None = None
    inbox_prefix: str = "_INBOX"  # where this connection's own PubAcks come back


class NatsConfig(_Base):
    """How to reach NATS. ``url`` None means: ``$NATS_URL``, else an embedded server (up/demo)."""

    url: str | None = None
    prefix: str = DEFAULT_PREFIX
    # Bounds a sidecar's whole first connect (every attempt, TLS included). Longer than the SDK's
    # 2 s: a sidecar often starts beside a server still starting (compose, a pod); a server that
    # refuses at once still fails in about a second.
    connect_timeout_s: PositiveFloat = 10.0
    inbox_prefix: str = "_INBOX"  # give each sidecar its own (e.g. _INBOX.worker) for least privilege
    # Credentials: never logged or put in spans.
    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkeys_seed_file: str | None = None
    creds_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # Defence in depth: answers to callers go out on a second connection with these credentials,
    # whose server permissions allow only reply subjects (docs/security.md). Unset: one connection.
    reply_identity: NatsIdentity | None = None

    def __post_init__(self) -> None:
        try:
            Subjects(self.prefix)
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None


class RepliesConfig(_Base):
    """Where a sidecar may send answers, and the durable copy of every answer (docs/security.md,
    docs/reliability.md)."""

    # A request's reply subject must lie under one of these (then at least one more token);
    # `$...` and the deployment's own `<prefix>.` are refused whatever this says.
    allowed_prefixes: list[str] = msgspec.field(default_factory=lambda: ["_INBOX"])
    # For a request that arrived on <prefix>.in.<tenant>: its reply must lie under this.
    tenant_prefix: str = "_INBOX.{tenant}"
    # Store every answer in the results stream before acking the request, so a caller that
    # reconnects late or retries under the same request id still gets it.
    durable: bool = True
    # How long a worker keeps trying to store an answer that was already sent live (the results
    # stream down or electing) before it leaves the request for redelivery, which may compute it
    # again (in-flight requests get in_progress meanwhile, so it may exceed streams.ack_wait_s).
    store_timeout_s: PositiveFloat = 20.0
    max_age_s: PositiveFloat = 300.0
    max_bytes: PositiveInt = 256 * MiB
    # Store a batch's answers as one JetStream atomic batch (nats-server 2.12+): one PubAck for
    # the batch instead of one per answer. It moves work from the worker (about 10 us a request
    # less) to nats-server (about 30 us more, it stages the batch) and the callers (three more
    # headers on every answer): off by default, since the sum is more (docs/benchmarks.md). For
    # a worker whose own CPU is the bound, with server cores to spare. Where the server refuses
    # atomic batches the answers are stored one by one anyway.
    atomic_batches: bool = False

    def __post_init__(self) -> None:
        for prefix in [*self.allowed_prefixes, self.tenant_prefix.replace("{tenant}", "t")]:
            if prefix.startswith("$") or not _PREFIX_RE.match(prefix):
                raise ValueError(f"{prefix!r} is not an allowed reply prefix (dot-separated tokens, not under $)")
        if "{tenant}" not in self.tenant_prefix:
            raise ValueError("tenant_prefix must contain {tenant}")


class StreamsConfig(_Base):
    """JetStream stream and consumer limits (see docs/protocol.md)."""

    replicas: Annotated[int, Meta(ge=1, le=5)] = 1
    # nats-server reads a stream's max_msg_size as a 32-bit integer, and a message is 64 MiB at
    # most (its max_payload's ceiling): past that the server refused the stream after connecting.
    max_msg_size: Annotated[int, Meta(ge=1, le=64 * MiB)] = 8 * MiB
    max_msgs: PositiveInt = 1_000_000
    max_bytes: PositiveInt = 1024 * MiB
    duplicate_window_s: PositiveFloat = 120.0
    # How long a delivered request stays its worker's without a word: a running batch or load
    # renews it every third of this (a progress ack), so it bounds only how long a killed
    # worker's requests wait before another worker may take them.
    ack_wait_s: PositiveFloat = 5.0
    max_deliver: PositiveInt = 5
    max_ack_pending: PositiveInt = 1024
    dlq_max_age_s: PositiveFloat = 7 * 24 * 3600.0
    # Per-model consumers: created when a worker first serves the model and removed by the server
    # after `consumer_idle_s` without pulls ("on-demand"), or all at startup and kept ("eager":
    # what a KEDA trigger on every model's consumer lag needs). docs/scaleout.md has the costs.
    consumers: Literal["on-demand", "eager"] = "on-demand"
    consumer_idle_s: Annotated[float, Meta(ge=60, le=1e9)] = 600.0


class ModelConfig(_Base):
    """One model served by a worker."""

    handler: str  # "export", "state_dict", "function", "torchscript", "identity", "sleep", or "package.module:Class"
    path: str | None = None  # the model file (export, state_dict, torchscript), relative to the config file
    module_class: str | None = None  # state_dict: "package.module:Class" to build before assigning the weights
    module_kwargs: dict[str, Any] = {}  # state_dict: the class's constructor arguments
    function: str | None = None  # function: "package.module:function", called with a list of inputs
    max_batch_size: BatchSize = 16
    max_delay_s: NonNegFloat = DEFAULT_MAX_DELAY_S  # batching window, counted from the first request of the batch
    max_concurrent_batches: PositiveInt = 1
    memory_bytes: NonNegInt | None = None  # estimate until measured after load
    load_cost_s: NonNegFloat = 1.0  # estimate until measured
    batch_cost_s: NonNegFloat = 0.005  # fixed seconds per batch, estimate until measured
    item_cost_s: NonNegFloat = 0.0005  # seconds per item, estimate until measured
    # Floor of the scheduler's wait bound; None: the bound follows the traffic (two natural cycles,
    # S / (1 - utilisation)). A bound below the cycle cannot be kept by reordering: docs/scheduler.md.
    max_wait_s: PositiveFloat | None = None
    options: dict[str, Any] = {}  # handler-specific settings
    pin: bool = False  # always resident: loaded at start, never evicted (counts against the budget)
    preload: bool = False  # loaded at start, before the worker reports ready (evictable later)
    # Evict (to the warm tier where it fits) after this long without a batch; None: the worker's
    # `idle_unload_s` (None there too: never for idleness).
    idle_unload_s: Interval | None = None
    # The keys of 0.2, in milliseconds: still read for one release (seconds are the boundary's unit).
    max_delay_ms: NonNegFloat | None = None
    max_wait_ms: PositiveFloat | None = None

    def __post_init__(self) -> None:
        _seconds_from_ms(self, "max_delay")
        _seconds_from_ms(self, "max_wait")


class WorkerConfig(_Base):
    id: SidecarId | None = None  # defaults to hostname-pid
    device: str = "auto"  # "auto" (CUDA if available, else CPU), "cpu", "cuda", "cuda:1", ...
    policy: str = "cost-aware"
    policy_options: dict[str, Any] = {}
    max_resident_models: PositiveInt | None = 1
    memory_budget_bytes: PositiveInt | None = None
    # Host memory for warm copies of evicted models (a reload is then a host-to-device copy).
    # None: a quarter of physical memory; 0: no warm tier.
    host_memory_budget_bytes: NonNegInt | None = None
    startup_timeout_s: PositiveFloat = 60.0  # keep retrying stream setup while JetStream is slow or electing
    # How often the queues are counted (one stream-info call for all models) while work waits or
    # runs; arrivals themselves are events (docs/scaleout.md).
    poll_interval_ms: Annotated[float, Meta(ge=10, le=1e9)] = 250.0
    idle_refresh_s: Annotated[float, Meta(ge=0.05, le=1e9)] = 1.0  # the same count while nothing waits
    prefetch_weights: bool = True  # read the next model's weights from disk while the current one runs
    drain_timeout_s: PositiveFloat = 20.0
    coordinate: bool = True  # advertise residency in the cluster KV bucket and respect other workers
    # A resident model without a batch for this long is evicted, giving its device memory back
    # (per model: models.<m>.idle_unload_s). None: models stay until room is needed.
    idle_unload_s: Interval | None = None
    heartbeat_s: Interval = 1.0  # advert period
    # A peer silent this long is gone (its models are ours to take); longer than a NATS reconnect
    # or leader election, so a node loss does not make placement thrash.
    peer_timeout_s: PositiveFloat = 5.0
    # Requests stored for a model that no live worker registers are answered unknown_model once
    # it has been so this long (worker/orphans.py): longer than a rolling restart of its workers
    # or a scale-up from zero. None: never (they wait for a worker that registers the model).
    orphan_grace_s: Annotated[float, Meta(ge=0.1, le=1e9)] | None = 600.0

    def __post_init__(self) -> None:
        # Checked here, so a typo is named with its file before the worker connects anywhere.
        from .policy.scheduling import POLICIES, RETIRED_OPTIONS, make_policy

        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        try:
            # cost-aware's retired options are left for the worker to warn about, once, where it
            # builds its policy; any other policy refuses them here.
            retired = RETIRED_OPTIONS if self.policy.startswith("cost-aware") else ()
            make_policy(self.policy, **{k: v for k, v in self.policy_options.items() if k not in retired})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"policy_options: {exc}") from None


class ClassifierConfig(_Base):
    """The classifier sidecar: pulls ``<prefix>.in`` and republishes to ``<prefix>.model.<name>``."""

    id: SidecarId | None = None  # defaults to classifier-<hostname>-<pid>
    router: Literal["torch", "rules", "callable"] = "rules"
    max_batch_size: BatchSize = 64
    max_delay_s: NonNegFloat = DEFAULT_MAX_DELAY_S
    max_delay_ms: NonNegFloat | None = None  # the 0.2 key, still read for one release
    # torch router
    handler: str = "export"  # "export", "state_dict", "torchscript" (a file at `path`) or "package.module:Class"
    path: str | None = None
    module_class: str | None = None  # state_dict: "package.module:Class"
    module_kwargs: dict[str, Any] = {}
    labels: dict[str, str] = {}  # class index (as a string) or label -> model name
    confidence_threshold: Annotated[float, Meta(ge=0, le=1)] = 0.0
    fallback_model: str | None = None
    device: str = "cpu"
    input_shape: list[PositiveInt] | None = None  # one request's tensor shape, without the batch dimension
    # rules router: first match wins; each rule is {header = "...", equals = "..."} or
    # {field = "a.b", equals = ...} plus model = "..."
    rules: list[dict[str, Any]] = []
    default_model: str | None = None
    # callable router
    callable: str | None = None  # "package.module:function"
    options: dict[str, Any] = {}

    def __post_init__(self) -> None:
        _seconds_from_ms(self, "max_delay")
        named = [("fallback_model", self.fallback_model), ("default_model", self.default_model)]
        named += [(f"labels.{label}", model) for label, model in self.labels.items()]
        named += [(f"rules[{n}].model", rule.get("model")) for n, rule in enumerate(self.rules) if isinstance(rule, dict)]
        for key, model in named:
            if model is None:
                continue
            try:
                validate_model_name(model) if isinstance(model, str) else _not_a_name(model)
            except ProtocolError as exc:
                raise ValueError(f"{key}: {exc}") from None


def _not_a_name(value: object) -> None:
    raise ProtocolError(f"expected a model name, got {type(value).__name__}")


Weight = Annotated[float, Meta(gt=0, le=1e6)]
DEFAULT_SHARE_OF_SERVICE = 0.75
DEFAULT_CREDIT_S = 2.0
DEFAULT_SHARE_WINDOW_S = 10.0


class TenantsConfig(_Base):
    """Fair shares and quotas between tenants (docs/tenancy.md), applied where a tenant's request
    is admitted: the classifier, which learns the tenant from the subject a request arrived on.

    ``weights``: a tenant's share of service relative to the others sending (``default_weight``
    for a tenant not named). ``max_rps`` / ``max_waiting``: quotas answered ``Overloaded`` at
    admission, per tenant (``default_max_rps`` / ``default_max_waiting`` for the others; None: no
    quota). ``share_of_service``: the part of the measured service rate shared out as fair
    shares while arrivals outrun it (the rest is headroom for the interactive lines to drain);
    ``credit_s``: how many seconds of its fair rate a tenant may send at once; ``window_s``: over
    how long demand and service rates are measured. ``metric_tenants``: tenants named in metrics,
    the others counted as ``_other`` (a bounded label set)."""

    # Per tenant: checked one by one below, so that an error names the tenant.
    weights: dict[str, float] = {}
    default_weight: Weight = 1.0
    max_rps: dict[str, float] = {}
    default_max_rps: PositiveFloat | None = None
    max_waiting: dict[str, int] = {}
    default_max_waiting: PositiveInt | None = None
    share_of_service: Annotated[float, Meta(gt=0, le=1)] = DEFAULT_SHARE_OF_SERVICE
    credit_s: Annotated[float, Meta(ge=0.01, le=3600)] = DEFAULT_CREDIT_S
    window_s: Annotated[float, Meta(ge=0.1, le=3600)] = DEFAULT_SHARE_WINDOW_S
    metric_tenants: Annotated[int, Meta(ge=0, le=10_000)] = 32

    def __post_init__(self) -> None:
        bounds = {"weights": (Weight, float), "max_rps": (PositiveFloat, float), "max_waiting": (PositiveInt, int)}
        for key, (kind, _) in bounds.items():
            for name, value in getattr(self, key).items():
                try:
                    validate_tenant(name)
                except ProtocolError as exc:
                    raise ValueError(f"{key}: {exc}") from None
                try:
                    msgspec.convert(value, kind)
                except msgspec.ValidationError as exc:
                    raise ValueError(f"{key}.{name}: {exc}") from None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def rps_quota(self, tenant: str) -> float | None:
        return self.max_rps.get(tenant, self.default_max_rps)

    def waiting_quota(self, tenant: str) -> int | None:
        return self.max_waiting.get(tenant, self.default_max_waiting)


class TelemetryConfig(_Base):
    console: bool = False  # print spans to stdout (debugging); exporters otherwise come from OTEL_*


class HttpConfig(_Base):
    """Each sidecar's HTTP endpoints: /healthz, /readyz and /metrics (Prometheus text).

    A port of None turns a sidecar's endpoints off; 0 picks a free port (logged at start).
    9464 is the Prometheus exporters' customary port; the classifier takes the next one so both
    sidecars fit one pod or host.
    """

    # Loopback unless configured: on a laptop (`jetbatch up`, `demo`) the endpoints are not for the
    # network. The container image sets JETBATCH_HTTP__HOST=0.0.0.0, where probes and scrapes
    # come from outside the container.
    host: str = "127.0.0.1"
    worker_port: Annotated[int, Meta(ge=0, le=65535)] | None = 9464
    classifier_port: Annotated[int, Meta(ge=0, le=65535)] | None = 9465
    metrics: bool = True  # serve /metrics (installs the OpenTelemetry Prometheus reader)


class Config(_Base):
    nats: NatsConfig = NatsConfig()
    streams: StreamsConfig = StreamsConfig()
    worker: WorkerConfig = WorkerConfig()
    models: dict[str, ModelConfig] = {}
    classifier: ClassifierConfig | None = None
    telemetry: TelemetryConfig = TelemetryConfig()
    http: HttpConfig = HttpConfig()
    replies: RepliesConfig = RepliesConfig()
    tenants: TenantsConfig = TenantsConfig()

    def __post_init__(self) -> None:
        for name in self.models:
            try:
                validate_model_name(name)
            except ProtocolError as exc:
                raise ValueError(f"models: {exc}") from None
        self._check_pins()

    def _check_pins(self) -> None:
        """Pinned models must fit the device budget with room left for the others: a worker that
        could never load an unpinned model is refused at start, naming the key."""
        pinned = sorted(n for n, m in self.models.items() if m.pin)
        if not pinned:
            return
        others = len(self.models) - len(pinned)
        slots = self.worker.max_resident_models
        if slots is not None and (len(pinned) > slots or (others and len(pinned) >= slots)):
            room = "and leave a slot for the other models " if others else ""
            raise ValueError(
                f"worker.max_resident_models: {len(pinned)} pinned models ({', '.join(pinned)}) do not fit {slots} slots {room}".rstrip()
            )
        budget = self.worker.memory_budget_bytes
        pinned_bytes = sum(self.models[n].memory_bytes or 0 for n in pinned)
        if budget is not None and pinned_bytes > budget:
            raise ValueError(f"worker.memory_budget_bytes: the pinned models ({', '.join(pinned)}) need {pinned_bytes} bytes, over {budget}")

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.nats.prefix)

    @property
    def reply_policy(self) -> ReplyPolicy:
        """The reply policy of this deployment: the deployment's own prefix is never a reply
        target, nor a sidecar's own inbox namespace when it has one (``inbox_prefix`` other than a
        callers' prefix): its pull requests' and PubAcks' replies come there, and a caller who
        learnt one of those subjects could otherwise have an answer it chose sent to it."""
        own = {i.inbox_prefix for i in (self.nats, self.nats.reply_identity) if i is not None}
        callers = {*self.replies.allowed_prefixes, self.replies.tenant_prefix}
        return ReplyPolicy(
            allowed_prefixes=tuple(self.replies.allowed_prefixes),
            tenant_prefix=self.replies.tenant_prefix,
            forbidden_prefixes=(self.nats.prefix, *sorted(own - callers)),
        )


def _set_path(raw: dict[str, Any], path: list[str], value: str) -> None:
    node = raw
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[path[-1]] = value


def _env_overrides(raw: dict[str, Any], environ: Mapping[str, str]) -> list[str]:
    applied = []
    for var, value in sorted(environ.items()):
        if not var.startswith("JETBATCH_") or "__" not in var:
            continue
        parts = var[len("JETBATCH_") :].split("__")
        path = [p.lower() for p in parts]
        if path[0] == "models" and len(path) > 1:
            path[1] = parts[1]  # model names are case-sensitive
        _set_path(raw, path, value)
        applied.append(var)
    if environ.get("NATS_URL") and not environ.get("JETBATCH_NATS__URL"):
        raw.setdefault("nats", {})
        if isinstance(raw["nats"], dict):
            raw["nats"].setdefault("url", environ["NATS_URL"])
    return applied


def parse_config(
    text: str | None, *, source: str = "<config>", environ: Mapping[str, str] | None = None
) -> Config:
    """Decode a TOML document (or none) plus environment overrides into a :class:`Config`.

    Raises :class:`ConfigError` with a one-line message naming ``source``, the key and the problem.
    """
    try:
        raw: dict[str, Any] = tomllib.loads(text) if text else {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid TOML: nested too deep") from None
    try:
        # The file's own values are typed by TOML: checked strictly, so `max_batch_size = "16"`
        # is refused with its key rather than coerced.
        msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(_name_dict_keys(exc, raw, strict=True))}") from None
    env_vars = _env_overrides(raw, os.environ if environ is None else environ)
    try:
        # strict=False: environment values arrive as strings ("32", "true") and must coerce.
        return msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as exc:
        where = f"{source} (or environment {', '.join(env_vars)})" if env_vars else source
        raise ConfigError(f"{where}: {describe_validation_error(_name_dict_keys(exc, raw))}") from None


def _name_dict_keys(exc: msgspec.ValidationError, raw: dict[str, Any], *, strict: bool = False) -> str:
    """msgspec reports dict entries as ``models[...]``: find the entry so the message names it."""
    message = str(exc)
    models = raw.get("models")
    if "$.models[...]" in message and isinstance(models, dict):
        for name, value in models.items():
            try:
                msgspec.convert(value, ModelConfig, strict=strict)
            except msgspec.ValidationError as inner:
                inner_msg = str(inner).replace("`$", f"`$.models.{name}", 1)
                if "`$" not in str(inner):
                    inner_msg = f"{inner} - at `$.models.{name}`"
                return inner_msg
    return message


def describe_validation_error(message: str, where: str = "") -> str:
    """A msgspec validation message with the key first: "Expected `int`, got `str` - at
    `$.models.m1.max_batch_size`" becomes "models.m1.max_batch_size: Expected `int`, got `str`"
    (``where``: the path of the value that was converted, when it was not the whole file)."""
    problem, sep, path = message.rpartition(" - at `$")
    if not sep:
        problem, path = message, ""
    path = ".".join(p for p in (where, path.rstrip("`").lstrip(".")) if p)
    problem = problem.replace("Object contains unknown field", "unknown key").replace(
        "Object missing required field", "missing required key"
    )
    # A section's own check says "key: problem" (__post_init__): join it to the section's path.
    own = _OWN_KEY_RE.match(problem)
    if path and own:
        return f"{path}.{own.group(1)}: {own.group(2)}"
    return f"{path}: {problem}" if path else problem


# How long a file that is a pipe (`--config <(envsubst < tmpl)`) may take to start and finish.
PIPE_WAIT_S = 10.0


def read_bounded(path: str | os.PathLike[str], limit: int, *, pipe_wait_s: float | None = None) -> bytes:
    """A file's bytes, at most ``limit`` and one more (the caller refuses that): a path such as
    /dev/zero never ends. A named pipe is read within ``pipe_wait_s`` (TimeoutError past it): one
    nobody writes to would block an ``open`` forever, so it is opened without waiting and polled
    (Linux reports a hang-up only once a writer came and went, so a writer that is still starting
    is waited for)."""
    pipe_wait_s = PIPE_WAIT_S if pipe_wait_s is None else pipe_wait_s
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
        if not pipe:
            os.set_blocking(fd, True)
        deadline = time.monotonic() + pipe_wait_s
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            if pipe:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                    raise TimeoutError(f"a pipe that gave no end of file within {pipe_wait_s:g} s")
            try:
                chunk = os.read(fd, min(1 << 16, limit + 1 - total))
            except BlockingIOError:
                continue
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_config(path: str | os.PathLike[str] | None, *, environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file (None: defaults and environment only)."""
    if path is None:
        return parse_config(None, source="environment", environ=environ)
    p = Path(path)
    try:
        data = read_bounded(p, MAX_CONFIG_BYTES)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: larger than {MAX_CONFIG_BYTES} bytes: not a config file")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read: {exc}") from None
    config = parse_config(text, source=str(p), environ=environ)
    return _resolve_paths(config, p.parent)


def _resolve_paths(config: Config, base: Path) -> Config:
    """Model and classifier paths are relative to the config file, like most TOML tools do."""
    models = {
        name: msgspec.structs.replace(m, path=str((base / m.path).resolve())) if m.path else m
        for name, m in config.models.items()
    }
    classifier = config.classifier
    if classifier is not None and classifier.path:
        classifier = msgspec.structs.replace(classifier, path=str((base / classifier.path).resolve()))
    return msgspec.structs.replace(config, models=models, classifier=classifier)
