"""Each model's pull subscriptions in the worker: its interactive line's, and its batch line's
while batch requests are seen.

A line's durable consumer is made sure of on demand (and again after half the server's idle
limit, in case the server removed it meanwhile), its :class:`~jetbatch.sidecar.pulling.Puller`
started on first use. What a puller was delivered that no fetch took (a pull request answered
after its fetch returned) goes back to the queue (nak) whenever this worker stops fetching from
it: the model left the device, the batch line went quiet, or the worker stops. Left in a puller
nobody fetches from, a request would wait out its ack wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from jetbatch.sdk.protocol import Priority, Subjects

from ..config import StreamsConfig
from ..errors import TRANSPORT_ERRORS
from ..pulling import Puller
from ..replies import settle
from ..streams import StreamSetupError, ensure_model_consumer, model_consumer_name
from .counters import Counters
from .slots import Slot

__all__ = ["Pullers"]

log = logging.getLogger("jetbatch.worker")

# The longest a puller being given up waits for its open pull requests to end (a fill's ends
# about a millisecond after its window closed; the server's 408 comes within this): what they
# deliver meanwhile is handed back with the rest.
CLOSE_WAIT_S = 0.05


class Pullers:
    """The slots' pullers: :meth:`ready` before a fetch, :meth:`hand_back` when the worker stops
    fetching a model, :meth:`close` at a stop. ``on_late(slot)``: a delivery no fetch waited for
    (:class:`~jetbatch.sidecar.pulling.Puller`'s ``on_late``); ``on_uncounted(slot, bulk, msg)``:
    a delivery a count of the line missed (its ``on_uncounted``)."""

    def __init__(
        self, nc: Any, subjects: Subjects, streams: StreamsConfig, *, on_late: Callable[[Slot], None], counters: Counters,
        on_uncounted: Callable[[Slot, bool, Any], None] = lambda slot, bulk, msg: None,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._subjects = subjects
        self._streams = streams
        self._on_late = on_late
        self._on_uncounted = on_uncounted
        self._counters = counters
        self._retired = (0, 0, 0)  # the counts of pullers given up (requests, ends, forged)
        # The pullers made (for the counters and the stop), and the slots whose pullers may hold
        # deliveries (added as a puller's buffer fills, ``Puller``'s ``on_holding``): what a
        # count hands back walks these, not every registered model (24% of a 10 000-model
        # worker's samples did).
        self._pullers: dict[Puller, None] = {}
        self._holding: dict[str, Slot] = {}

    @staticmethod
    def made(slots: Iterable[Slot], now: float) -> None:
        """Both lines' consumers of ``slots`` were made at ``now`` (at start, with eager consumers)."""
        for slot in slots:
            slot.lines.consumer_ready_at = slot.lines.bulk_consumer_ready_at = now

    async def ready(self, slot: Slot) -> bool:
        """Make sure ``slot``'s consumers exist and this worker is subscribed to them: the
        interactive line's always, the batch line's while batch requests wait (``slot.bulk``);
        a batch line with none counted, whose consumer was last made sure of more than half
        the idle limit ago, loses its puller. False (logged) when the server did not answer:
        the caller backs off as for any trouble."""
        streams = self._streams
        async with slot.lines.lock:
            now = time.time()
            try:
                if self._stale(slot.lines.consumer_ready_at, now):
                    started = time.perf_counter()
                    await ensure_model_consumer(self._js, self._subjects, streams, slot.name)
                    self._counters.sample("consumer_create", time.perf_counter() - started)
                    slot.lines.consumer_ready_at = now
                if slot.psub is None:
                    slot.lines.psub = await self._puller(slot, Priority.INTERACTIVE)
                # The batch line's consumer: made while batch requests are seen (most models get
                # none); left to the server's idle removal once they stop.
                bulk_stale = self._stale(slot.lines.bulk_consumer_ready_at, now)
                if slot.bulk > 0:
                    if bulk_stale:
                        await ensure_model_consumer(self._js, self._subjects, streams, slot.name, Priority.BATCH)
                        slot.lines.bulk_consumer_ready_at = now
                    if slot.bulk_psub is None:
                        slot.lines.bulk_psub = await self._puller(slot, Priority.BATCH)
                elif slot.bulk_psub is not None and bulk_stale and not slot.bulk_psub.buffered:
                    # No batch request counted, and its consumer last made sure of half the idle
                    # limit ago: the line's puller goes (while it holds deliveries, the next fetch
                    # takes them first: it stays). What its requests still deliver while it goes
                    # goes back to the queue now (it used to wait out its ack wait: nobody
                    # fetches from a puller that is gone), even if a stop cancels this.
                    psub, slot.lines.bulk_psub, slot.lines.bulk_consumer_ready_at = slot.lines.bulk_psub, None, None
                    with anyio.CancelScope(shield=True):
                        await self._give_back(await psub.close(CLOSE_WAIT_S))
                    self._retire(psub)
            except (TRANSPORT_ERRORS + (StreamSetupError,)) as exc:
                log.warning("consumer for %s not ready: %s", slot.name, exc)
                return False
        return True

    async def hand_back(self, slots: Iterable[Slot]) -> None:
        """What ``slots``' pullers hold that no fetch took goes back to the queue, for whoever
        serves those models now."""
        for psub in _pullers_of(slots):
            if psub.buffered:
                await self._give_back(psub.leftovers())

    def holding(self) -> list[Slot]:
        """The slots whose pullers hold deliveries no fetch took: those whose buffer filled since
        the last call and still holds some (the rest are forgotten here until it fills again)."""
        for name in [n for n, slot in self._holding.items() if not any(p.buffered for p in _pullers_of((slot,)))]:
            del self._holding[name]
        return list(self._holding.values())

    async def close(self, slots: Iterable[Slot]) -> None:
        """At a stop: every puller unsubscribed, what it holds handed back (delivered to a fetch
        the stop cancelled)."""
        for psub in _pullers_of(slots):
            await self._give_back(await psub.close(CLOSE_WAIT_S))
            self._retire(psub)

    def note_holding(self, slot: Slot) -> None:
        """A puller of ``slot`` got a delivery into its empty buffer (its ``on_holding``)."""
        self._holding.setdefault(slot.name, slot)

    def counts(self) -> dict[str, int]:
        """The pull messages so far, for the status counters: requests sent (``pull_requests``)
        and requests ended by a status message (``pull_ends``), the worker's share of the
        messages it publishes and receives beyond its requests, answers and acks; and messages
        dropped from the pull inboxes because JetStream did not send them
        (``forged_deliveries``). A walk over the pullers made, not every registered model."""
        pullers = list(self._pullers)
        return {
            "pull_requests": self._retired[0] + sum(p.pulls for p in pullers),
            "pull_ends": self._retired[1] + sum(p.ends for p in pullers),
            "forged_deliveries": self._retired[2] + sum(p.forged for p in pullers),
        }

    def _retire(self, psub: Puller) -> None:
        """``psub`` was given up: its counts stay in the status counters."""
        if self._pullers.pop(psub, 0) is None:
            self._retired = (self._retired[0] + psub.pulls, self._retired[1] + psub.ends, self._retired[2] + psub.forged)

    def _stale(self, ready_at: float | None, now: float) -> bool:
        """Not made sure of yet, or (consumers made on demand) long enough ago that the server
        may have removed it as idle."""
        if ready_at is None:
            return True
        return self._streams.consumers == "on-demand" and now - ready_at > self._streams.consumer_idle_s / 2

    async def _puller(self, slot: Slot, priority: Priority) -> Puller:
        name = model_consumer_name(slot.name, priority)
        bulk = priority is Priority.BATCH
        puller = await Puller(
            self._nc, self._subjects.models_stream, name, on_late=lambda: self._on_late(slot),
            on_uncounted=lambda msg: self._on_uncounted(slot, bulk, msg), on_holding=lambda: self.note_holding(slot),
        ).start()  # fmt: skip
        self._pullers[puller] = None
        return puller

    async def _give_back(self, msgs: list[Any]) -> None:
        for msg in msgs:
            await settle(msg, "nak")
            self._counters.add("leftovers_handed_back")


def _pullers_of(slots: Iterable[Slot]) -> list[Puller]:
    """The pullers ``slots`` have (an interactive line's, a batch line's)."""
    return [p for slot in slots for p in (slot.psub, slot.bulk_psub) if p is not None]
