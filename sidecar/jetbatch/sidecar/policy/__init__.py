"""The pure policy core: every decision the worker makes, with no I/O and no clock (time is
passed in), so the live worker and the simulator drive the same code.

- :mod:`.driver`: one worker's decisions and what each event counts (owns its policy and estimator).
- :mod:`.scheduling`: which model to serve, load or evict next.
- :mod:`.window`: when a gathered batch closes.
- :mod:`.interest`: whether a worker listens to the arrivals of a line of the model it drains.
- :mod:`.costs`: what loads (per memory tier), batches and memory cost, learned from measurements.
- :mod:`.share`: which part of a queue shared with other workers is ours to chase.
- :mod:`.visible`: which models a decision looks at (all of a few dozen; the active ones of thousands).
"""

from .costs import BatchCost, CostEstimator, Tier, fits_host, prefetch_choice, warm_copy_value
from .driver import Driver, QueueFacts, reload_tier
from .interest import HOLD_S, LISTEN_BELOW_BATCHES, MIN_HOLD_S, QUIET_FROM_BATCHES, SERVING_AGAIN_FROM, SERVING_FROM, hold_s, listens, serves_on
from .scheduling import (
    POLICIES,
    Budget,
    Decision,
    Idle,
    Load,
    ModelState,
    Policy,
    SchedulerState,
    Serve,
    fits,
    make_policy,
)
from .share import MIN_DEFER_STEP_S, MIN_JOIN_S, deferred_until, drain_rps, effective_backlog, first_taker_rank, has_room, join_horizon_s, shared_head
from .visible import RECENT_S, visible_models
from .window import (
    ANSWERING_BATCHES,
    BATCH_LINE_EVERY,
    MAX_CLOSE_LEAD_S,
    PROBE_AFTER_REFUSALS,
    BatchWindow,
    CloseLead,
    batch_line_first,
    cannot_finish,
    pipeline_has_room,
)

__all__ = [
    "ANSWERING_BATCHES",
    "HOLD_S",
    "LISTEN_BELOW_BATCHES",
    "MIN_HOLD_S",
    "MAX_CLOSE_LEAD_S",
    "MIN_DEFER_STEP_S",
    "MIN_JOIN_S",
    "POLICIES",
    "PROBE_AFTER_REFUSALS",
    "QUIET_FROM_BATCHES",
    "SERVING_AGAIN_FROM",
    "SERVING_FROM",
    "BATCH_LINE_EVERY",
    "RECENT_S",
    "BatchCost",
    "BatchWindow",
    "CloseLead",
    "Budget",
    "CostEstimator",
    "Decision",
    "Driver",
    "Idle",
    "Load",
    "ModelState",
    "QueueFacts",
    "Policy",
    "SchedulerState",
    "Serve",
    "Tier",
    "cannot_finish",
    "pipeline_has_room",
    "batch_line_first",
    "deferred_until",
    "drain_rps",
    "effective_backlog",
    "first_taker_rank",
    "has_room",
    "join_horizon_s",
    "hold_s",
    "listens",
    "serves_on",
    "shared_head",
    "fits",
    "make_policy",
    "reload_tier",
    "visible_models",
    "fits_host",
    "prefetch_choice",
    "warm_copy_value",
]
