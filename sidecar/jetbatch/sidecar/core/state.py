"""The schema of a worker core's own fields in its snapshot (``WorkerCore.export_state``).

The snapshot is JSON data: the core's fields (this schema), its policy's and its estimator's
(``policy/state.py``, which also says how a non-finite float is written). Reading one against the
schema is what lets a ring's dump be input like any other: a field of the wrong type is refused
with its path, and nothing in it can name code.
"""

from __future__ import annotations

import msgspec

__all__ = ["CoreFields"]


class CoreFields(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The core's own fields (``core/turns.py`` says what each is for)."""

    serving: str | None = None
    hold_missed: bool = False
    current: str | None = None
    last_used: dict[str, float] = {}
    resident_since: dict[str, float] = {}
    idle_wake: float = float("inf")
    revisit: bool = False
    load_share: dict[str, int] = {}
    refusals: dict[str, int] = {}
    reaps: dict[str, int] = {}
    forget_at: float = float("-inf")
    in_flight: dict[str, int] = {}
    computing: dict[str, int] = {}
    standing_back: dict[str, float] = {}
