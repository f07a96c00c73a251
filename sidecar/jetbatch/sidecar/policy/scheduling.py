"""Which model to serve next: the policies by name, pure decision logic with no I/O and no clock.

The live worker (sidecar.worker) and the simulator (sidecar.simulator) build a
:class:`SchedulerState` snapshot, pass the current time in, and carry out the returned decision.
"""

from __future__ import annotations

import sys
from typing import Any

from .base import PolicyBase
from .baselines import Exhaustive, Fifo, LongestBacklog, RoundRobin
from .cost_aware import CostAware
from .costs import BatchCost
from .types import Budget, Decision, Idle, Load, ModelState, Policy, SchedulerState, Serve, fits

__all__ = [
    "POLICIES",
    "RETIRED_OPTIONS",
    "BatchCost",
    "Budget",
    "CostAware",
    "Decision",
    "Exhaustive",
    "Fifo",
    "Idle",
    "Load",
    "LongestBacklog",
    "ModelState",
    "Policy",
    "PolicyBase",
    "RoundRobin",
    "SchedulerState",
    "Serve",
    "fits",
    "make_policy",
]

POLICIES: tuple[str, ...] = ("cost-aware", "cost-aware-lru", "exhaustive", "fifo", "round-robin", "longest-backlog")

# Options of the 0.2 cost-aware policy whose wait-bound rules the cycle-derived bound replaced.
RETIRED_OPTIONS = ("urgency", "hysteresis")
_warned: set[str] = set()


def make_policy(name: str, **options: Any) -> Policy:
    """Build a policy by name (see :data:`POLICIES`); options are the policy's keyword arguments."""
    if name in ("cost-aware", "cost-aware-lru"):
        for old in RETIRED_OPTIONS:
            if options.pop(old, None) is not None and old not in _warned:
                _warned.add(old)
                print(f"jetbatch: policy option {old!r} is retired and ignored (see docs/scheduler.md)", file=sys.stderr)
        if name == "cost-aware-lru":
            policy = CostAware(**{"eviction": "lru", **options})
            policy.name = "cost-aware-lru"
            return policy
        return CostAware(**options)
    classes: dict[str, Any] = {"exhaustive": Exhaustive, "fifo": Fifo, "round-robin": RoundRobin, "longest-backlog": LongestBacklog}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return classes[name](**options)  # type: ignore[no-any-return]
