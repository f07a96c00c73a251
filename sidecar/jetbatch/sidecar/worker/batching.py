"""Batch assembly: pull a model's queue until its batch window closes (see policy/window.py).

Fetches never raise: a timeout is an empty fetch, a reconnect in progress backs off briefly, a
connection closed for good asks the worker to stop.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import anyio
from nats.aio.msg import Msg

from jetbatch.sdk.protocol import ProtocolError, deadline_from_headers

from ..errors import TRANSPORT_ERRORS, pull
from ..policy import batch_line_first
from .counters import Counters
from .slots import Slot, enqueued_at, pending_after

__all__ = ["Batcher"]

log = logging.getLogger("jetbatch.worker")

# How late a fetch that times out returns, learnt as the worker runs (an exponentially weighted
# mean): about 0.3 ms on a quiet host, 1-2 ms on a loaded two-core VM.
_INITIAL_LATE_S = 0.001
_MAX_LATE_S = 0.05
_LATE_WEIGHT = 0.2
_TOP_UP_S = 0.002  # the shortest wait for requests the queue says are there
# The first fetch of a batch when the count says requests are stored: they come back within a
# round trip, so waiting a whole poll interval (0.25 s) only idles the worker when a peer of the
# shared queue took them first (the 4-worker cluster bench lost a sixth of its serves so). Too
# short on a slow server is harmless: the worker asks the consumer before holding anything back.
_STORED_WAIT_S = 0.02


class Batcher:
    def __init__(
        self,
        stopping: anyio.Event,
        *,
        poll_interval_s: float,
        on_trouble: Callable[[], None] | None = None,
        on_fetched: Callable[[Slot, int, int | None, bool], None] | None = None,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock``: wall-clock seconds (the stream's timestamps are on the same scale); tests
        pass a fake one."""
        self._stopping = stopping
        self.poll_interval_s = poll_interval_s
        self._on_trouble = on_trouble
        # Told of every fetch that got messages (n, what the consumer says is left, and whether
        # from the batch line): the queue view's count and head follow (sidecar/worker/queues.py).
        self._on_fetched = on_fetched
        self.late_s = _INITIAL_LATE_S
        self._clock = clock
        self._counters = Counters() if counters is None else counters

    async def fetch(self, slot: Slot, n: int, timeout_s: float, *, bulk_first: bool | None = None) -> list[Msg]:
        """Up to ``n`` messages of ``slot``'s queue within ``timeout_s``; [] on any failure. The
        interactive line first; the batch line when the count says batch requests wait (first
        when ``bulk_first``, by default when no interactive one waits), topped up from the other
        line without waiting long."""
        if timeout_s < 0.001 or n <= 0 or slot.psub is None:
            return []
        lines = [False]
        if slot.bulk_psub is not None and slot.bulk > 0:
            first = slot.interactive == 0 if bulk_first is None else bulk_first
            lines = [True, False] if first else [False, True]
        msgs = await self._pull(slot, lines[0], n, timeout_s)
        if len(lines) > 1 and len(msgs) < n and not self._stopping.is_set():
            # The count says requests are stored there: they come within a round trip.
            more = await self._pull(slot, lines[1], n - len(msgs), min(timeout_s, _STORED_WAIT_S))
            if not more and lines[1] and self._on_fetched is not None:
                # Nothing to deliver on the batch line: stop counting it until the next count (or
                # every later fetch would wait on it).
                self._on_fetched(slot, 0, 0, True)
            msgs += more
        return msgs

    async def _pull(self, slot: Slot, bulk: bool, n: int, timeout_s: float) -> list[Msg]:
        started = self._clock()
        pulled = await pull(slot.bulk_psub if bulk else slot.psub, n, timeout_s)
        if pulled.closed:
            self._stopping.set()
            return []
        if pulled.trouble is not None:
            # Typically a reconnect in progress: back off so the loop does not spin meanwhile.
            log.warning("fetch for %s failed: %r", slot.name, pulled.trouble)
            if self._on_trouble is not None:
                self._on_trouble()
            await anyio.sleep(0.1)
            return []
        msgs: list[Msg] = pulled.msgs
        if msgs:
            if enqueued_at(msgs[-1], started) < started:
                # Stored before the fetch began: its time is the fetch's own round trip.
                self._counters.sample("ready_fetch", self._clock() - started)
            pending = pending_after(msgs[-1])
            if self._on_fetched is not None:
                self._on_fetched(slot, len(msgs), pending, bulk)
            else:
                slot.backlog = max(0, slot.backlog - len(msgs)) if pending is None else pending
        return msgs

    async def gather(self, slot: Slot, max_items: int, first: list[Msg] | None = None, *, compute_s: float = 0.0) -> list[Msg]:
        """Pull until the window closes: ``max_items``, or ``max_delay`` after the first request
        of the batch was enqueued. While a batch of this model still runs, keep filling; once the
        window has closed, still take what the queue reported waiting, up to ``max_items``.
        The window also closes when the earliest deadline among the gathered requests leaves
        only ``compute_s`` (the batch's estimated time): waiting longer would make it late."""
        window = slot.window
        msgs: list[Msg] = list(first or [])
        # Which line this batch takes first (policy/window.py: one batch in BATCH_LINE_EVERY goes
        # to the batch line while both wait, so interactive traffic cannot starve it).
        both = slot.bulk_psub is not None and slot.bulk > 0 and slot.interactive > 0
        bulk_first = batch_line_first(slot.interactive, slot.bulk if slot.bulk_psub is not None else 0, slot.interactive_run)
        if both:
            slot.interactive_run = 0 if bulk_first else slot.interactive_run + 1
        close_at: float | None = None
        opened_at: float | None = None  # when the batch's first request was enqueued (or seen)
        due: float | None = None  # the earliest deadline gathered

        def reclose(got: list[Msg], now: float) -> None:
            nonlocal close_at, opened_at, due
            if opened_at is None:
                opened_at = enqueued_at(msgs[0], now)
            deadlines = [d for d in (_deadline(m) for m in got) if d is not None]
            if deadlines and (due is None or min(deadlines) < due):
                due = min(deadlines)
            close_at = window.close_at(opened_at, opened_at, due - compute_s if due is not None else None)

        if msgs:
            reclose(msgs, self._clock())
        first_wait_s = min(self.poll_interval_s, 0.5)
        if slot.backlog > 0:
            first_wait_s = min(first_wait_s, max(_STORED_WAIT_S, 4 * self.late_s))
        while len(msgs) < max_items and not self._stopping.is_set():
            now = self._clock()
            busy = slot.computing >= slot.config.max_concurrent_batches  # answers being stored need no device
            wait_s = window.wait_s(len(msgs), close_at, now, device_busy=busy, idle_wait_s=first_wait_s)
            # Never aim earlier than half the window (one stall must not close every batch at
            # once), and not while the device is busy: then the batch fills until it is free.
            early_s = 0.0 if busy else min(self.late_s, window.max_delay_s / 2)
            if msgs and wait_s <= early_s:
                # A fetch returns about ``late_s`` after its timeout (a probe, a pull request, the
                # server's expiry and the event loop's wake-ups): started with less than that
                # left it would end past the window, so the batch closes to new arrivals now.
                # Requests already queued need no window: a fetch that came back short (a loaded
                # host, a pull split by the server) is topped up from the backlog it reported.
                if slot.backlog <= 0:
                    break
                got = await self.fetch(slot, min(max_items - len(msgs), slot.backlog), min(max(2 * self.late_s, _TOP_UP_S), _MAX_LATE_S), bulk_first=bulk_first)
                if not got:
                    break  # another worker of the shared queue took them
                msgs.extend(got)
                reclose(got, self._clock())
                continue
            # With a batch open, aim the fetch early by what fetches overrun, so it ends at the window.
            timeout_s = max(wait_s - early_s, 0.001) if msgs else max(wait_s, 0.001)
            started = self._clock()
            got = await self.fetch(slot, max_items - len(msgs), timeout_s, bulk_first=bulk_first)
            if not got and msgs:
                overrun = min(max(self._clock() - started - timeout_s, 0.0), _MAX_LATE_S)
                self.late_s += _LATE_WEIGHT * (overrun - self.late_s)
            if not got:
                if not msgs:
                    break  # nothing came within the first wait: the queue is empty for now
                continue
            msgs.extend(got)
            reclose(got, self._clock())
        return msgs

    async def gather_before(self, slot: Slot, max_items: int, before: float) -> list[Msg]:
        """Arrival-order batching (the fifo baseline): pull one at a time while requests are
        older than ``before``; the first newer one goes back to the queue for a later batch."""
        msgs: list[Msg] = []
        while len(msgs) < max_items:
            got = await self.fetch(slot, 1, 0.05)
            if not got:
                break
            if enqueued_at(got[0], self._clock()) >= before and msgs:
                try:
                    await got[0].nak()
                except TRANSPORT_ERRORS:
                    pass  # redelivered after its ack wait instead
                break
            msgs.extend(got)
        return msgs


def _deadline(msg: Msg) -> float | None:
    """A request's deadline (None when absent or malformed: that request is refused anyway)."""
    try:
        return deadline_from_headers(msg.headers)
    except (ProtocolError, AttributeError):
        return None
