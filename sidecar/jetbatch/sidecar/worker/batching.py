"""Batch assembly: pull a model's queue until its batch window closes (see policy/window.py).

A batch's first fetch takes what is stored (or waits for the first arrival); while its window is
open, the batch grows by what the arrival events say is stored, each taken in one round trip,
and otherwise waits for the next arrival event or the window's close on a :class:`Wakeup`. No
pull request is held open across the close: nats-server ends a waiting request half a
millisecond or more after its expiry, rounded up to the next whole millisecond, so a window
closed by one ended about a millisecond late, and a lone request waited that too. The window's
timer aims before its close by what the batches it closed started late after it (the wake-up and
the hand-on: :class:`~jetbatch.sidecar.policy.CloseLead`), so a batch starts when it is due.
A request delivered after the fetch that asked for it gave up (on a loaded host, its answer read
after the fetch's wait ended) lands in the puller with no arrival event; the puller says so
(:meth:`Batcher.late`), and an open window takes it at once instead of at its close.

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
from ..policy import CloseLead, batch_line_first
from ..wakeup import Wakeup
from .counters import Counters
from .slots import Slot, ack_info, enqueued_at

__all__ = ["Batcher"]

log = logging.getLogger("jetbatch.worker")

# The first fetch of a batch when the count says requests are stored (and the longest a fetch of
# what is stored waits for the server's answer): they come back within a round trip, so waiting
# a whole poll interval (0.25 s) only idles the worker when a peer of the shared queue took them
# first (the 4-worker cluster bench lost a sixth of its serves so). Too short on a slow server is
# harmless: the worker asks the consumer before holding anything back.
_STORED_WAIT_S = 0.02
# A hold's pull request stays open this long past the close of the window its first request
# opens at the latest (the window's timer aims earlier, never later).
_HOLD_MARGIN_S = 0.001


class Batcher:
    def __init__(
        self,
        stopping: anyio.Event,
        *,
        poll_interval_s: float,
        on_trouble: Callable[[], None] | None = None,
        on_fetched: Callable[[Slot, int, int | None, bool, int | None, bool], None],
        counters: Counters | None = None,
        clock: Callable[[], float] = time.time,
        wakeup: Wakeup | None = None,
        filled: Callable[[Slot], bool] = lambda slot: False,
        computing: Callable[[str], int] = lambda model: 0,
    ) -> None:
        """``clock``: wall-clock seconds (the stream's timestamps are on the same scale);
        ``wakeup``: what an open window waits on, woken by :meth:`arrived`. Tests pass fakes.
        ``filled``: whether a slot's interactive line is not listened to while its batches are
        served (``policy/interest.py``): its open windows fill from a held pull instead.
        ``computing``: a model's batches that may still run it (the core's count)."""
        self._filled = filled
        self._computing = computing
        self._stopping = stopping
        self.poll_interval_s = poll_interval_s
        self._on_trouble = on_trouble
        # Told of every fetch that got messages (n, what the consumer said was left, whether from
        # the batch line, and the stream sequence of the last one, which the consumer's count is
        # as of): the queue view's count and head follow (sidecar/worker/queues.py).
        self._on_fetched = on_fetched
        self._clock = clock
        self._counters = Counters() if counters is None else counters
        self._wakeup = Wakeup() if wakeup is None else wakeup
        # The slot whose open window waits, and its arrivals counted when the wait began.
        self._waiting: tuple[Slot, int] | None = None
        # How early a window's timer aims before its close (policy/window.py), learnt from when
        # the batches it closed started (:meth:`started`); the time the last one aimed at.
        self._lead = CloseLead()
        self._aimed_at: float | None = None
        # The messages of the windows open now, by the list's identity: delivered and ours, so the
        # worker's heartbeat keeps them (a window outlasts a short ack wait while the device is busy).
        self._open: dict[int, list[Msg]] = {}

    def holding(self) -> list[Msg]:
        """The messages gathered into windows still open (not yet handed to a batch)."""
        return [m for msgs in list(self._open.values()) for m in msgs]

    def started(self) -> None:
        """The batch gathered last starts now (the worker hands it on): when its window closed on
        its timer, how late after the time aimed at teaches the lead of later windows."""
        if self._aimed_at is not None:
            self._lead.note(self._clock() - self._aimed_at)
            self._aimed_at = None

    def arrived(self) -> None:
        """An arrival event was counted (any model's): an open window waiting on this model's
        count looks again. Other models' arrivals leave it waiting."""
        if self._waiting is not None and self._waiting[0].arrivals > self._waiting[1]:
            self._wakeup.wake()

    def late(self, slot: Slot) -> None:
        """A request was delivered to one of ``slot``'s pullers while no fetch waited (the fetch
        that asked for it gave up before the server's answer was read: a loaded host). No
        arrival event will say so: an open window of ``slot`` waiting on those events takes it
        now, not at its close (a minute, for a long ``max_delay``)."""
        if self._waiting is not None and self._waiting[0] is slot:
            self._wakeup.wake()

    async def fetch(
        self,
        slot: Slot,
        n: int,
        timeout_s: float,
        *,
        bulk_first: bool | None = None,
        stored_only: bool = False,
        linger: int | None = None,
        hold_open_s: float | None = None,
    ) -> list[Msg]:
        """Up to ``n`` messages of ``slot``'s queue within ``timeout_s``; [] on any failure. The
        interactive line first; the batch line when the count says batch requests wait (first
        when ``bulk_first``, by default when no interactive one waits), topped up from the other
        line without waiting long. ``stored_only``: what is stored now, waiting for no arrival;
        ``linger``: when nothing is stored, return once that many came; ``hold_open_s``: the
        interactive line by one request open that long (``Puller.fetch``)."""
        if timeout_s < 0.001 or n <= 0 or slot.psub is None:
            return []
        lines = [False]
        if slot.bulk_psub is not None and (slot.bulk > 0 or slot.bulk_psub.buffered):
            first = slot.interactive == 0 if bulk_first is None else bulk_first
            lines = [True, False] if first else [False, True]
        msgs = await self._pull(slot, lines[0], n, timeout_s, stored_only, linger, hold_open_s=None if lines[0] else hold_open_s)
        if len(lines) > 1 and len(msgs) < n and not self._stopping.is_set():
            # What is stored there comes within a round trip; later arrivals on their events. A
            # pull that waited for the rest of the batch held the batch (and a request arriving
            # on that line meanwhile) to the end of its wait, 20 ms.
            counted = slot.arrivals
            more = await self._pull(slot, lines[1], n - len(msgs), min(timeout_s, _STORED_WAIT_S), stored_only=True)
            if not more and lines[1] and slot.arrivals == counted:
                # Nothing to deliver on the batch line: stop counting it until the next count (or
                # every later fetch would look there). Not when an arrival was counted meanwhile:
                # it may be one stored on that line after the pull was answered.
                self._on_fetched(slot, 0, 0, True, None, False)
            msgs += more
        return msgs

    async def _pull(
        self,
        slot: Slot,
        bulk: bool,
        n: int,
        timeout_s: float,
        stored_only: bool = False,
        linger: int | None = None,
        fill: bool = False,
        *,
        hold_open_s: float | None = None,
    ) -> list[Msg]:
        started = self._clock()
        self._counters.add("fetches")
        psub = slot.bulk_psub if bulk else slot.psub
        pulled = await pull(psub, n, timeout_s, stored_only=stored_only, linger=linger, fill=fill, hold_open_s=hold_open_s)
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
            info = ack_info(msgs[-1])
            pending = None if info is None else info.pending
            redelivered = info is not None and info.delivered > 1
            self._on_fetched(slot, len(msgs), pending, bulk, None if info is None else info.stream_seq, redelivered)
        return msgs

    async def gather(self, slot: Slot, max_items: int, first: list[Msg] | None = None, *, compute_s: float = 0.0, hold_s: float | None = None) -> list[Msg]:
        """Pull until the window closes: ``max_items``, or ``max_delay`` after the first request
        of the batch was enqueued. While a batch of this model still runs, keep filling; once the
        window has closed, still take what the queue reported waiting, up to ``max_items``.
        The window also closes when the earliest deadline among the gathered requests leaves
        only ``compute_s`` (the batch's estimated time): waiting longer would make it late.
        ``hold_s``: a hold (policy/interest.py): the first request is waited for this long, on
        one pull request for the whole batch that stays open through the window it opens, so
        that the window's fill sends no request of its own."""
        msgs: list[Msg] = list(first or [])
        self._open[id(msgs)] = msgs
        try:
            return await self._gather(slot, max_items, msgs, compute_s=compute_s, hold_s=hold_s)
        finally:
            del self._open[id(msgs)]

    async def _gather(self, slot: Slot, max_items: int, msgs: list[Msg], *, compute_s: float, hold_s: float | None) -> list[Msg]:
        window = slot.window
        # Which line this batch takes first (policy/window.py: one batch in BATCH_LINE_EVERY goes
        # to the batch line while both wait, so interactive traffic cannot starve it).
        both = slot.bulk_psub is not None and slot.bulk > 0 and slot.interactive > 0
        bulk_first = batch_line_first(slot.interactive, slot.bulk if slot.bulk_psub is not None else 0, slot.interactive_run)
        if both:
            slot.interactive_run = 0 if bulk_first else slot.interactive_run + 1
        close_at: float | None = None
        lead_s = self._lead.lead_s(window)
        self._aimed_at = None
        opened_at: float | None = None  # when the batch's first request was enqueued (or seen)
        due: float | None = None  # the earliest deadline gathered
        # The arrivals counted when a fetch for what the count said was stored found nothing (a
        # peer took them, or their events came after the fetch that took them): fetch again only
        # after another arrival.
        found_short: int | None = None

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
        # Whether the last wait ran to the time aimed at, with the device free: a close then is
        # on the timer, and when its batch starts measures the lead (not after a fetch's round
        # trip, nor a recheck while the device was busy).
        on_timer = False
        first_wait_s = hold_s
        if first_wait_s is None:
            first_wait_s = min(self.poll_interval_s, 0.5)
            if slot.backlog > 0:
                first_wait_s = min(first_wait_s, _STORED_WAIT_S)
        while len(msgs) < max_items and not self._stopping.is_set():
            now = self._clock()
            busy = self._computing(slot.name) >= slot.config.max_concurrent_batches  # answers being stored need no device
            # Aimed before the close by the lead, so that the batch starts when the window is due.
            aim = close_at - lead_s if close_at is not None else None
            wait_s = window.wait_s(len(msgs), aim, now, device_busy=busy, idle_wait_s=first_wait_s)
            if not msgs:
                # What is stored, or else the first arrival: the window opens with it, and later
                # ones come on their events. Waiting here for a whole batch held the first request
                # to this wait's end (20 ms after a count ahead of the queue).
                on_timer = False
                # A hold's request stays open through the window its first request opens, so
                # that window's fill needs no request of its own (Puller.fill).
                hold_open_s = None if hold_s is None else hold_s + window.max_delay_s + _HOLD_MARGIN_S
                got = await self.fetch(slot, max_items, max(wait_s, 0.001), bulk_first=bulk_first, linger=1, hold_open_s=hold_open_s)
                if not got:
                    break  # nothing came within the first wait: the queue is empty for now
            elif (slot.backlog > 0 and (found_short is None or slot.arrivals > found_short)) or _buffered(slot):
                # Stored, by the count: one round trip brings them, window open or just closed (a
                # fetch that came back short, on a loaded host or a pull split by the server, is
                # topped up so). Nothing is held open for later arrivals: their events wake us.
                # Or delivered to our pullers after their fetch gave up (``late``): ours already,
                # in no count, and the fetch hands them out first.
                counted = slot.arrivals  # before the fetch: one counted during it may be after its answer
                on_timer = False
                wanted = min(max_items - len(msgs), max(slot.backlog, _buffered(slot)))
                got = await self.fetch(slot, wanted, _STORED_WAIT_S, bulk_first=bulk_first, stored_only=True)
                if not got:
                    if wait_s <= 0:
                        break  # closed, and what the count said was stored went elsewhere
                    found_short = counted
                    continue
            elif wait_s <= 0:
                if on_timer:
                    self._aimed_at = aim
                break
            elif not bulk_first and self._filled(slot):
                # The line's arrivals are not listened to (policy/interest.py): a pull held open
                # to the close delivers each as it is stored (Puller.fill, ended on the puller's
                # own clock; what it delivers after the close is the next fetch's). Its request
                # stays open a window past the close, as the worker serves this line's batches
                # back to back: the next hold and window take what it has still to bring, and it
                # ends filled, not on its expiry (a 408 a batch, and a request a hold).
                started = self._clock()
                got = await self._pull(slot, False, max_items - len(msgs), wait_s, fill=True, hold_open_s=wait_s + window.max_delay_s + _HOLD_MARGIN_S)
                on_timer = not busy
                if not got:
                    rest_s = wait_s - (self._clock() - started)
                    if rest_s > 0.0005:
                        on_timer = not await self._wakeup.wait(rest_s) and not busy  # the request ended early: no spin
                    continue
            else:
                # Nothing stored that we know of: wait for an arrival event or the close (while
                # the device is busy, a recheck: the batch fills until it is free).
                self._waiting = (slot, slot.arrivals)
                try:
                    on_timer = not await self._wakeup.wait(wait_s) and not busy
                finally:
                    self._waiting = None
                continue
            msgs.extend(got)
            reclose(got, self._clock())
        return msgs

    async def gather_before(self, slot: Slot, max_items: int, before: float) -> list[Msg]:
        """Arrival-order batching (the fifo baseline): pull one at a time while requests are
        older than ``before``; the first newer one goes back to the queue for a later batch."""
        msgs: list[Msg] = []
        self._aimed_at = None  # no window timer here
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


def _buffered(slot: Slot) -> int:
    """Requests delivered to ``slot``'s pullers that no fetch has handed out (:meth:`Batcher.late`):
    a fetch returns them at once (0 without an interactive puller, which :meth:`Batcher.fetch`
    needs: a window must not loop on fetches that cannot hand them out)."""
    if slot.psub is None:
        return 0
    return slot.psub.buffered + (slot.bulk_psub.buffered if slot.bulk_psub is not None else 0)


def _deadline(msg: Msg) -> float | None:
    """A request's deadline (None when absent or malformed: that request is refused anyway)."""
    try:
        return deadline_from_headers(msg.headers)
    except (ProtocolError, AttributeError):
        return None
