"""Simulator workloads: models with their true costs (and what the configuration says), arrivals,
the memory budget, workers, noise and policy options, from TOML or JSON files.

    [budget]
    max_models = 1                      # and/or max_bytes
    [host]
    budget_bytes = 0                    # the warm tier (0: off)
    prefetch = false                    # read the next model into the warm tier during batches
    [workers]
    count = 1                           # workers sharing the queues
    [noise]
    cv = 0.0                            # multiplicative noise on load and batch times
    seed = 1
    [policy]                            # options for the policies (their keyword arguments)
    [models.m1]
    load_cost_s = 0.5                   # true seconds to load from disk (cold)
    warm_load_cost_s = 0.05             # true seconds to load from the warm tier
    batch_cost_s = 0.005                # true fixed seconds per batch
    item_cost_s = 0.0001                # true seconds per request
    max_batch_size = 16
    max_delay_s = 0.0                   # batch window
    max_wait_s = 10.0                   # floor of the wait bound (default: from the traffic)
    memory_bytes = 1
    deadline_s = 5.0                    # each request's deadline after its arrival (optional)
    configured_load_cost_s = 0.5        # what the configuration tells the estimator (default: true)
    [arrivals]
    kind = "burst"                      # burst | poisson | onoff | trace
    per_model = 64                      # burst: per model, interleaved m1, m2, ... m1, m2
    # poisson: rate (req/s) or utilization; duration_s; mix = {m1 = 0.5} or zipf = 1.1; seed
    # onoff:   as poisson, with on_s and off_s: arrivals only during on periods, at rate / duty
    # trace:   path = "trace.jsonl" (lines {"t": seconds, "model": "m1"})

The keys ``load_s``, ``batch_fixed_s`` and ``batch_item_s`` of earlier releases still work, with a
deprecation line on stderr.
"""

from __future__ import annotations

import json
import random
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import SidecarError
from ..policy import Budget

__all__ = ["SimModel", "Workload", "WorkloadError", "build_workload", "capacity_rps", "load_workload"]

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
    max_delay_s: float = 0.0
    warm_load_cost_s: float | None = None  # None: a tenth of the cold load
    deadline_s: float | None = None
    configured_load_cost_s: float | None = None
    configured_batch_cost_s: float | None = None
    configured_item_cost_s: float | None = None

    def batch_s(self, n: int) -> float:
        """True device seconds of a batch of ``n``."""
        return self.batch_cost_s + self.item_cost_s * n

    def load_s(self, tier: str) -> float:
        """True seconds to load from ``tier`` ("cold" or "warm")."""
        if tier == "warm":
            return self.warm_load_cost_s if self.warm_load_cost_s is not None else self.load_cost_s / 10.0
        return self.load_cost_s


@dataclass(frozen=True)
class Workload:
    models: dict[str, SimModel]
    arrivals: tuple[tuple[float, str], ...]  # (time, model), sorted by time
    budget: Budget = Budget(max_models=1)
    closed: bool = False  # every request present at t=0 (a burst)
    resident_at_start: tuple[str, ...] = ()
    workers: int = 1
    host_budget_bytes: int = 0
    prefetch: bool = False
    noise_cv: float = 0.0
    seed: int = 1
    policy_options: dict[str, Any] = field(default_factory=dict)
    horizon_s: float = 0.0  # end of the arrival window (0: the last arrival)

    @property
    def window_s(self) -> float:
        return self.horizon_s or (self.arrivals[-1][0] if self.arrivals else 0.0)


def load_workload(path: str | Path) -> Workload:
    """Read a workload file (TOML or JSON); :class:`WorkloadError` names the file and the key."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise WorkloadError(f"{p}: cannot read: {exc}") from None
    try:
        raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise WorkloadError(f"{p}: invalid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
    try:
        return build_workload(raw, base=p.parent)
    except WorkloadError as exc:
        raise WorkloadError(f"{p}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkloadError(f"{p}: {exc!s}") from None


def _model(name: str, m: dict[str, Any]) -> SimModel:
    m = dict(m)
    for old, new in _RENAMED.items():
        if old in m:
            if old not in _warned:
                _warned.add(old)
                print(f"jetbatch: workload key {old!r} is deprecated; use {new!r}", file=sys.stderr)
            m.setdefault(new, m.pop(old))
    known = {f for f in SimModel.__dataclass_fields__ if f != "name"}
    unknown = set(m) - known
    if unknown:
        raise WorkloadError(f"models.{name}: unknown key {sorted(unknown)[0]!r}")
    if "load_cost_s" not in m:
        raise WorkloadError(f"models.{name}: missing required key 'load_cost_s'")

    def num(key: str, cast: Any) -> Any:
        try:
            return cast(m[key])
        except (TypeError, ValueError):
            raise WorkloadError(f"models.{name}.{key}: expected a number, got {m[key]!r}") from None

    values = {k: num(k, int if k in ("max_batch_size", "memory_bytes") else float) for k in m}
    return SimModel(name=name, **values)


def build_workload(raw: dict[str, Any], base: Path = Path(".")) -> Workload:
    if not raw.get("models"):
        raise WorkloadError("models: at least one [models.<name>] table is needed")
    models = {name: _model(name, m) for name, m in raw["models"].items()}
    b = raw.get("budget", {})
    budget = Budget(max_bytes=b.get("max_bytes"), max_models=b.get("max_models", 1 if "max_bytes" not in b else None))
    host = raw.get("host", {})
    noise = raw.get("noise", {})
    arrivals, closed, horizon = _arrivals(raw.get("arrivals", {"kind": "burst"}), models, base)
    return Workload(
        models=models,
        arrivals=arrivals,
        budget=budget,
        closed=closed,
        workers=int(raw.get("workers", {}).get("count", 1)),
        host_budget_bytes=int(host.get("budget_bytes", 0)),
        prefetch=bool(host.get("prefetch", False)),
        noise_cv=float(noise.get("cv", 0.0)),
        seed=int(noise.get("seed", 1)),
        policy_options=dict(raw.get("policy", {})),
        horizon_s=horizon,
    )


def _arrivals(arr: dict[str, Any], models: dict[str, SimModel], base: Path) -> tuple[tuple[tuple[float, str], ...], bool, float]:
    kind = arr.get("kind", "burst")
    names = list(models)
    if kind == "burst":
        per_model = int(arr.get("per_model", 64))
        return tuple((0.0, names[k % len(names)]) for k in range(per_model * len(names))), True, 0.0
    if kind in ("poisson", "onoff"):
        rng = random.Random(int(arr.get("seed", 1)))
        if "mix" in arr:
            weights = [float(arr["mix"].get(n, 0.0)) for n in names]
        elif "zipf" in arr:
            weights = [1.0 / (k + 1) ** float(arr["zipf"]) for k in range(len(names))]
        else:
            weights = [1.0] * len(names)
        total_w = sum(weights)
        weights = [w / total_w for w in weights]
        rate = float(arr["rate"]) if "rate" in arr else float(arr.get("utilization", 0.7)) * capacity_rps(models, weights)
        duration = float(arr.get("duration_s", 60.0))
        on_s, off_s = float(arr.get("on_s", duration)), float(arr.get("off_s", 0.0))
        if kind == "onoff" and (on_s <= 0 or off_s < 0):
            raise WorkloadError("arrivals: onoff needs on_s > 0 and off_s >= 0")
        duty = on_s / (on_s + off_s) if kind == "onoff" else 1.0
        burst_rate = rate / duty  # the same mean rate, concentrated in the on periods
        t, out = 0.0, []
        while True:
            t += rng.expovariate(burst_rate)
            if kind == "onoff":
                cycle = on_s + off_s
                if t % cycle >= on_s:  # in an off period: skip to the next on period
                    t = (t // cycle + 1) * cycle
            if t >= duration:
                break
            out.append((t, rng.choices(names, weights)[0]))
        return tuple(out), False, duration
    if kind == "trace":
        lines = (base / arr["path"]).read_text().splitlines()
        out = []
        for n, line in enumerate(lines, 1):
            if line.strip():
                rec = json.loads(line)
                if rec["model"] not in models:
                    raise WorkloadError(f"trace line {n}: unknown model {rec['model']!r}")
                out.append((float(rec["t"]), str(rec["model"])))
        return tuple(sorted(out)), False, 0.0
    raise WorkloadError(f"arrivals.kind: expected burst, poisson, onoff or trace, got {kind!r}")


def capacity_rps(models: dict[str, SimModel], weights: Sequence[float]) -> float:
    """Requests/s the device sustains in full batches, ignoring loads (the utilisation reference)."""
    per_request_s = sum(w * m.batch_s(m.max_batch_size) / m.max_batch_size for w, m in zip(weights, models.values()))
    return 1.0 / per_request_s
