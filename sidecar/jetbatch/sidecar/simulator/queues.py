"""The simulator's model queues: two FIFO lines per model, interactive and batch, as the live
worker's two consumers per model (``<prefix>.model.<m>`` and ``<prefix>.model.<m>.batch``)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["Queue", "Request"]


@dataclass(eq=False)
class Request:
    id: int
    model: str
    arrival: float
    deadline: float | None
    interactive: bool = True
    cancel_at: float = math.inf  # when its caller cancels (the SDK's cancel notice), if ever
    tenant: str = ""
    excess: bool = False  # moved to the batch line beyond its tenant's fair share

    def gone(self, now: float) -> bool:
        return self.cancel_at <= now


class Queue:
    """One model's queue: two FIFO lines, interactive and batch, as the live worker's two
    consumers per model (``<prefix>.model.<m>`` and ``<prefix>.model.<m>.batch``). A batch takes
    the interactive line first."""

    __slots__ = ("urgent", "bulk", "run")

    def __init__(self) -> None:
        self.urgent: deque[Request] = deque()
        self.bulk: deque[Request] = deque()
        self.run = 0  # batches in a row that took the interactive line first while both waited

    def __len__(self) -> int:
        return len(self.urgent) + len(self.bulk)

    def __bool__(self) -> bool:
        return bool(self.urgent) or bool(self.bulk)

    def append(self, r: Request) -> None:
        (self.urgent if r.interactive else self.bulk).append(r)

    @property
    def head(self) -> Request:
        """The oldest waiting request (deadlines are arrival + a per-model constant: also the
        earliest deadline)."""
        if self.urgent and self.bulk:
            return self.urgent[0] if self.urgent[0].arrival <= self.bulk[0].arrival else self.bulk[0]
        return self.urgent[0] if self.urgent else self.bulk[0]

    @property
    def next(self) -> Request:
        return self.urgent[0] if self.urgent else self.bulk[0]

    def pop(self, bulk_first: bool = False) -> Request:
        if bulk_first and self.bulk:
            return self.bulk.popleft()
        return self.urgent.popleft() if self.urgent else self.bulk.popleft()

    def first(self, bulk_first: bool) -> Request:
        """The request a batch taking ``bulk_first`` (``policy.batch_line_first``) takes first."""
        return self.bulk[0] if bulk_first and self.bulk else self.next

    def count_batch(self, bulk_first: bool) -> None:
        """A batch formed while both lines waited went to one line first (the live rule's count)."""
        if self.urgent and self.bulk:
            self.run = 0 if bulk_first else self.run + 1

    def __iter__(self) -> Any:
        yield from self.urgent
        yield from self.bulk
