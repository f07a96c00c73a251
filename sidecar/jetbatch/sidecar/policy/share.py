"""The cluster share: which part of a shared queue is this worker's to chase. Pure.

Three rules keep workers from fighting over models (docs/scaleout.md):

- **Only what the peers cannot drain.** A queue other workers serve counts, for a worker that
  does not hold the model, only for what they would not drain within the *join horizon*: our
  load time, and never less than :data:`MIN_JOIN_S`; and only when that is at least one batch
  (a failover test saw a worker make warm excursions onto a stalled peer's model for a
  remainder of one request, two loads each). A peer that clears the queue within a quarter
  second needs no second replica; joining would cost a load and, later, the reload of whatever made room.
  With cheap warm reloads (0.05 s) a horizon of one load time shrank the discount to a few
  requests, and two workers herded onto one model while the other waited.
- **A peer's queue is never overdue for us.** The serving peer visits it exhaustively and bounds
  its wait; its age is no reason for this worker to drop its own work and load the model. The
  part that is ours counts as fresh (age 0): it can still win a load when this worker has
  nothing better to do, never as "overdue". Otherwise, after an outage, two workers each found
  the other's model overdue and swapped in the same millisecond.
- A model resident here keeps its full backlog and age: we share its queue with the other
  replicas and serving it costs us no load.
- **A queue nobody holds has one first taker.** Every worker ranks the live workers the same way
  for each model (:func:`first_taker_rank`: a worker with room for it first, one that need evict
  nothing; then a warm copy; then a hash of the model and the worker, rendezvous hashing) and
  leaves the queue to the ones ranked before it for one load time each (:func:`deferred_until`).
  Room comes first: a busy first taker would swap its own model out for the queue while an idle
  worker waited its turn (three workers on three models ended with one holding nothing). Without it an arrival for such a model woke every idle worker,
  all decided to load it, and all but one paid a lost claim's round trip (the 4-worker cluster
  bench: 1017 claims for 561 loads); with it the warm copy is reused instead of a cold load
  elsewhere. A first taker that is busy or has better work only delays the queue by its step.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable

from .costs import BatchCost
from .types import Budget

__all__ = ["MIN_DEFER_STEP_S", "MIN_JOIN_S", "deferred_until", "drain_rps", "effective_backlog", "first_taker_rank", "has_room", "join_horizon_s", "shared_head"]

MIN_JOIN_S = 0.25
# The least a worker ranked after another waits for it to take a queue nobody holds.
MIN_DEFER_STEP_S = 0.05


def drain_rps(batch_cost: BatchCost, max_batch_size: int) -> float:
    """How many requests/s a worker holding a model drains: full batches back to back (what it
    advertises, and what its peers discount)."""
    return max_batch_size / max(batch_cost.seconds(max_batch_size), 1e-6)


def join_horizon_s(load_cost_s: float) -> float:
    """How long the peers' drain counts against a queue before this worker would join it."""
    return max(load_cost_s, MIN_JOIN_S)


def effective_backlog(backlog: int, served_drain_rps: float, horizon_s: float, *, resident_here: bool, min_share: int = 1) -> int:
    """Backlog left for this worker to justify a load: what the other replicas would not drain
    within ``horizon_s`` (see :func:`join_horizon_s`), and nothing unless that is at least
    ``min_share`` requests (the model's batch: joining a replica for less than one batch of work
    costs a load now and a reload of ours later, to save one batch time). A model resident here
    keeps its full backlog: we share its queue with the other replicas and serving it costs us
    no load."""
    if resident_here or served_drain_rps <= 0:
        return backlog
    left = backlog - served_drain_rps * horizon_s  # a float: the rate may be infinite (fully served)
    return int(left) if left >= max(min_share, 1) else 0


def shared_head(oldest_enqueued_at: float | None, now: float, served_drain_rps: float, *, resident_here: bool) -> float | None:
    """The enqueue time the policy sees for a queue's part that is ours: its own head, except
    for a model peers serve and we do not hold, which counts as just arrived (never overdue)."""
    if oldest_enqueued_at is None or resident_here or served_drain_rps <= 0:
        return oldest_enqueued_at
    return now


def _score(model: str, worker: str) -> bytes:
    # A stable hash (not Python's salted hash()): every worker process must rank alike.
    return hashlib.blake2b(f"{model}\0{worker}".encode(), digest_size=8).digest()


def first_taker_rank(
    model: str, me: str, peers: Iterable[str], *, has_warm: Callable[[str], bool], has_room: Callable[[str], bool] = lambda _: False
) -> int:
    """How many workers come before ``me`` to load ``model``, which none of them holds: workers
    with room for it (``has_room(worker)``: it would evict nothing) first, then those with a warm
    copy (``has_warm(worker)``), then by a hash of model and worker, so every worker computes the
    same order and each model has one first taker."""
    def key(worker: str) -> tuple[bool, bool, bytes]:
        return (not has_room(worker), not has_warm(worker), _score(model, worker))

    mine = key(me)
    return sum(1 for p in set(peers) if p != me and key(p) < mine)


def has_room(budget: Budget, resident: int, used_bytes: int, model_bytes: int) -> bool:
    """Whether a worker with ``resident`` models (``used_bytes`` on the device) can load one of
    ``model_bytes`` more without evicting any, within ``budget``."""
    if budget.max_models is not None and resident + 1 > budget.max_models:
        return False
    return budget.max_bytes is None or used_bytes + model_bytes <= budget.max_bytes


def deferred_until(rank: int, head_enqueued_at: float, load_cost_s: float) -> float:
    """Until when a worker of ``rank`` leaves a queue nobody holds to those before it: one load
    time (at least :data:`MIN_DEFER_STEP_S`) per worker ahead, from the queue's head."""
    return head_enqueued_at + rank * max(load_cost_s, MIN_DEFER_STEP_S)
