"""What a worker core is told: every fact the live worker or the simulator observes that a rule
of the core reads. Plain msgspec Structs, tagged, so a run's events are recorded as JSON lines
and fed to a fresh core as they were (``sidecar/recording.py``).

Times are the executor's clock in seconds (wall clock live, simulated time in the simulator);
the core never reads a clock of its own.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from ..policy import QueueFacts, Tier

__all__ = [
    "BatchChecked",
    "BatchDone",
    "ClaimLost",
    "Computed",
    "Event",
    "Evicted",
    "Fetched",
    "LoadDue",
    "Loaded",
    "ModelRules",
    "Settled",
    "Started",
    "Turn",
    "Warmed",
]


class ModelRules(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model's configuration as far as the core's rules read it, and the costs its estimator
    is seeded with before anything is measured."""

    max_batch_size: int
    load_cost_s: float
    batch_cost_s: float
    item_cost_s: float
    memory_bytes: int = 0
    idle_unload_s: float | None = None  # the model's own limit, else the worker's
    pin: bool = False
    max_concurrent_batches: int = 1


class Started(msgspec.Struct, tag="started", frozen=True, forbid_unknown_fields=True):
    """The core was made: its policy (by name, with options), its models and its device budget.
    A recording's first line; a replay makes its fresh core from it."""

    policy: str
    options: dict[str, Any]
    models: dict[str, ModelRules]
    max_bytes: int | None = None
    max_models: int | None = 1
    worker: str = ""


class Turn(msgspec.Struct, tag="turn", frozen=True, forbid_unknown_fields=True):
    """The worker is free to act: what it knows of the queues it shows the policy
    (``policy.visible_models``). Its batches under way the core counts itself (``Fetched``,
    ``Computed``, ``Settled``).

    ``defer_until``: when the first queue left to a peer's first take becomes ours too;
    ``arrival_order``: the waiting requests' models in arrival order (only ``fifo`` reads it)."""

    now: float
    facts: list[QueueFacts]
    defer_until: float | None = None
    arrival_order: list[str] | None = None


class Fetched(msgspec.Struct, tag="fetched", frozen=True, forbid_unknown_fields=True):
    """A batch of ``n`` requests of ``model`` was taken (its window closed); ``held``: it came from
    a hold (``n`` 0: the hold came back empty, or was cut short)."""

    model: str
    n: int
    held: bool = False


class Computed(msgspec.Struct, tag="computed", frozen=True, forbid_unknown_fields=True):
    """One of ``model``'s batches needs the model no more: its last forward pass ended, or it
    ran none (a load that evicts the model waits for this)."""

    model: str


class Settled(msgspec.Struct, tag="settled", frozen=True, forbid_unknown_fields=True):
    """One of ``model``'s batches is over: its answers stored and its requests settled (it leaves
    the model's pipeline; a model with none under way may be unloaded for idleness)."""

    model: str


class ClaimLost(msgspec.Struct, tag="claim_lost", frozen=True, forbid_unknown_fields=True):
    """A peer holds ``model``'s load claim (or held the model when this worker's view of its
    peers went stale): its queue counts as the peers' to serve until ``until``, when their adverts
    will have said what they hold (live: one heartbeat; simulated: the peer's load's end)."""

    model: str
    until: float


class BatchChecked(msgspec.Struct, tag="checked", frozen=True, forbid_unknown_fields=True):
    """A batch's deadline check ran: ``refused_whole`` when every request was refused on the
    predicted batch time (none computed)."""

    model: str
    refused_whole: bool


class BatchDone(msgspec.Struct, tag="batch_done", frozen=True, forbid_unknown_fields=True):
    """A batch of ``taken`` requests ended at ``now``; ``computed`` of them ran for ``seconds``,
    ``excess`` of those moved to the batch line beyond their tenant's fair share (docs/tenancy.md)."""

    model: str
    taken: int
    computed: int
    seconds: float
    now: float
    excess: int = 0


class LoadDue(msgspec.Struct, tag="load_due", frozen=True, forbid_unknown_fields=True):
    """A load of ``model`` (from ``tier``) is about to be paid: each waiting request's deadline and
    whether its caller cancelled (None: some waiting request is not known one by one);
    ``peer_serves``: a peer holds or loads the model."""

    model: str
    tier: Tier
    now: float
    waiting: list[tuple[float | None, bool]] | None
    peer_serves: bool = False


class Loaded(msgspec.Struct, tag="loaded", frozen=True, forbid_unknown_fields=True):
    """``model`` became resident at ``now`` from ``tier`` in ``seconds``; ``waiting``: its queue as
    counted then (the share the load owes is never more)."""

    model: str
    tier: Tier
    seconds: float
    now: float
    waiting: int
    memory_bytes: int = 0
    host_bytes: int = 0


class Evicted(msgspec.Struct, tag="evicted", frozen=True, forbid_unknown_fields=True):
    """``model`` left the device at ``now`` (to the warm tier or cold)."""

    model: str
    now: float


class Warmed(msgspec.Struct, tag="warmed", frozen=True, forbid_unknown_fields=True):
    """``model``'s weights were read into host memory ahead of a load (a prefetch)."""

    model: str
    host_bytes: int


Event = Union[Started, Turn, Fetched, Computed, Settled, BatchChecked, BatchDone, LoadDue, Loaded, Evicted, Warmed, ClaimLost]
