"""Simulator workloads: models with their true costs (and what the configuration says), arrivals,
the memory budget, workers, noise and policy options, from TOML or JSON files.

    [budget]
    max_models = 1                      # and/or max_bytes
    [host]
    budget_bytes = 0                    # the warm tier (0: off)
    prefetch = false                    # read the next model into the warm tier during batches
    [workers]
    count = 1                           # workers sharing the queues
    shards = false                      # each model registered by one worker only (the i-th listed
                                        # model by worker i mod count), as configs split between workers
    [noise]
    cv = 0.0                            # multiplicative noise on load and batch times
    seed = 1
    [policy]                            # options for the policies (their keyword arguments)
    [control]                           # what the live worker's control plane costs (default: as measured)
    decision_s = 0.00025                # CPU seconds of one decision, plus
    decision_per_model_s = 0.0000075    # ... per model the policy looks at (policy/visible.py)
    arrival_delay_s = 0.0005            # from a request's store to the worker knowing of it
    load_overhead_s = 0.003             # per load: the consumer check
    batch_overhead_s = 0.001            # per batch, before compute: the fetch and the thread hop
    answer_s = 0.0013                   # per batch, after compute: store the answers, reply (off the device)
    consumer_create_s = 0.002           # a model's first load (consumers on demand): make its consumer
    consumer_idle_s = 600.0             # ... again after this long unused (streams.consumer_idle_s)
    claim_s = 0.002                     # per load: claim the models it touches (the release is off the path)
    advert_s = 0.002                    # per load with peers: the advert before it
    cv = { consumer_create_s = 1.0 }    # spread of a round trip (lognormal, mean kept): claim_s,
                                        # advert_s, consumer_create_s, answer_s, batch_overhead_s
    [models.m1]
    load_cost_s = 0.5                   # true seconds to load from disk (cold)
    warm_load_cost_s = 0.05             # true seconds to load from the warm tier
    batch_cost_s = 0.005                # true fixed seconds per batch
    item_cost_s = 0.0001                # true seconds per request
    max_batch_size = 16
    max_delay_s = 0.005                 # batch window (the worker's default too)
    max_wait_s = 10.0                   # floor of the wait bound (default: from the traffic)
    memory_bytes = 1
    deadline_s = 5.0                    # each request's deadline after its arrival (optional)
    cancel_after_s = 1.0                # each caller cancels this long after its arrival (optional)
    configured_load_cost_s = 0.5        # what the configuration tells the estimator (default: true)
    [arrivals]
    kind = "burst"                      # burst | poisson | onoff | trace
    per_model = 64                      # burst: per model, interleaved m1, m2, ... m1, m2
    # poisson: rate (req/s) or utilization; duration_s; mix = {m1 = 0.5} or zipf = 1.1; seed
    # onoff:   as poisson, with on_s and off_s: arrivals only during on periods, at rate / duty
    # trace:   path = "trace.jsonl" (lines {"t": seconds, "model": "m1"}, optionally "priority": "batch")
    interactive_share = 0.2             # poisson/onoff/burst: the share of interactive requests (rest: batch)
    [tenants.a]                         # poisson/onoff: one arrival stream per tenant (docs/tenancy.md)
    utilization = 0.35                  # or rate (req/s); [arrivals] gives the rest (kind, mix, duration)
    weight = 1.0                        # its share of service relative to the others
    surge = { factor = 10, start_s = 60, duration_s = 60 }   # sends factor x its rate for a while
    [tenancy]                           # fair shares' options (config [tenants]); enabled = false:
    enabled = true                      # first come, first served (the comparison)

The keys ``load_s``, ``batch_fixed_s`` and ``batch_item_s`` of earlier releases still work, with a
deprecation line on stderr.
"""

from __future__ import annotations

import json
import math
import random
import sys
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Sequence

import msgspec
from msgspec import Meta

from jetbatch.sdk.protocol import Priority

from ..config import DEFAULT_CREDIT_S, DEFAULT_MAX_DELAY_S, DEFAULT_SHARE_OF_SERVICE, DEFAULT_SHARE_WINDOW_S, TenantsConfig, describe_validation_error, read_bounded
from ..errors import SidecarError
from ..policy import Budget

__all__ = ["Control", "SimModel", "Workload", "WorkloadError", "build_workload", "capacity_rps", "load_workload"]

_RENAMED = {"load_s": "load_cost_s", "batch_fixed_s": "batch_cost_s", "batch_item_s": "item_cost_s"}
_warned: set[str] = set()


class WorkloadError(SidecarError, ValueError):
    """A workload file is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class SimModel:
    name: str
    load_cost_s: float
    batch_cost_s: float = 0.005
    item_cost_s: float = 0.0001
    max_batch_size: int = 16
    max_wait_s: float | None = None  # None: the policy derives the bound from the traffic
    memory_bytes: int = 1
    max_delay_s: float = DEFAULT_MAX_DELAY_S  # the worker's default (config.ModelConfig)
    warm_load_cost_s: float | None = None  # None: a tenth of the cold load
    deadline_s: float | None = None
    cancel_after_s: float | None = None  # each caller cancels this long after its arrival (the SDK's cancel)
    configured_load_cost_s: float | None = None
    configured_batch_cost_s: float | None = None
    configured_item_cost_s: float | None = None
    pin: bool = False  # resident from the start, never evicted (the worker's models.<m>.pin)
    preload: bool = False  # resident from the start (the worker's models.<m>.preload)
    idle_unload_s: float | None = None  # evicted after this long without a batch (the worker's rule)
    max_concurrent_batches: int = 1  # the worker's models.<m>.max_concurrent_batches (the pipeline bound)

    def batch_s(self, n: int) -> float:
        """True device seconds of a batch of ``n``."""
        return self.batch_cost_s + self.item_cost_s * n

    def load_s(self, tier: str) -> float:
        """True seconds to load from ``tier`` ("cold" or "warm")."""
        if tier == "warm":
            return self.warm_load_cost_s if self.warm_load_cost_s is not None else self.load_cost_s / 10.0
        return self.load_cost_s


@dataclass(frozen=True)
class Control:
    """What the live worker's control plane costs, so the simulated worker pays it too. The
    defaults are the live worker's, measured by ``python -m bench.scale.control_plane`` and
    ``python -m bench.scale.many_models`` on the 2-core development VM (docs/benchmarks.md): a decision's CPU (fixed, and per model shown to the policy), the delay
    before an arrival is known (the stream's republished event), and the fixed part of a load
    (the consumer check; with peers, the claims, the adverts and the release), and
    a batch's fixed I/O: the fetch before compute (it holds the worker), and storing and sending
    the answers after it (they do not hold the device, but the caller waits for them)."""

    decision_s: float = 0.00025
    decision_per_model_s: float = 0.0000075
    arrival_delay_s: float = 0.0005
    load_overhead_s: float = 0.003
    batch_overhead_s: float = 0.001
    answer_s: float = 0.0013
    # The first load of a model whose consumer does not exist yet (streams.consumers =
    # "on-demand") makes it: about 2 ms on one server, 10-70 ms on a 3-node cluster where each
    # consumer is a Raft group (bench/scale/consumers.py). 0 for "eager" consumers.
    consumer_create_s: float = 0.002
    consumer_idle_s: float = 600.0  # the server removes a consumer nobody pulled from this long
    # A load claims its models (and with peers advertises) before it: key-value round trips,
    # about 1 ms each on one server, 4-20 ms on the loaded 3-node test cluster
    # (bench/scale/control_plane.py). The advert after it and the release run beside its first
    # batch: the simulator does not charge them.
    claim_s: float = 0.002
    advert_s: float = 0.002
    # A worker that stops serving a model's batches counts that model's interactive line (a
    # stream-info and a consumer-info round trip, policy/interest.py) before it decides again.
    count_line_s: float = 0.001
    # A forward pass's time beyond its model's batch cost: the hop to the compute thread and
    # back, and the interpreter lock that thread waits for while the event loop runs. About 3 ms
    # a batch on the busy 2-core VM at 200 models; 0 by default, so the cost model alone decides.
    compute_excess_s: float = 0.0
    # The spread of the round trips above (coefficient of variation; each draw lognormal with
    # the mean kept), by field name: a mean alone hid the tail of a loaded cluster, where making
    # a consumer takes 10 to 200 ms (the simulator's p99 was 0.7x the live worker's).
    cv: Mapping[str, float] = field(default_factory=dict)

    def decision_cost_s(self, models_shown: int) -> float:
        return self.decision_s + self.decision_per_model_s * models_shown

    @classmethod
    def measured(cls, stats: Mapping[str, int], base: "Control | None" = None) -> "Control":
        """The costs live workers measured on their deployment: their status counters
        (``SidecarReport.stats``, summed over the workers; ``jetbatch status --json``). A cost
        they have no sample of keeps ``base``'s (the defaults). So the simulator of a 3-node
        cluster pays its claims and adverts at the cluster's round trips, not one server's."""
        base = cls() if base is None else base
        values: dict[str, Any] = {}
        cv = dict(base.cv)
        for step, name in MEASURED_STEPS.items():
            n = stats.get(f"{step}_n", 0)
            if n <= 0:
                continue
            mean_us = stats.get(f"{step}_us", 0) / n
            values[name] = mean_us / 1e6
            if name in SPREAD_FIELDS and mean_us > 0:
                var = max(0.0, stats.get(f"{step}_us2", 0) / n - mean_us * mean_us)
                cv[name] = min(math.sqrt(var) / mean_us, 10.0)
        if stats.get("decisions", 0) > 0:
            shown = stats.get("models_shown", 0) / stats["decisions"]
            values["decision_s"] = max(0.0, stats.get("decision_us", 0) / 1e6 / stats["decisions"] - base.decision_per_model_s * shown)
        return replace(base, cv=cv, **values)


# The worker's counters (sidecar/worker/counters.py) -> the cost each one measures.
MEASURED_STEPS = {
    "claim": "claim_s",
    "advert": "advert_s",
    "consumer_create": "consumer_create_s",
    "answer": "answer_s",
    "ready_fetch": "batch_overhead_s",
    "arrival_delay": "arrival_delay_s",
    "count_line": "count_line_s",
    "compute_excess": "compute_excess_s",
}
# The costs drawn with a spread (arrivals keep a fixed delay: they are admitted in time order).
SPREAD_FIELDS = frozenset({"claim_s", "advert_s", "consumer_create_s", "answer_s", "batch_overhead_s", "compute_excess_s"})


IDEAL_CONTROL = Control(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 600.0, 0.0, 0.0, count_line_s=0.0, compute_excess_s=0.0)


@dataclass(frozen=True)
class Workload:
    models: dict[str, SimModel]
    arrivals: tuple[tuple[float, str], ...]  # (time, model), sorted by time
    # Per arrival, whether it is of the interactive priority class; empty: classes not used
    # (every request interactive, the default class).
    interactive: tuple[bool, ...] = ()
    budget: Budget = Budget(max_models=1)
    closed: bool = False  # every request present at t=0 (a burst)
    resident_at_start: tuple[str, ...] = ()
    workers: int = 1
    shards: bool = False  # model i is registered by worker i mod workers only
    host_budget_bytes: int = 0
    prefetch: bool = False
    noise_cv: float = 0.0
    seed: int = 1
    policy_options: dict[str, Any] = field(default_factory=dict)
    horizon_s: float = 0.0  # end of the arrival window (0: the last arrival)
    control: Control = Control()
    # Per arrival, its tenant (empty: no tenants); and the fair shares' rules (None: first come,
    # first served between tenants).
    tenants: tuple[str, ...] = ()
    tenancy: TenantsConfig | None = None

    @property
    def window_s(self) -> float:
        return self.horizon_s or (self.arrivals[-1][0] if self.arrivals else 0.0)


def load_workload(path: str | Path) -> Workload:
    """Read a workload file (TOML or JSON); :class:`WorkloadError` names the file and the key."""
    p = Path(path)
    text = _read(p, _MAX_WORKLOAD_BYTES, f"{p}")
    kind = "JSON" if p.suffix == ".json" else "TOML"
    try:
        raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise WorkloadError(f"{p}: invalid {kind}: {exc}") from None
    except RecursionError:
        raise WorkloadError(f"{p}: invalid {kind}: nested too deep") from None
    except ValueError as exc:  # an integer of thousands of digits (JSON), a number Python will not read
        raise WorkloadError(f"{p}: invalid {kind}: {str(exc)[:120]}") from None
    try:
        return build_workload(raw, base=p.parent, strict=True)
    except WorkloadError as exc:
        raise WorkloadError(f"{p}: {exc}") from None


_MAX_WORKLOAD_BYTES = 4 * 1024 * 1024  # a workload file is kilobytes; past this it is not one
_MAX_TRACE_BYTES = 1024 * 1024 * 1024  # a trace is a line a request: 20 million lines at most


def _read(path: Path, limit: int, name: str) -> str:
    """A file's text, read with a bound (and a pipe with a deadline); WorkloadError otherwise."""
    try:
        data = read_bounded(path, limit)
        if len(data) > limit:
            raise WorkloadError(f"{name}: larger than {limit} bytes")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{name}: cannot read: {exc}") from None


# The file's schema: unknown keys, wrong types and out-of-range numbers are refused with the key.
# Finite: an infinite cost ran and printed NaN latencies (and JSON no parser reads).
_NonNeg = Annotated[float, Meta(ge=0, le=1e9)]
_Positive = Annotated[float, Meta(gt=0, le=1e9)]
_Count = Annotated[int, Meta(ge=1, le=1_000_000)]  # batch sizes and model counts
_Bytes = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class _Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class _ModelSpec(_Spec):
    load_cost_s: _NonNeg
    batch_cost_s: _NonNeg = 0.005
    item_cost_s: _NonNeg = 0.0001
    max_batch_size: _Count = 16
    max_wait_s: _NonNeg | None = None
    memory_bytes: _Bytes = 1
    max_delay_s: _NonNeg = DEFAULT_MAX_DELAY_S
    warm_load_cost_s: _NonNeg | None = None
    deadline_s: _Positive | None = None
    cancel_after_s: _NonNeg | None = None
    configured_load_cost_s: _NonNeg | None = None
    configured_batch_cost_s: _NonNeg | None = None
    configured_item_cost_s: _NonNeg | None = None
    pin: bool = False
    preload: bool = False
    idle_unload_s: Annotated[float, Meta(ge=0.01, le=1e9)] | None = None  # below a clock's step, an eviction never ends
    max_concurrent_batches: Annotated[int, Meta(ge=1, le=64)] = 1


class _BudgetSpec(_Spec):
    max_models: _Count | None = None
    max_bytes: Annotated[int, Meta(ge=1, le=2**63 - 1)] | None = None


class _HostSpec(_Spec):
    budget_bytes: _Bytes = 0
    prefetch: bool = False


class _NoiseSpec(_Spec):
    cv: _NonNeg = 0.0
    seed: int = 1


class _WorkersSpec(_Spec):
    count: Annotated[int, Meta(ge=1, le=10_000)] = 1
    shards: bool = False


class _ArrivalsSpec(_Spec):
    kind: Literal["burst", "poisson", "onoff", "trace"] = "burst"
    per_model: Annotated[int, Meta(ge=0, le=10_000_000)] = 64
    rate: _Positive | None = None
    utilization: _Positive = 0.7
    duration_s: Annotated[float, Meta(gt=0, le=7 * 86400)] = 60.0
    mix: dict[str, _NonNeg] | None = None
    zipf: Annotated[float, Meta(ge=0, le=20)] | None = None
    seed: int = 1
    on_s: Annotated[float, Meta(ge=0.001, le=1e6)] | None = None
    off_s: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    path: str | None = None
    # The share of requests of the interactive priority class (the rest: batch), drawn per
    # request with its own seed; a trace gives each record's "priority" instead.
    interactive_share: Annotated[float, Meta(ge=0, le=1)] | None = None


class _ControlSpec(_Spec):
    decision_s: Annotated[float, Meta(ge=0, le=10)] = Control.decision_s
    decision_per_model_s: Annotated[float, Meta(ge=0, le=1)] = Control.decision_per_model_s
    arrival_delay_s: Annotated[float, Meta(ge=0, le=60)] = Control.arrival_delay_s
    load_overhead_s: Annotated[float, Meta(ge=0, le=60)] = Control.load_overhead_s
    batch_overhead_s: Annotated[float, Meta(ge=0, le=60)] = Control.batch_overhead_s
    answer_s: Annotated[float, Meta(ge=0, le=60)] = Control.answer_s
    consumer_create_s: Annotated[float, Meta(ge=0, le=60)] = Control.consumer_create_s
    consumer_idle_s: Annotated[float, Meta(ge=60, le=1e9)] = Control.consumer_idle_s
    claim_s: Annotated[float, Meta(ge=0, le=60)] = Control.claim_s
    advert_s: Annotated[float, Meta(ge=0, le=60)] = Control.advert_s
    count_line_s: Annotated[float, Meta(ge=0, le=60)] = Control.count_line_s
    compute_excess_s: Annotated[float, Meta(ge=0, le=60)] = Control.compute_excess_s
    cv: dict[Literal["claim_s", "advert_s", "consumer_create_s", "answer_s", "batch_overhead_s", "compute_excess_s"], Annotated[float, Meta(ge=0, le=10)]] = {}


class _SurgeSpec(_Spec):
    factor: Annotated[float, Meta(ge=1, le=1000)]
    duration_s: _Positive
    start_s: _NonNeg = 0.0


class _TenantSpec(_Spec):
    utilization: _Positive | None = None
    rate: _Positive | None = None
    weight: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    surge: _SurgeSpec | None = None
    max_rps: _Positive | None = None
    max_waiting: Annotated[int, Meta(ge=1, le=10_000_000)] | None = None


class _TenancySpec(_Spec):
    enabled: bool = True
    share_of_service: Annotated[float, Meta(gt=0, le=1)] = DEFAULT_SHARE_OF_SERVICE
    credit_s: Annotated[float, Meta(ge=0.01, le=3600)] = DEFAULT_CREDIT_S
    window_s: Annotated[float, Meta(ge=0.1, le=3600)] = DEFAULT_SHARE_WINDOW_S


class _WorkloadSpec(_Spec):
    models: dict[str, Any]  # each checked by _model, so a message names the model
    budget: _BudgetSpec | None = None
    host: _HostSpec = _HostSpec()
    noise: _NoiseSpec = _NoiseSpec()
    workers: _WorkersSpec = _WorkersSpec()
    policy: dict[str, Any] = {}
    arrivals: _ArrivalsSpec = _ArrivalsSpec()
    control: _ControlSpec = _ControlSpec()
    tenants: dict[str, Any] = {}  # each checked by _convert, so a message names the tenant
    tenancy: _TenancySpec = _TenancySpec()


def _convert(raw: Any, spec: type[Any], where: str, strict: bool = False) -> Any:
    try:
        # A file's values are typed by TOML or JSON: checked strictly, so `max_batch_size = "8"`
        # is refused with its key (as the worker's config does). A workload built in code may
        # pass 2e9 for an int, or "10".
        return msgspec.convert(raw, spec, strict=strict)
    except msgspec.ValidationError as exc:
        raise WorkloadError(describe_validation_error(str(exc), where)) from None


def _model(name: str, m: Any, strict: bool = False) -> SimModel:
    if not isinstance(m, dict):
        raise WorkloadError(f"models.{name}: expected a table, got {type(m).__name__}")
    m = dict(m)
    for old, new in _RENAMED.items():
        if old in m:
            if old not in _warned:
                _warned.add(old)
                print(f"jetbatch: workload key {old!r} is deprecated; use {new!r}", file=sys.stderr)
            m.setdefault(new, m.pop(old))
    spec = _convert(m, _ModelSpec, f"models.{name}", strict)
    return SimModel(name=name, **msgspec.structs.asdict(spec))


def build_workload(raw: Any, base: Path = Path("."), *, strict: bool = False) -> Workload:
    """A :class:`Workload` from a decoded file (see the module docstring); :class:`WorkloadError`
    names the key of anything missing, unknown or out of range. ``strict``: no value converted
    from another type (a file's, read by :func:`load_workload`)."""
    if not isinstance(raw, dict):
        raise WorkloadError(f"expected a table of sections, got {type(raw).__name__}")
    spec = _convert(raw, _WorkloadSpec, "", strict)
    if not spec.models:
        raise WorkloadError("models: at least one [models.<name>] table is needed")
    models = {name: _model(name, m, strict) for name, m in spec.models.items()}
    b = spec.budget or _BudgetSpec()
    budget = Budget(max_bytes=b.max_bytes, max_models=b.max_models if b.max_models is not None or b.max_bytes is not None else 1)
    per_tenant: dict[str, _TenantSpec] = {}
    try:
        if spec.tenants:
            per_tenant = {name: _convert(t, _TenantSpec, f"tenants.{name}", strict) for name, t in spec.tenants.items()}
            arrivals, closed, horizon, interactive, tenants = _tenant_arrivals(spec.arrivals, per_tenant, models)
        else:
            (arrivals, closed, horizon, interactive), tenants = _arrivals(spec.arrivals, models, base), ()
    except (ArithmeticError, ValueError) as exc:
        if isinstance(exc, WorkloadError):
            raise
        raise WorkloadError(f"arrivals: cannot generate them from these numbers: {exc}") from None
    # Pinned, then preloaded models are on the device at the start, as the worker loads them
    # before it reports ready (preloads while the model slots last).
    start = [n for n, m in models.items() if m.pin] + [n for n, m in models.items() if m.preload and not m.pin]
    if budget.max_models is not None:
        pinned = sum(1 for m in models.values() if m.pin)
        if pinned > budget.max_models or (pinned and pinned == budget.max_models and pinned < len(models)):
            raise WorkloadError(f"budget.max_models: {pinned} pinned models do not fit {budget.max_models} slots and leave one for the others")
        start = start[: budget.max_models]
    return Workload(
        models=models,
        arrivals=arrivals,
        interactive=interactive,
        budget=budget,
        closed=closed,
        resident_at_start=tuple(start),
        workers=spec.workers.count,
        shards=spec.workers.shards,
        host_budget_bytes=spec.host.budget_bytes,
        prefetch=spec.host.prefetch,
        noise_cv=spec.noise.cv,
        seed=spec.noise.seed,
        policy_options=dict(spec.policy),
        horizon_s=horizon,
        control=Control(**msgspec.structs.asdict(spec.control)),
        tenants=tenants,
        tenancy=_tenancy(spec, per_tenant) if per_tenant and spec.tenancy.enabled else None,
    )


def _tenancy(spec: _WorkloadSpec, tenants: Mapping[str, _TenantSpec]) -> TenantsConfig:
    """The fair shares' rules a workload's tenants are admitted by (config ``[tenants]``)."""
    t = spec.tenancy
    try:
        return TenantsConfig(
            weights={n: ts.weight for n, ts in tenants.items()},
            max_rps={n: ts.max_rps for n, ts in tenants.items() if ts.max_rps is not None},
            max_waiting={n: ts.max_waiting for n, ts in tenants.items() if ts.max_waiting is not None},
            share_of_service=t.share_of_service, credit_s=t.credit_s, window_s=t.window_s,
        )  # fmt: skip
    except ValueError as exc:
        raise WorkloadError(f"tenants: {exc}") from None


def _tenant_arrivals(
    arr: _ArrivalsSpec, tenants: Mapping[str, _TenantSpec], models: dict[str, SimModel]
) -> tuple[tuple[tuple[float, str], ...], bool, float, tuple[bool, ...], tuple[str, ...]]:
    """One arrival stream per tenant, drawn as ``[arrivals]`` says with the tenant's own rate (or
    utilization) and seed, plus its surge; merged in time order, each arrival naming its tenant."""
    if arr.kind not in ("poisson", "onoff"):
        raise WorkloadError("tenants: per-tenant streams need arrivals.kind poisson or onoff")
    merged: list[tuple[float, str, str]] = []
    for k, (name, ts) in enumerate(sorted(tenants.items())):
        if (ts.rate is None) == (ts.utilization is None):
            raise WorkloadError(f"tenants.{name}: give exactly one of rate and utilization")
        own = msgspec.structs.replace(arr, rate=ts.rate, utilization=ts.utilization or arr.utilization, seed=arr.seed + 7919 * (k + 1))
        out, _, _ = _generated(own, models)
        merged.extend((t, m, name) for t, m in out)
        if ts.surge is not None and ts.surge.factor > 1:
            surge = ts.surge
            extra_rate = (own.rate if own.rate is not None else own.utilization * capacity_rps(models, _weights(own, models))) * (surge.factor - 1)
            extra = msgspec.structs.replace(own, kind="poisson", rate=extra_rate, duration_s=surge.duration_s, seed=own.seed + 104_729)
            more, _, _ = _generated(extra, models)
            merged.extend((surge.start_s + t, m, name) for t, m in more if surge.start_s + t < arr.duration_s)
    if len(merged) > _MAX_ARRIVALS:
        raise WorkloadError(f"tenants: over {_MAX_ARRIVALS} requests in all")
    merged.sort()
    interactive: tuple[bool, ...] = ()
    if arr.interactive_share is not None:
        rng = random.Random(arr.seed + 104_729)
        interactive = tuple(rng.random() < arr.interactive_share for _ in merged)
    return tuple((t, m) for t, m, _ in merged), False, arr.duration_s, interactive, tuple(n for _, _, n in merged)


_MAX_ARRIVALS = 20_000_000  # a workload that would not fit in memory is a typo, not a simulation


def _arrivals(
    arr: _ArrivalsSpec, models: dict[str, SimModel], base: Path
) -> tuple[tuple[tuple[float, str], ...], bool, float, tuple[bool, ...]]:
    """The arrivals, whether they are a closed burst, the window's end, and each arrival's class."""
    if arr.kind == "trace":
        if arr.interactive_share is not None:
            raise WorkloadError("arrivals.interactive_share: a trace gives each record's \"priority\" instead")
        return _trace(arr, models, base)
    out, closed, horizon = _generated(arr, models)
    if arr.interactive_share is None:
        return out, closed, horizon, ()
    # A stream of its own: the same arrivals with or without classes.
    rng = random.Random(arr.seed + 104_729)
    return out, closed, horizon, tuple(rng.random() < arr.interactive_share for _ in out)


def _generated(arr: _ArrivalsSpec, models: dict[str, SimModel]) -> tuple[tuple[tuple[float, str], ...], bool, float]:
    names = list(models)
    if arr.kind == "burst":
        if arr.per_model * len(names) > _MAX_ARRIVALS:
            raise WorkloadError(f"arrivals.per_model: {arr.per_model} × {len(names)} models is over {_MAX_ARRIVALS} requests")
        return tuple((0.0, names[k % len(names)]) for k in range(arr.per_model * len(names))), True, 0.0
    if arr.kind in ("poisson", "onoff"):
        rng = random.Random(arr.seed)
        weights = _weights(arr, models)
        if arr.rate is None and not any(w > 0 and m.batch_s(m.max_batch_size) > 0 for w, m in zip(weights, models.values())):
            raise WorkloadError("arrivals.utilization: the models' batches cost nothing, so there is no capacity to take a share of: give a rate")
        rate = arr.rate if arr.rate is not None else arr.utilization * capacity_rps(models, weights)
        duration = arr.duration_s
        if rate * duration > _MAX_ARRIVALS:
            raise WorkloadError(f"arrivals: {rate:.0f} req/s for {duration:g} s is over {_MAX_ARRIVALS} requests")
        on_s = arr.on_s if arr.on_s is not None else duration
        off_s = arr.off_s if arr.off_s is not None else 0.0
        duty = on_s / (on_s + off_s) if arr.kind == "onoff" else 1.0
        burst_rate = rate / duty  # the same mean rate, concentrated in the on periods
        if arr.kind == "onoff" and duration < on_s + off_s:
            # The mean rate holds over whole cycles: a shorter window is all burst (on_s 0.001 and
            # off_s 1e6 in 10 s asked for 10 million requests in its first millisecond).
            raise WorkloadError(f"arrivals.duration_s: {duration:g} s is shorter than one on/off cycle (on_s + off_s = {on_s + off_s:g} s)")
        t, out = 0.0, []
        while True:
            t += rng.expovariate(burst_rate)
            if arr.kind == "onoff":
                cycle = on_s + off_s
                if t % cycle >= on_s:  # in an off period: skip to the next on period
                    t = (t // cycle + 1) * cycle
            if t >= duration:
                break
            out.append((t, rng.choices(names, weights)[0]))
            if len(out) > _MAX_ARRIVALS:  # a burst rate the duty cycle made absurd
                raise WorkloadError(f"arrivals: over {_MAX_ARRIVALS} requests (rate {rate:g}/s, on_s {on_s:g}, off_s {off_s:g})")
        return tuple(out), False, duration
    raise AssertionError(arr.kind)


def _weights(arr: _ArrivalsSpec, models: dict[str, SimModel]) -> list[float]:
    """Each model's share of the arrivals (``mix``, ``zipf`` or even), summing to 1."""
    names = list(models)
    if arr.mix is not None:
        unknown = sorted(set(arr.mix) - set(names))
        if unknown:
            raise WorkloadError(f"arrivals.mix: unknown model {unknown[0]!r}")
        weights = [arr.mix.get(n, 0.0) for n in names]
    elif arr.zipf is not None:
        weights = [1.0 / (k + 1) ** arr.zipf for k in range(len(names))]
    else:
        weights = [1.0] * len(names)
    total_w = sum(weights)
    if total_w <= 0:
        raise WorkloadError("arrivals.mix: at least one weight must be positive")
    return [w / total_w for w in weights]


def _trace(arr: _ArrivalsSpec, models: dict[str, SimModel], base: Path) -> tuple[tuple[tuple[float, str], ...], bool, float, tuple[bool, ...]]:
    if not arr.path:
        raise WorkloadError("arrivals.path: a trace needs the path of its file")
    lines = _read(base / arr.path, _MAX_TRACE_BYTES, f"arrivals.path: {arr.path}").splitlines()
    out: list[tuple[float, str, bool]] = []
    classes = False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            t, model = float(rec["t"]), str(rec["model"])
            priority = str(rec.get("priority", Priority.INTERACTIVE.value))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise WorkloadError(f"arrivals.path: line {n}: expected {{\"t\": seconds, \"model\": name}}") from None
        if priority not in {p.value for p in Priority}:
            raise WorkloadError(f"arrivals.path: line {n}: priority must be one of {', '.join(p.value for p in Priority)}")
        classes = classes or "priority" in rec
        if model not in models:
            raise WorkloadError(f"arrivals.path: line {n}: unknown model {model!r}")
        if not t >= 0 or t == float("inf"):
            raise WorkloadError(f"arrivals.path: line {n}: t must be a finite number >= 0")
        out.append((t, model, priority == Priority.INTERACTIVE.value))
    if not out:
        raise WorkloadError(f"arrivals.path: {arr.path} holds no requests")  # every figure would be nan
    out.sort()
    return tuple((t, m) for t, m, _ in out), False, 0.0, tuple(i for _, _, i in out) if classes else ()


def capacity_rps(models: dict[str, SimModel], weights: Sequence[float]) -> float:
    """Requests/s the device sustains in full batches, ignoring loads (the utilisation reference)."""
    per_request_s = sum(w * m.batch_s(m.max_batch_size) / m.max_batch_size for w, m in zip(weights, models.values()))
    return 1.0 / per_request_s
