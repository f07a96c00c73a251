"""The batch window: when a gathered batch closes. Pure: times are passed in.

A batch closes when it holds ``max_batch_size`` requests, or ``max_delay_s`` after its first
request was *enqueued* (a request that already waited that long in the queue does not wait
again), or when its earliest deadline leaves no more time to wait, whichever comes first. While
the device is still busy with the previous batch, the next one keeps filling instead of closing
small: it could not start earlier anyway.

A request that could not finish before its deadline even if its batch started now (given the
estimated batch time) is answered ``deadline_exceeded`` instead of computed: the device time goes
to requests someone still waits for. The estimate is capped by the fastest batch seen, and after
``PROBE_AFTER_REFUSALS`` batches in a row refused whole on a prediction the next one is computed
anyway: a refused batch measures nothing, so an inflated estimate must not lock a model out.

A window's timer aims before its close by the lead the worker measured (:class:`CloseLead`): the
time from a close's timer to the batch's start (the timer's wake on the event loop, the end of the
gather, the batch handed on), about 0.2 ms on a two-core host. So a batch *starts* when its window
is due, as the simulator starts it, instead of that much later: a lone request waits
``max_delay_s`` for company, not ``max_delay_s`` and the wake-up.

Batches of a model pipeline: the next one is gathered while one computes, and computes while
earlier ones' answers are still being stored (a round trip to the server that needs no device):
a new batch is gathered while at most ``max_concurrent + ANSWERING_BATCHES`` are in flight, so
each model holds a bounded number of batches (their requests unacked).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

# After this many batches in a row refused whole on a predicted time, compute the next one.
PROBE_AFTER_REFUSALS = 8
# Within a model, interactive requests go first, but of every this many batches formed while
# both lines wait, one takes the batch line first: a model whose interactive traffic alone keeps
# it busy still serves its batch class (at least 1/8 of its batches), as the bound promises.
BATCH_LINE_EVERY = 8
# Batches of one model beyond the computing ones that may be in flight (mostly storing answers)
# while a later one is gathered.
ANSWERING_BATCHES = 2
# The close's lead is the median of this many recent lateness samples (a stall or two move it
# not at all), and never more than MAX_CLOSE_LEAD_S nor CLOSE_LEAD_SHARE of a window: a lead
# learnt on a stalled host must not cut every window short.
CLOSE_LEAD_SAMPLES = 31
MAX_CLOSE_LEAD_S = 0.0005
CLOSE_LEAD_SHARE = 0.25

__all__ = [
    "ANSWERING_BATCHES", "BATCH_LINE_EVERY", "CLOSE_LEAD_SAMPLES", "CLOSE_LEAD_SHARE", "MAX_CLOSE_LEAD_S", "PROBE_AFTER_REFUSALS",
    "BatchWindow", "CloseLead", "batch_line_first", "cannot_finish", "pipeline_has_room",
]  # fmt: skip


def pipeline_has_room(in_flight: int, computing: int, max_concurrent: int) -> bool:
    """Whether a model's next batch may be gathered, given its batches ``in_flight`` (gathered
    and not yet answered and settled) and, of those, the ones ``computing`` (gathered and still
    needing the model): while no more than the ``max_concurrent`` the model may run at once still
    need it, and no more than ``ANSWERING_BATCHES`` beyond those are storing answers. So a
    model has at most ``max_concurrent + ANSWERING_BATCHES + 1`` batches in flight."""
    return computing <= max_concurrent and in_flight <= max_concurrent + ANSWERING_BATCHES


def batch_line_first(interactive_waiting: int, batch_waiting: int, interactive_run: int) -> bool:
    """Whether the next batch of a model takes its batch line first: when only batch requests
    wait, or when ``interactive_run`` batches in a row went interactive first while both waited."""
    if batch_waiting <= 0:
        return False
    return interactive_waiting <= 0 or interactive_run >= BATCH_LINE_EVERY - 1


@dataclass(frozen=True)
class BatchWindow:
    max_batch_size: int
    max_delay_s: float

    def close_at(self, first_enqueued_at: float, first_seen_at: float, earliest_deadline: float | None = None) -> float:
        """When the batch whose first request was enqueued at ``first_enqueued_at`` (and fetched
        at ``first_seen_at``) must close."""
        close = min(first_enqueued_at, first_seen_at) + self.max_delay_s
        if earliest_deadline is not None:
            close = min(close, earliest_deadline)
        return close

    def is_full(self, count: int) -> bool:
        return count >= self.max_batch_size

    def should_close(self, count: int, close_at: float | None, now: float, *, device_busy: bool = False) -> bool:
        """Whether a batch of ``count`` requests closes now."""
        if count <= 0:
            return False
        if self.is_full(count):
            return True
        if device_busy:
            return False
        return close_at is not None and now >= close_at

    def wait_s(self, count: int, close_at: float | None, now: float, *, device_busy: bool = False, idle_wait_s: float = 0.25) -> float:
        """How long to wait for more requests before deciding again (0: close now)."""
        if count == 0:
            return idle_wait_s
        if self.should_close(count, close_at, now, device_busy=device_busy):
            return 0.0
        if device_busy:
            return max(0.005, (close_at - now) if close_at is not None else 0.005)
        return max(0.0, (close_at - now) if close_at is not None else idle_wait_s)


class CloseLead:
    """How much earlier than its close a window's timer aims: what batches closed on the timer
    started after the time aimed at, the median of the last :data:`CLOSE_LEAD_SAMPLES`, capped
    (:data:`MAX_CLOSE_LEAD_S`, and :data:`CLOSE_LEAD_SHARE` of the window). Pure: the lateness
    is measured by the caller. Starts at no lead."""

    def __init__(self) -> None:
        self._late_s: deque[float] = deque(maxlen=CLOSE_LEAD_SAMPLES)
        self._median_s = 0.0

    def note(self, late_s: float) -> None:
        """A batch closed on its timer started ``late_s`` after the time its timer aimed at."""
        if not math.isfinite(late_s):
            return  # measures nothing (and a NaN would make every later window's wait NaN)
        # A sample beyond the cap counts as the cap: the median cannot exceed it anyway, and a
        # clock stepped back must not count as a start before the aim.
        self._late_s.append(min(max(late_s, 0.0), MAX_CLOSE_LEAD_S))
        self._median_s = statistics.median(self._late_s)

    def lead_s(self, window: BatchWindow) -> float:
        """How early ``window``'s timer aims before its close."""
        return min(self._median_s, MAX_CLOSE_LEAD_S, CLOSE_LEAD_SHARE * window.max_delay_s)


def cannot_finish(deadline: float | None, now: float, predicted_s: float) -> bool:
    """Whether a request due at ``deadline`` misses it even if its batch starts ``now`` and takes
    the predicted ``predicted_s`` seconds."""
    return deadline is not None and now + max(predicted_s, 0.0) > deadline
