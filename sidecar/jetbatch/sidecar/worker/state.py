"""The worker loop's own I/O state, in one object the loop owns and hands to what reads it (the
report, the heartbeat, shutdown). What the worker decides by lives in its core (core/turns.py:
the served model, the last used times, the probe counters); per-model I/O state lives in each
:class:`~.slots.Slot`; queue depths in :class:`~.queues.QueueView`; what is on the device in
:class:`~.residency.Residency`; the peers in :class:`~.coordination.Coordinator`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from nats.aio.msg import Msg

__all__ = ["InFlight", "LoopState"]


class InFlight:
    """The messages this worker holds unacked (fetched, not yet settled), by identity: what the
    heartbeat keeps alive, what a stop naks, what the report counts per model."""

    def __init__(self) -> None:
        self._msgs: dict[int, Msg] = {}

    def add(self, msgs: Iterable[Msg]) -> None:
        for m in msgs:
            self._msgs[id(m)] = m

    def settled(self, msgs: Iterable[Msg]) -> int:
        """Forget ``msgs``; how many of them were still held (a batch's are settled in parts)."""
        return sum(self._msgs.pop(id(m), None) is not None for m in msgs)

    def messages(self) -> list[Msg]:
        return list(self._msgs.values())

    def clear(self) -> None:
        self._msgs.clear()

    def __bool__(self) -> bool:
        return bool(self._msgs)

    def __len__(self) -> int:
        return len(self._msgs)

    def by_model(self, model_of: Callable[[str], str | None]) -> dict[str, int]:
        """How many are held per model (``model_of`` reads a model from a message's subject)."""
        out: dict[str, int] = {}
        for m in self._msgs.values():
            name = model_of(m.subject) or ""
            out[name] = out.get(name, 0) + 1
        return out


@dataclass
class LoopState:
    """What the serving loop remembers between turns."""

    started_at: float
    next_refresh: float = -math.inf  # when the queues are counted next (wall clock)
    in_flight: InFlight = field(default_factory=InFlight)
    # Counts due whatever the schedule says (wall clock): requests that come back to a queue with
    # no arrival event (JetStream sends none for a redelivery) are found by a count.
    recounts: list[float] = field(default_factory=list)

    def count_at(self, *times: float) -> None:
        """Count the queues at each of ``times`` too, whatever the poll interval."""
        self.recounts = sorted([*self.recounts, *times])

    def next_count(self) -> float:
        """When the queues are counted next: the schedule's next count, or an earlier one due."""
        return min(self.next_refresh, self.recounts[0]) if self.recounts else self.next_refresh

    def counted(self, now: float) -> None:
        """A count was taken at ``now``: the counts due by then are done."""
        self.recounts = [t for t in self.recounts if t > now]
