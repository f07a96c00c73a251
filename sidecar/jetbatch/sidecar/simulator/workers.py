"""A simulated worker: its core and what the simulator keeps to carry out the core's actions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core import Fetch, WorkerCore
from ..policy import CostEstimator, Driver, Policy

__all__ = ["SimWorker"]


@dataclass(eq=False)
class SimWorker:
    """One simulated worker: its core (``core.WorkerCore``: every rule it decides by) and what the
    executor keeps to carry out the core's actions (the device, the warm tier, holds)."""

    index: int
    core: WorkerCore
    resident: list[str] = field(default_factory=list)  # in load order
    warm: dict[str, float] = field(default_factory=dict)  # model -> when it became warm
    busy_until: float = 0.0
    loading: str | None = None
    fresh: set[str] = field(default_factory=set)
    prefetching: tuple[str, float] | None = None  # (model, ready at)
    answering: dict[str, list[float]] = field(default_factory=dict)  # model -> when its batches' answers are stored
    # The lines (model, batch line?) of the drained model whose arrivals it does not listen to
    # (policy/interest.py), with each one's count as of its last take: what it sees, as live.
    quiet: dict[tuple[str, bool], int] = field(default_factory=dict)
    # A hold of the served model's next batch under way (until when; core.Hold).
    holding_until: float = -math.inf
    hold_seen: int = 0  # the arrivals known when the hold began, or last looked at: later ones may end it
    hold_checked: float = -math.inf  # when the hold last looked: cancel notices since may end it
    # A batch whose window is open (the core's Fetch, and whether a hold began it): carried out
    # to its close before the next turn, as the live worker's gather is.
    gathering: tuple[Fetch, bool] | None = None
    served_by: dict[str, float] = field(default_factory=dict)  # what its peers drain per model, at its last turn
    serves: dict[str, None] | None = None  # the models it registers, in the workload's order (None: every one)

    def registers(self, name: str) -> bool:
        return self.serves is None or name in self.serves

    @property
    def id(self) -> str:
        return f"w{self.index}"

    @property
    def driver(self) -> Driver:
        return self.core.driver  # read: its demand and estimates, as the live worker reads them

    @property
    def policy(self) -> Policy:
        return self.core.driver.policy

    @property
    def costs(self) -> CostEstimator:
        return self.core.costs
