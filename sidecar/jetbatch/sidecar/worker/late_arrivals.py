"""Refusing at arrival what the workers cannot reach before its deadline (docs/reliability.md,
"Backpressure").

Each caller's admission (``sdk/jetbatch/sdk/admission.py``) counts only its own requests between
two adverts, so N callers sending straight to one model could together queue about N times what
one would, and the requests beyond what the workers reach in time waited, unanswered, until their
callers timed out. The worker sees every arrival of the models it serves, from every producer,
in the stream's order, with its deadline. It applies the same rule to that one ordered feed: the
adverts' backlog, in flight and drain rate (the same subscription the classifier reads), plus
every arrival counted since the latest advert. A request whose wait ahead is more than
:data:`WORKER_ADMIT_FRACTION` of its remaining time is answered ``overloaded`` at once, on its
answer subject (stored by the results stream like any answer).

The answer is published with JetStream (stored, like every final answer), and once its PubAck
came the request is deleted from the models stream by the sequence its arrival event gave: it is
not counted, fetched or computed (left in the queue, it was computed about as often as not, a
wasted batch slot, and its second answer overwrote the stored one). The ack rule holds: a
request leaves the stream only once its answer is stored. When the answer or the delete fails,
the request stays queued and is settled when fetched, as before (answered ``deadline_exceeded``
if it is late by then; the caller ignores a second answer). A forged arrival event could name
another request's sequence, but only the stream publishes arrival events in the deployments
shipped (docs/security.md), and an identity that could forge one may call the stream's delete
API itself. Only protocol-3 requests (a reply key) of the interactive line are screened: a
protocol-2 reply subject is checked against the deployment's reply policy, which this feed does
not hold.

A worker that serves a model's batches stops listening to that line's arrivals (it counts it by
its fetches: ``policy/interest.py``), which is when an overload happens. While a line is quiet,
a subscription of this screen's own hears its arrivals (:meth:`follow`): screened, not counted,
no wake-up. That is one headers-only message a request again for the served line (what the
quiet line saved); the screen costs a header parse and a dict lookup each.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from jetbatch.sdk.admission import Admission, follow_adverts
from jetbatch.sdk.protocol import (
    ErrorCode,
    Headers,
    Priority,
    ProtocolError,
    ReplyPolicy,
    Subjects,
    parse_request_headers,
    validate_tenant,
)

from ..errors import TRANSPORT_ERRORS, unsubscribe_all
from ..replies import Answer
from .counters import Counters
from .stream_facts import parse_stream_sequence

__all__ = ["WORKER_ADMIT_FRACTION", "LateArrivals"]

log = logging.getLogger("jetbatch.worker")

# The worker's view is every producer's arrivals in order, so it leaves less room than a caller's
# (0.5), its own batch already taken off: the rest covers a drain slower than advertised and the
# answer's way back. At 0.8, 8 callers at 10x capacity still had 3 of 24 000 answered 5-25 ms late.
WORKER_ADMIT_FRACTION = 0.7
# Refusals whose answer and delete are under way at once, and as many waiting to start; beyond,
# an arrival is left to its fetch (settled then, as before this screen).
MAX_REFUSING = 256
_REFUSE_TIMEOUT_S = 2.0
_REFUSED_SEQS_KEPT = 1024
# Arrivals of a quiet line waiting for the screen; beyond, nats-py drops them (unscreened).
_PENDING_SCREENED = 65_536
_POLICY = ReplyPolicy()


class LateArrivals:
    """The adverts' view of each model's queue, fed every arrival this worker counts."""

    def __init__(
        self, nc: Any, subjects: Subjects, counters: Counters, batch_size: Callable[[str], int], fraction: float = WORKER_ADMIT_FRACTION,
        *, listen: Callable[[], Any] = lambda: None,
    ) -> None:
        self._nc = nc
        self._listen = listen  # the connection arrival events are read on (the feed's own), once open
        self._subjects = subjects
        self._counters = counters
        self._batch_size = batch_size  # a served model's max_batch_size: a request's own batch takes one
        self.admission = Admission(fraction=fraction)
        self._sub: Any = None
        self._follows: dict[str, Any] = {}  # model -> the subscription screening its quiet interactive line
        self._screened: dict[str, int] = {}  # model -> the last stream sequence screened
        self._refused_seqs: OrderedDict[int, None] = OrderedDict()  # the latest deleted ones, oldest first
        self._free_at: dict[str, float] = {}  # model -> when what this screen admitted is drained (monotonic)
        # Refusals to carry out (the answer, its reply key, the sequence to delete or None to
        # leave the request queued), by :meth:`run` in the worker's task group; opened by
        # :meth:`start`, closed by :meth:`stop`.
        self._to_refuse: MemoryObjectSendStream[tuple[Answer, str, int | None]] | None = None
        self._refusals: MemoryObjectReceiveStream[tuple[Answer, str, int | None]] | None = None
        self._running = False  # run took the receiving end (it closes it)

    async def start(self) -> None:
        """Follow the adverts (once). A worker not allowed to subscribe there gets a permissions
        error from the server, no view, and refuses nothing."""
        if self._to_refuse is None:
            self._to_refuse, self._refusals = anyio.create_memory_object_stream[tuple[Answer, str, int | None]](MAX_REFUSING)
        if self._sub is None and self._nc is not None:
            try:
                self._sub = await follow_adverts(self._nc, self._subjects, self.admission)
            except TRANSPORT_ERRORS as exc:
                log.warning("adverts not followed (no refusals at arrival): %r", exc)

    async def stop(self) -> None:
        await unsubscribe_all(self._sub, *self._follows.values())
        self._sub = None
        self._follows.clear()
        if self._to_refuse is not None:
            self._to_refuse.close()  # run's loop ends with what was sent before
            self._to_refuse = None
        if self._refusals is not None and not self._running:
            self._refusals.close()  # nobody runs the refusals (a feed used without its worker)
        self._refusals = None

    async def run(self) -> None:
        """Carry out the refusals :meth:`screen` decided, at most :data:`MAX_REFUSING` at once,
        until cancelled (the worker's task group, as it stops: a refusal cut short leaves its
        request queued, settled when fetched)."""
        # A semaphore, not a capacity limiter: this loop takes a slot and the refusal's own task
        # gives it back.
        refusals, limiter = self._refusals, anyio.Semaphore(MAX_REFUSING)
        if refusals is None:
            return  # never started
        self._running = True
        async with anyio.create_task_group() as tg, refusals:
            async for answer, reply_key, seq in refusals:
                await limiter.acquire()
                tg.start_soon(self._carry_out, answer, reply_key, seq, limiter)

    async def _carry_out(self, answer: Answer, reply_key: str, seq: int | None, limiter: anyio.Semaphore) -> None:
        try:
            with anyio.move_on_after(2 * _REFUSE_TIMEOUT_S):
                if seq is None:
                    await self._answer(answer, reply_key)
                else:
                    await self._refuse(answer, reply_key, seq)
        finally:
            limiter.release()

    async def follow(self, model: str) -> None:
        """Screen ``model``'s interactive arrivals on a subscription of our own (its line is quiet:
        the feed does not hear them). Best effort: refused, the line goes unscreened, as before."""
        events = self._listen()
        if model in self._follows or self._nc is None or events is None:
            return

        async def on_arrival(msg: Any) -> None:
            self.screen(model, msg.headers)

        try:
            subject = self._subjects.arrived(model, Priority.INTERACTIVE)
            self._follows[model] = await events.subscribe(subject, cb=on_arrival, pending_msgs_limit=_PENDING_SCREENED)
        except TRANSPORT_ERRORS + (ValueError,) as exc:
            log.debug("arrivals of %s not screened: %r", model, exc)

    async def unfollow(self, model: str) -> None:
        """The feed hears ``model``'s interactive arrivals again (and screens them itself)."""
        sub = self._follows.pop(model, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except TRANSPORT_ERRORS + (ValueError,) as exc:
                log.debug("screen of %s: unsubscribe failed: %r", model, exc)

    def refusal(
        self, model: str, headers: Mapping[str, str] | None, now: float | None = None, mono: float | None = None
    ) -> Answer | None:
        """The ``overloaded`` answer of an arrival of ``model`` that its workers cannot reach in
        time, or None to let it wait (then counted ahead of the next). The wait ahead is the
        larger of the adverts' estimate and what this screen admitted, less what was drained
        since. Unscreened, and not counted: no deadline, already past it, a header problem, no
        reply key, no drain rate advertised. ``now``: Unix seconds; ``mono``: monotonic."""
        headers = headers or {}
        tenant = headers.get(Headers.TENANT)
        try:
            if tenant is not None:
                validate_tenant(tenant)
        except ProtocolError:
            return None
        meta = parse_request_headers(headers, policy=_POLICY, tenant=tenant)
        if meta.problem is not None or meta.reply_key is None or meta.deadline is None:
            return None
        remaining_s = meta.deadline - (time.time() if now is None else now)
        if remaining_s <= 0:
            return None  # answered deadline_exceeded when fetched, as before
        drain = self.admission.drain_rps(model)
        if drain <= 0:
            return None  # nobody drains it yet: a load will come (the adverts' rule, too)
        # Its own batch ends one batch time after it starts: the wait ahead gets what is left.
        budget_s = remaining_s - self._batch_size(model) / drain
        if budget_s <= 0:
            # Its own batch alone would not end in time: no queue makes it late. The deadline
            # check before compute answers it deadline_exceeded, as it did before this screen.
            return None
        clock = time.monotonic() if mono is None else mono
        # What this screen admitted itself, drained at the advertised rate since: a fresh advert
        # does not forget it (the adverts' rule does), since a worker serving the model counts
        # its line by its last fetch, a batch time behind the arrivals it admitted.
        ahead_s = max(self._free_at.get(model, clock) - clock, 0.0)
        if ahead_s > self.admission.fraction * budget_s:
            reason: str | None = (
                f"model {model!r} is overloaded: about {ahead_s:.2f}s of queue ahead ({drain:.1f} req/s drained), "
                f"more than {self.admission.fraction:g} of the {budget_s:.2f}s left after its own batch"
            )
        else:
            reason = self.admission.refusal(model, budget_s)
        if reason is None:
            self._free_at[model] = clock + ahead_s + 1 / drain
            return None
        return Answer.failure(meta, ErrorCode.OVERLOADED, f"{reason} (refused by the worker at arrival)", model=model)

    def screen(self, model: str, headers: Mapping[str, str] | None) -> bool:
        """Whether an arrival of ``model`` is refused: its answer is stored and the request
        deleted from the stream by :meth:`run` (then it is not to be counted). An arrival
        without a sequence gets the answer alone (core NATS, stored all the same) and stays
        queued. With :data:`MAX_REFUSING` refusals waiting, it is left to its fetch. Returns
        whether it leaves the queue."""
        headers = headers or {}
        seq = parse_stream_sequence(headers.get("Nats-Sequence"))
        if seq is not None:
            # Both subscriptions hear a line while it changes hands (quiet, listen), in stream
            # order each: a sequence screened already is not screened (nor counted) twice.
            if seq <= self._screened.get(model, 0):
                return seq in self._refused_seqs
            self._screened[model] = seq
        answer = self.refusal(model, headers) if self._nc is not None else None
        if answer is None or answer.meta.reply_key is None:
            return False
        if self._to_refuse is None:
            return False  # not started, or stopped: left to its fetch
        try:
            self._to_refuse.send_nowait((answer, answer.meta.reply_key, seq))
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._counters.add("arrivals_refusals_skipped")
            return False
        self._counters.add("arrivals_refused")
        if seq is None:
            return False
        self._refused_seqs[seq] = None
        while len(self._refused_seqs) > _REFUSED_SEQS_KEPT:
            self._refused_seqs.popitem(last=False)
        return True

    async def _answer(self, answer: Answer, reply_key: str) -> None:
        self._counters.add("arrivals_refused_kept")
        try:
            await self._nc.publish(self._subjects.answer(answer.meta.request_id, reply_key, answer.meta.tenant), answer.body, headers=answer.headers)
        except TRANSPORT_ERRORS + (ValueError, ProtocolError) as exc:
            log.debug("overloaded answer to %s not sent: %r", answer.meta.request_id, exc)

    async def _refuse(self, answer: Answer, reply_key: str, seq: int) -> None:
        try:
            subject = self._subjects.answer(answer.meta.request_id, reply_key, answer.meta.tenant)
            await self._nc.jetstream().publish(subject, answer.body, headers=answer.headers, timeout=_REFUSE_TIMEOUT_S)
            # no_erase: the stored bytes need no overwrite, the answer said all there is.
            request = json.dumps({"seq": seq, "no_erase": True}).encode()
            reply = await self._nc.request(f"$JS.API.STREAM.MSG.DELETE.{self._subjects.models_stream}", request, timeout=_REFUSE_TIMEOUT_S)
            if not json.loads(reply.data or b"{}").get("success"):
                # Already acked (a fetch took it first), or refused: its fetch settles it.
                self._counters.add("arrivals_refused_not_deleted")
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # noqa: BLE001 - any failure leaves the request to its fetch, as before
            self._counters.add("arrivals_refusals_failed")
            log.debug("refusal of %s not completed: %r", answer.meta.request_id, exc)
