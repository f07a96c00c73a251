"""The simulator's side of a side-by-side run: the workloads the scenarios share, built so that a
live run can be given the same models and trace (:func:`sleep_sections` is the live config of
:func:`scale_workload`; :func:`bench.harness.replay` sends its arrivals).

- :func:`open_workload`: the open-traffic families of ``bench.scheduler.open`` (ten models, load
  costs 0.12-2 s spaced geometrically, Zipf 1.1 popularity cheap-popular, costly-popular or
  shuffled), Poisson or on/off arrivals at a utilisation, 1-3 slots or a byte budget.
- :func:`scale_workload`: many equal ``sleep`` models under Poisson Zipf traffic
  (``bench.scale.many_models``, ``bench.scale.control_plane``).
"""

from __future__ import annotations

import random
from typing import Any

from jetbatch.sidecar.simulator import build_workload
from jetbatch.sidecar.simulator.workloads import Workload

__all__ = [
    "COSTS", "FAMILIES", "MEMORY", "N_MODELS", "nominal_cycle_s", "open_models", "open_workload", "scale_workload",
    "sleep_sections",
]  # fmt: skip

FAMILIES = ("cheap-popular", "costly-popular", "unrelated")
MEMORY = ("1 slot", "2 slots", "3 slots", "bytes 40%")
N_MODELS = 10


def open_models(family: str, seed: int, *, n: int = N_MODELS, min_load_s: float = 0.12) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """``n`` models with loads from ``min_load_s`` to 2 s spaced geometrically (cheapest first),
    and a Zipf 1.1 mix over them: cheap-popular, costly-popular, or ranks shuffled by ``seed``."""
    loads = [min_load_s * (2.0 / min_load_s) ** (k / (n - 1)) for k in range(n)]  # cheapest first
    models = {}
    for k, load in enumerate(loads):
        models[f"m{k}"] = {
            "load_cost_s": round(load, 4),
            "warm_load_cost_s": round(load / 5, 4),
            # Bigger models run longer batches: fixed and per-item costs grow with the load cost.
            "batch_cost_s": round(0.01 + 0.02 * load, 4),
            "item_cost_s": round(0.001 + 0.002 * load, 5),
            "max_batch_size": 16,
            "memory_bytes": int(load * 1000),
        }
    ranks = list(range(n))  # ranks[i]: the popularity rank of model i
    if family == "costly-popular":
        ranks.reverse()
    elif family == "unrelated":
        random.Random(1000 + seed).shuffle(ranks)
    mix = {f"m{i}": 1.0 / (ranks[i] + 1) ** 1.1 for i in range(n)}
    return models, mix


def open_workload(family: str, memory: str, rho: float, kind: str, seed: int, duration_s: float) -> Workload:
    models, mix = open_models(family, seed)
    if memory.startswith("bytes"):
        budget: dict[str, Any] = {"max_bytes": int(0.4 * sum(m["memory_bytes"] for m in models.values()))}
    else:
        budget = {"max_models": int(memory.split()[0])}
    arrivals: dict[str, Any] = {"kind": kind, "utilization": rho, "duration_s": duration_s, "mix": mix, "seed": seed}
    if kind == "onoff":
        arrivals.update(on_s=20.0, off_s=20.0)
    return build_workload({"models": models, "budget": budget, "arrivals": arrivals})


def nominal_cycle_s(w: Any, rho: float) -> float:
    """The cycle S / (1 − ρ) of the scheduler notes: S sums the loads of one round, all but about
    (slots − 1) of the ten models when not all fit (the policy's own estimate, cost_aware.cycle_s)."""
    loads = sorted(m.load_cost_s for m in w.models.values())
    slots = w.budget.max_models or len(loads)
    if w.budget.max_bytes is not None:
        sizes = sorted(m.memory_bytes for m in w.models.values())
        slots = min(slots, max(1, sum(1 for k in range(len(sizes)) if sum(sizes[: k + 1]) <= w.budget.max_bytes)))
    switch_s = sum(loads) * (len(loads) - slots + 1) / len(loads) if slots < len(loads) else 0.0
    return switch_s / (1.0 - rho)


COSTS = {"load_cost_s": 0.05, "batch_cost_s": 0.002, "item_cost_s": 0.0002, "max_batch_size": 16, "max_delay_s": 0.005}


def scale_workload(
    models: int, rate: float, duration_s: float, seed: int, slots: int, workers: int = 1, *,
    costs: dict[str, float] | None = None, zipf: float = 1.1, warm: bool = True, max_wait_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The simulator's workload of a run (``zipf`` 0: every model equally popular; ``warm``: a
    host tier big enough for every model, as the worker's default is for these tiny models)."""
    c = COSTS if costs is None else costs
    names = [f"m{i}" for i in range(models)]
    # The worker's warm tier is the sleep handler's tenth of a load; the simulator's default is the same.
    spec: dict[str, Any] = {k: c[k] for k in ("load_cost_s", "batch_cost_s", "item_cost_s", "max_batch_size", "max_delay_s")}
    if max_wait_s is not None:
        spec["max_wait_s"] = max_wait_s
    arrivals: dict[str, Any] = {"kind": "poisson", "rate": rate, "duration_s": duration_s, "seed": seed}
    if zipf > 0:
        arrivals["zipf"] = zipf
    return {
        "models": {n: dict(spec) for n in names},
        "budget": {"max_models": slots},
        "workers": {"count": workers},
        "host": {"budget_bytes": 1 << 40 if warm else 0, "prefetch": False},
        "arrivals": arrivals,
    }


def sleep_sections(
    prefix: str, models: int, slots: int, replicas: int = 1, consumers: str = "on-demand", *,
    costs: dict[str, float] | None = None, warm: bool = True, max_wait_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The live config of :func:`scale_workload` (for :func:`bench.harness.write_config`):
    ``models`` models ``m0``... on the ``sleep`` handler, whose load and batch are sleeps of the
    workload's costs, ``slots`` resident at once."""
    c = COSTS if costs is None else costs
    worker: dict[str, Any] = {"max_resident_models": slots, "prefetch_weights": False}
    if not warm:
        worker["host_memory_budget_bytes"] = 0
    model: dict[str, Any] = {"handler": "sleep", "max_batch_size": int(c["max_batch_size"]), "max_delay_s": c["max_delay_s"]}
    if max_wait_s is not None:
        model["max_wait_s"] = max_wait_s
    costs_s = {k: c[k] for k in ("load_cost_s", "batch_cost_s", "item_cost_s")}
    return {
        "nats": {"prefix": prefix}, "streams": {"replicas": replicas, "consumers": consumers}, "worker": worker,
        "models": {f"m{i}": {**model, **costs_s, "options": dict(costs_s)} for i in range(models)},
    }  # fmt: skip
