"""What a worker core asks its executor to do. Each is carried out as it says, by the live worker
with NATS and torch, by the simulator with its clock and cost model; neither decides anything
about it. Tagged msgspec Structs, recorded beside the events that produced them."""

from __future__ import annotations

from typing import Union

import msgspec

__all__ = ["Action", "Fetch", "Hold", "LoadModel", "Proceed", "Reap", "Recount", "Sleep", "Unload", "WaitFree", "WaitRoom"]


class Unload(msgspec.Struct, tag="unload", frozen=True, forbid_unknown_fields=True):
    """Evict ``models`` (idle past their limit), then turn again."""

    models: list[str]


class Hold(msgspec.Struct, tag="hold", frozen=True, forbid_unknown_fields=True):
    """Hold ``model``'s next batch open for up to ``hold_s`` on a pull of its interactive line: its
    first request opens the window with no decision between (``policy/interest.py``). Any
    arrival the worker hears ends it; report the batch (or none) with ``Fetched(held=True)``."""

    model: str
    max_items: int
    hold_s: float


class Recount(msgspec.Struct, tag="recount", frozen=True, forbid_unknown_fields=True):
    """Listen to ``model``'s interactive line again and count it, then turn again: the decision was
    made on a count that line's held pulls kept low."""

    model: str


class WaitFree(msgspec.Struct, tag="wait_free", frozen=True, forbid_unknown_fields=True):
    """Wait until ``models`` compute no more, then turn again (a load decided while a victim's
    batch still computes is decided once more with what arrived meanwhile counted)."""

    models: list[str]


class WaitRoom(msgspec.Struct, tag="wait_room", frozen=True, forbid_unknown_fields=True):
    """Wait until one of ``model``'s batches computes or is settled, then turn again: the model
    has as many batches under way as its pipeline bound allows (``policy.pipeline_has_room``)."""

    model: str


class Fetch(msgspec.Struct, tag="fetch", frozen=True, forbid_unknown_fields=True):
    """Gather and run one batch of ``model``: up to ``max_items``, its window by the model's rule,
    ending at the first request enqueued at or after ``before`` when given."""

    model: str
    max_items: int
    reason: str
    before: float | None = None


class LoadModel(msgspec.Struct, tag="load", frozen=True, forbid_unknown_fields=True):
    """Evict ``evict`` (in order) and load ``model``; tell ``LoadDue`` first (the core may answer
    that nobody would wait for it), then ``Loaded`` and each ``Evicted``."""

    model: str
    evict: list[str]
    reason: str


class Sleep(msgspec.Struct, tag="sleep", frozen=True, forbid_unknown_fields=True):
    """Nothing to do until ``until`` (None: until something happens): an arrival, a cancel notice,
    a batch or load done, or the executor's own timers wake it sooner."""

    until: float | None
    reason: str = "idle"


class Reap(msgspec.Struct, tag="reap", frozen=True, forbid_unknown_fields=True):
    """Do not load: answer ``model``'s queue without it (cancelled, or deadline_exceeded for each
    deadline within ``horizon_s``); what is still wanted goes back to the queue."""

    model: str
    horizon_s: float


class Proceed(msgspec.Struct, tag="proceed", frozen=True, forbid_unknown_fields=True):
    """Go on with the load."""


Action = Union[Unload, Hold, Recount, WaitFree, WaitRoom, Fetch, LoadModel, Sleep, Reap, Proceed]
