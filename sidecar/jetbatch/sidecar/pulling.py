"""Pulling a consumer's messages without a task per message.

nats-py's pull ``fetch`` awaits each message of a batch with ``next_msg``, an ``asyncio.wait_for``
that makes a task every time: in the worker's profile that was 3 tasks and 2 ``wait_for`` calls a
request (docs/benchmarks.md before 2026-12-08, "As deployed", in git). A :class:`Puller` sends the same pull requests
(``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``) with replies to an inbox of its own, and
its callback buffers what arrives: a fetch waits on one event with one deadline.

A :meth:`Puller.fill` is a batch window's last wait: one request for the rest of the batch, ended
by the puller's own precise clock rather than the server's expiry. A hold (``fetch(hold_open_s=)``)
is a worker's short wait for its served model's next batch (and the classifier's first wait of
a batch): one request for a whole batch, left open after the fetch returned, whose later
deliveries wait in the buffer, and a fill it still covers sends no request of its own; another
line's arrival ends its wait (:meth:`Puller.interrupt`). A fill's request may stay open past its
window too (``fill(open_s=)``): the next hold then sends none, and under load requests end
filled rather than on their expiry, so a batch costs fewer pull messages than a fetch loop's.
A fill takes what requests still open bring before it asks for the rest.

The semantics are nats-py's: a fetch first asks for what is stored (``no_wait``) and returns it;
when nothing is, it asks again with ``expires`` and returns once the batch is full, the request
ends (the server's 408 at its expiry, 404, 409) or the wait runs out; like nats-py, it has the
server expire a waiting request just before it stops listening, and it listens for that end. A
message that still arrives after a fetch returned (its end lost) is handed out first by the next
fetch, as nats-py's pending queue did; :meth:`Puller.close` returns it to be handed back.
:meth:`Puller.quiesce` waits until no request it sent can still deliver (a stop hands back what
they brought). A count of the consumer taken while one is open sees a message it delivered
before the count neither undelivered there nor, if it reaches the puller after the count's
answer, in the puller: :meth:`Puller.watch` says which buffered ones the count missed, and
reports each such later delivery.

Only what the consumer sends reaches the buffer: a delivery names its stream subject and carries
the consumer's ``$JS.ACK.<stream>.<consumer>.`` reply (no client may set one), a status comes on
the inbox for a request this puller sent. Anything else on the inbox is someone else's (a
publish, another consumer's delivery), dropped and counted (:attr:`forged`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from jetbatch.sdk.failures import TRANSPORT_ERRORS

from .errors import SidecarError
from .wakeup import Wakeup

__all__ = ["PullError", "Puller"]

log = logging.getLogger(__name__)

# Status codes that end a pull request without an error (nats-py treats them the same way).
_END = frozenset({"404", "408", "409"})
_HEARTBEAT = "100"
# A waiting request expires this much before the fetch's deadline (nats-py's margin too) ...
# Not more: nats-server ends a waiting request about half a millisecond after its expiry (and
# never before the next whole millisecond), so ending it earlier still only shortens the wait.
_EXPIRES_EARLY_S = 0.0001
_END_GRACE_S = 0.05  # ... and the fetch listens this long past it for the request's end
# A fill's request asks the server to end it this long after the fill stops waiting (the server
# ends it 0.4 ms or more later still): never before, so the fill's own clock closes the window.
_FILL_MARGIN_S = 0.0005
# A hold whose request stays open past its wait waits this much longer, as long as a fetch waits
# for its request's end after the expiry.
_HOLD_END_S = 0.001


class _Request:
    """A pull request this puller sent: how many messages it asked for, how many deliveries are
    counted as its (``left``: the rest still to come), how many deliveries the puller had had
    when it was sent (it can have had only later ones), and by when (loop time) the server has
    ended it at the latest (its expiry and the grace a fetch listens for an end; past it, an
    end that never came is given up on)."""

    __slots__ = ("asked", "counted", "born", "end_by")

    def __init__(self, asked: int, born: int, end_by: float) -> None:
        self.asked = asked
        self.counted = 0
        self.born = born
        self.end_by = end_by

    @property
    def left(self) -> int:
        return self.asked - self.counted


class PullError(SidecarError):
    """JetStream answered a pull request with an error status (the worker backs off, as for any
    trouble on the way to the server)."""


class Puller:
    """Fetches from one durable pull consumer of ``stream``. ``on_late`` is called for each
    message delivered while no fetch or fill waits (it lands in :attr:`buffered`): one whose
    fetch gave up before the server's answer was read, on a loaded host, comes with no arrival
    event, so a batch window waiting on those events must hear of it. ``on_uncounted`` is
    called for each delivery a count of the consumer missed (:meth:`watch`). ``on_holding`` is
    called when a delivery lands in an empty buffer: its owner keeps the pullers that hold
    something without walking every one it has (the worker has one per model it ever fetched)."""

    def __init__(
        self, nc: Any, stream: str, durable: str, *, on_late: Callable[[], None] | None = None,
        on_uncounted: Callable[[Msg], None] | None = None, on_holding: Callable[[], None] | None = None,
    ) -> None:
        self._nc = nc
        self._on_late = on_late
        self._on_holding = on_holding
        self._on_uncounted = on_uncounted
        # After a count of the consumer (:meth:`watch`): which deliveries it missed, and the
        # requests open then (only they can still bring one).
        self._missed: Callable[[Msg], bool | None] | None = None
        self._again: Callable[[Msg], bool] | None = None
        self._watched: set[str] = set()
        self._watch_until = -math.inf
        self._holding = False  # a hold waits for its first delivery now
        self._interrupted = False  # a hold was asked to stop waiting (:meth:`interrupt`)
        self._waiting = False  # a fetch or a fill waits for deliveries now
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._stream, self._durable = stream, durable
        self._acks = f"$JS.ACK.{stream}.{durable}."  # what our consumer's deliveries are acked on
        self._inbox = nc.new_inbox()
        self._replies = f"{self._inbox}."  # a request's end comes on its own reply subject
        self._buffer: deque[Msg] = deque()
        self._deliveries = 0  # every delivery so far, to anyone
        self._changed = asyncio.Event()
        self._sub: Any = None
        self._seq = 0
        self._current = ""  # the token of the pull request a fetch waits on
        self._ended = False  # that request was ended by a status
        self._error: str | None = None
        self._filled = Wakeup()  # what a fill waits on
        # The buffer's size at which the waiting fill ends, or asks for the rest of its batch,
        # and the open requests it counts on until then.
        self._fill_to: int | None = None
        self._covering: set[str] = set()
        # The pull requests not ended yet, oldest first, by token. One whose whole batch is
        # counted delivered stays (with nothing left) until its end_by: the count may be wrong
        # (:meth:`_recount`), and then it is still open.
        self._open: dict[str, _Request] = {}
        # The requests of fills that returned (a fill's ends just after its window): what they
        # may still bring goes to the next fetch, and no later fill waits on it.
        self._tails: set[str] = set()
        self.pulls = 0  # pull requests sent (each one message published)
        self.ends = 0  # pull requests ended by a status message (404, 408, 409, an error)
        self.forged = 0  # messages on the inbox that JetStream did not send, dropped

    async def start(self) -> "Puller":
        self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_msg, pending_msgs_limit=100_000)
        return self

    @property
    def buffered(self) -> int:
        """Messages delivered to this puller that no fetch has handed out yet (they came after
        their fetch returned): ours, not a peer's, and the next fetch returns them at once."""
        return len(self._buffer)

    def leftovers(self) -> list[Msg]:
        """The messages delivered after their fetch returned (or was cancelled) that no fetch took,
        taken out of the buffer: the caller hands them back (nak) when it will not fetch from this
        consumer again soon, or they wait out their ack wait."""
        msgs = list(self._buffer)
        self._buffer.clear()
        return msgs

    def watch(self, missed: Callable[[Msg], bool | None], again: Callable[[Msg], bool] | None = None) -> int:
        """A count of the consumer was just answered, while pull requests of this puller may
        still be open: how many buffered messages it missed, and each later delivery it missed
        goes to ``on_uncounted``. ``missed``: those it missed wherever they land, until the next
        watch or until it says None (none later can be one: a first delivery made after the
        count comes after every one made before it). The caller reads the count: a first
        delivery from before the count was taken, its stream sequence no later than the
        consumer's last delivered one, is in neither its undelivered count nor, if still on its
        way, this buffer, and it lands whenever the event loop reads it. ``again``: those it missed only until every request open now has ended
        (a redelivery: counted unacked while it waited, and delivered to whichever request is
        open). Waiting for the requests to end instead (:meth:`quiesce`) held the count up to a
        hold and a window; a delivery must not be dropped for reaching the puller after the
        count's answer: the server sends them from different places."""
        self._forget_over(asyncio.get_running_loop().time())
        # Each one, even one counted filled (the count may be wrong: :meth:`_recount`), until its
        # end or the latest its end can come.
        self._watched = set(self._open)
        self._watch_until = max((r.end_by for r in self._open.values()), default=-math.inf)
        self._missed = missed
        self._again = again if self._watched else None
        n = 0
        for msg in self._buffer:
            verdict = missed(msg)
            if verdict is None:
                self._missed = None  # a later first delivery is here: every earlier one is too
            n += bool(verdict or (again is not None and again(msg)))
        return n

    def _uncounted(self, msg: Msg) -> None:
        """Report a delivery the last count (:meth:`watch`) missed."""
        verdict = self._missed(msg) if self._missed is not None else False
        if verdict is None:
            self._missed = None  # none later can be one the count missed
        if not verdict and self._again is not None:
            if asyncio.get_running_loop().time() > self._watch_until:
                self._again = None  # what was open at the count has ended by now
            else:
                verdict = self._again(msg)
        if verdict and self._on_uncounted is not None:
            self._on_uncounted(msg)

    def interrupt(self) -> None:
        """End a hold's wait for its first delivery (something else wants the worker): the one
        waiting now, or else the next to start, which then sends no request. The fetch returns
        what it has; a request it left open stays open at the server, delivering to the buffer,
        for the next fetch. A caller whose hold is over without one takes it back
        (:meth:`resume`)."""
        self._interrupted = True
        self._changed.set()

    def resume(self) -> None:
        """Forget an :meth:`interrupt` no hold took."""
        self._interrupted = False

    async def quiesce(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no pull request this puller sent can still deliver:
        everything they delivered is then in :attr:`buffered` (the server sends a request's end
        after its deliveries, on the same subscription). A count of the consumer taken after
        this sees each request either undelivered or here; taken while a fill's request was
        still open, a message that request delivered after the answer was in neither. False
        when one is still open at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            now = loop.time()
            self._forget_over(now)
            # One with nothing counted to come has filled (it sends no end); recounted, it is
            # waited for again.
            delivering = [r.end_by for r in self._open.values() if r.left > 0]
            if not delivering:
                return True
            if now >= deadline or self._error is not None:
                return False
            self._changed.clear()
            try:
                async with asyncio.timeout_at(min(deadline, min(delivering))):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def close(self, timeout_s: float) -> list[Msg]:
        """Stop pulling for good: wait (at most ``timeout_s``) for the pull requests to end at
        the server, unsubscribe, and return every message delivered that no fetch took, for the
        caller to hand back (nak). Taken after the unsubscribe, so none can land in the buffer
        once it was read; a request still open at the deadline delivers to nobody, and its
        messages wait out their ack wait. An unsubscribe the connection refuses (closed,
        reconnecting) leaves the subscription to the connection: the leftovers still come back."""
        await self.quiesce(timeout_s)
        try:
            await self.unsubscribe()
        except TRANSPORT_ERRORS + (ValueError,):  # nats-py's ValueError: already unsubscribed
            pass
        return self.leftovers()

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers or {}
        # A status comes on the request's own reply subject; a delivery names its stream
        # subject, so a stored request with no body and a Status header of its own is a
        # delivery like any other (counted, buffered, answered), never taken for an end.
        on_inbox = msg.subject.startswith(self._replies)
        status = headers.get("Status") if on_inbox and not msg.data else None
        token = msg.subject[len(self._replies) :]
        if not (status and self._sent(token)) and (on_inbox or not self._ours(msg.reply)):
            # Not our consumer's: its deliveries name their stream subject and carry its ack
            # subject (which nats-server lets no client set), its statuses come on a request
            # this puller sent. Anyone who may publish to the inbox (its name is on the wire in
            # every pull request) could otherwise have the worker answer, under a tenant it
            # claims, and settle by publishing to the reply subject it chose; anyone who may use
            # the JetStream API could have a consumer of their own deliver to it.
            self._forged(msg)
            return
        if status:
            if status == _HEARTBEAT:
                return
            # One forgotten since (its end_by passed), or ended already, changes nothing.
            open_ = token in self._open
            if open_:
                self._recount(token, headers.get("Nats-Pending-Messages"))
            if self._again is not None:
                self._watched.discard(token)
                if not self._watched:
                    self._again = None
            if token in self._covering and self._fill_to is not None:
                self._covering.discard(token)
                self._fill_to = min(self._fill_to, len(self._buffer))  # the rest is asked for now
            self.ends += 1
            if token == self._current:
                self._ended = True
            if status not in _END and open_:
                self._error = f"{status} {headers.get('Description', '')}"[:200].strip()
        else:
            self._buffer.append(msg)
            if len(self._buffer) == 1 and self._on_holding is not None:
                self._on_holding()
            # A delivery names its stream subject, not its request: it is counted against the
            # oldest open one with any left to come (the server serves waiting requests in turn,
            # so another may have had it: a request's end says how many it still had,
            # :meth:`_recount`). One whose whole batch came has no end to wait for.
            self._deliveries += 1
            for request in self._open.values():
                if request.left > 0:
                    request.counted += 1
                    break
            if self._missed is not None or self._again is not None:
                self._uncounted(msg)
            if not self._waiting and self._on_late is not None:
                self._on_late()
        self._changed.set()
        if self._fill_to is not None and (len(self._buffer) >= self._fill_to or self._ended or self._error is not None):
            self._filled.wake()

    def _ours(self, reply: str | None) -> bool:
        """``reply`` is an ack subject of this puller's consumer: ``$JS.ACK.<stream>.<consumer>.``,
        or with a domain and an account hash before them (ADR-15)."""
        if not reply:
            return False
        if reply.startswith(self._acks):
            return True
        if not reply.startswith("$JS.ACK."):
            return False
        tokens = reply.split(".", 7)
        return len(tokens) == 8 and tokens[4] == self._stream and tokens[5] == self._durable

    def _sent(self, token: str) -> bool:
        """``token`` names a pull request this puller sent (never raises: the subject is anyone's)."""
        return 0 < len(token) <= 19 and token.isascii() and token.isdigit() and int(token) <= self._seq

    def _forged(self, msg: Msg) -> None:
        self.forged += 1
        if self.forged == 1 or self.forged % 1000 == 0:
            log.warning("dropped %d message(s) on the pull inbox of %s that JetStream did not send (the last on %.80r)", self.forged, self._api, msg.subject)

    async def fetch(
        self, batch: int, timeout: float, *, linger: int | None = None, stored_only: bool = False, hold_open_s: float | None = None
    ) -> list[Msg]:
        """Up to ``batch`` messages within ``timeout`` seconds ([] when none came). ``linger``:
        when nothing is stored, the waiting request asks for that many (fewer than ``batch``) and
        the fetch returns once they came: an idle caller's wait for its first message.
        ``stored_only``: what is stored, in one round trip; no request waits for arrivals.
        ``hold_open_s`` (a hold: a worker's short wait for its served model's next batch): one
        request for the whole batch, open that long (no less than ``timeout``), or none while
        one left open by a fill or an earlier hold may still bring a message; the fetch
        returns with what is stored, or else with the first arrival within ``timeout``, and
        the request goes on delivering to the buffer until it has its batch or expires, for
        the next fetch or a :meth:`fill` it covers. Keep it short (milliseconds): what it
        delivers is this puller's."""
        self._raise_refused()
        if self._buffer:
            return self._take(batch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if hold_open_s is not None and not stored_only:
            # One request: what is stored comes at once, or else the first arrival. The fetch
            # returns when its first delivery wakes it (what the server sent with it is in the
            # buffer by then: nats-py hands a subscription everything it read before it yields);
            # the rest follow into the buffer, each delivery saying how many are still stored
            # behind it. No no_wait request, its 404 and second request: one message and,
            # unless the request fills, its 408.
            # A request a window left open for the next (``fill(open_s=)``) or the last hold's
            # serves this hold too: no request of its own, and, as that one fills, no 408. One
            # that ends first (408) empty-handed is followed by a request of this hold's own.
            # Past the fetch's own wait the request may still deliver: that is the next fetch's
            # (a hold that came back empty hands it on to the count, which waits for its end).
            # A fetch waits for its request's end, which the server sends 0.4-1 ms past its
            # expiry, and a hold waits as long: one that gave up at its expiry came back empty
            # four to five times as often through the classifier (docs/benchmarks.md).
            # Another's arrival can end the wait (:meth:`interrupt`).
            open_until = loop.time() + max(hold_open_s, timeout)
            end_wait = deadline + (_END_GRACE_S if hold_open_s <= timeout else _HOLD_END_S)
            asked = False
            self._holding = True
            try:
                while not self._buffer and self._error is None and not self._interrupted and loop.time() < deadline:
                    token = None if asked else self._lasting(loop.time())
                    if token is not None:
                        self._current, self._ended = token, False
                    elif asked:
                        break  # its own request ended early (a 409: no second one, no spin)
                    else:
                        expires_s = max(open_until - loop.time() - _EXPIRES_EARLY_S, 0.001)
                        await self._request({"batch": batch, "expires": int(expires_s * 1e9)})
                        asked = True
                    await self._wait(1, end_wait)
                    if not self._ended:
                        break  # a delivery, an interrupt, or the wait's end
            finally:
                self._holding = self._interrupted = False
            return self._take(batch)
        # What is stored comes at once (the server ends a no_wait request with 404 when it has
        # fewer than asked for); only when nothing is does a request wait for arrivals.
        await self._request({"batch": batch, "no_wait": True})
        await self._wait(batch, deadline)
        if not self._buffer and not stored_only and loop.time() < deadline and self._error is None:
            # The server ends the request a little before we stop listening, and we wait for its
            # end (408): nothing is delivered to a request nobody waits on any more. A message
            # delivered late would sit in this buffer, unacked, until the next fetch of this
            # model, or its ack wait if this worker moved on to other models.
            expires_s = max(deadline - loop.time() - _EXPIRES_EARLY_S, 0.001)
            wanted = min(batch, linger) if linger else batch
            await self._request({"batch": wanted, "expires": int(expires_s * 1e9)})
            await self._wait(wanted, deadline + _END_GRACE_S)
        return self._take(batch)

    async def fill(self, batch: int, wait_s: float, *, open_s: float | None = None) -> list[Msg]:
        """Up to ``batch`` messages: what is buffered and stored, then what arrives, until the
        batch is full or ``wait_s`` passed, timed on a :class:`Wakeup` (a batch window's close:
        a fetch ends on the server's expiry, up to a millisecond late). The pull request asks
        the server to end it just after, or ``open_s`` after the fill began (a worker serving a
        model's batches back to back: the next window counts on it, and it ends filled, not by
        its expiry); a message it delivers after the fill returned is handed out first by the
        next fetch (a caller that stops fetching hands :meth:`leftovers` back). Requests still
        open past the fill's end (a hold's, an earlier window's) bring their part first: the
        fill asks for the rest only once they brought it, with time left."""
        self._raise_refused()
        if len(self._buffer) < batch:
            self._fill_to = batch
            self._waiting = True
            try:
                loop = asyncio.get_running_loop()
                started = loop.time()
                ends_at = started + max(wait_s, 0.0)  # the fill's end, on its own clock
                # Its request's end: just after the fill's, or ``open_s`` after it began.
                open_until = started + max(open_s or 0.0, max(wait_s, 0.0) + _FILL_MARGIN_S)
                need = batch - len(self._buffer)
                token, covering, covered = self._cover(need, ends_at - started + _FILL_MARGIN_S)
                if token is not None:
                    # A request still open past this fill's end brings what it needs: no
                    # request of its own, and that one's end (a refusal) ends the fill.
                    self._current, self._ended = token, False
                else:
                    # Several, or one that brings only part (or none): that part first, then a
                    # request for the rest. Asked for at once, a small request for a batch's
                    # last few was sent every window and ended by its expiry when traffic is
                    # light (a request and a 408 a lone request); two for the whole rest brought
                    # more than the window took, left in this puller.
                    # One of them ending early (a refusal) has the fill ask for the rest then.
                    self._current, self._ended = "", False
                    self._fill_to = len(self._buffer) + covered
                    self._covering = covering
                while len(self._buffer) < batch and not self._ended and self._error is None:
                    now = loop.time()
                    if len(self._buffer) >= self._fill_to:
                        # What open requests were counted on for came (or none was): ask for the rest.
                        if now >= ends_at:
                            break
                        self._fill_to = batch
                        await self._request({"batch": batch - len(self._buffer), "expires": int((open_until - now) * 1e9)})
                        if open_s is None or open_s <= wait_s + _FILL_MARGIN_S:
                            self._tails.add(self._current)  # not left open for the next window
                        continue
                    if now >= ends_at or not await self._filled.wait(ends_at - now):
                        break
            finally:
                self._fill_to = None
                self._covering = set()
                self._waiting = False
        return self._take(batch)

    def _cover(self, n: int, for_s: float) -> tuple[str | None, set[str], int]:
        """What the pull requests open now that stay open at the server past the end of a fill of
        ``n`` waiting ``for_s`` (a hold's, not a returned fill's) can still bring toward it: one
        that alone brings them (None if none does), the ones counted on, and how many they bring
        in all (at most ``n``). A returned fill's request ends just after its window, and a
        hold's that expires inside this one brings nothing after its end (the fill would wait
        out its window a request short): the fill counts on neither. What such a request still
        brings before its end is over the batch, the next fetch's."""
        if self._error is not None:
            return None, set(), 0
        lasting = self._counted_on(asyncio.get_running_loop().time() + for_s)
        alone = next((token for token, r in lasting if r.left >= n), None)
        return alone, {token for token, _ in lasting}, min(n, sum(r.left for _, r in lasting))

    def _recount(self, token: str, pending: str | None) -> None:
        """The request ``token`` ended with ``pending`` (its ``Nats-Pending-Messages``) of its
        batch undelivered. Each delivery was counted against the oldest request with any left,
        and the server serves them in turn, so the end corrects the others: fewer delivered to
        it than counted means others had deliveries not counted as theirs, and have that many
        fewer to come (counted too many, a request that had filled looked open, and a hold
        waited on it to its end); more means others were counted deliveries that were its, and
        have more to come (counted too few, an open one looked filled, and a count of the
        consumer taken before its end missed what it delivered after). Oldest first (they have
        had the most deliveries in turn), and none takes more than it can have had: no delivery
        from before it was sent. One found filled ends a wait on it, as its end would."""
        ended = self._open.pop(token)
        try:
            over = int(pending or "") - ended.left
        except ValueError:  # none (a 404 carries none), or not the server's: count nothing
            return
        for other, request in self._open.items():
            if over == 0:
                break
            if over > 0:  # others had deliveries not counted as theirs
                taken = min(over, request.left, self._deliveries - request.born - request.counted)
                if taken > 0:
                    request.counted += taken
                    over -= taken
                    if request.left == 0 and other == self._current:
                        self._ended = True
            else:  # deliveries counted as others' were this one's
                given = min(-over, request.counted)
                request.counted -= given
                over += given

    def _forget_over(self, now: float) -> None:
        """Forget the requests ended at the server by ``now`` at the latest (their ends lost, in
        a reconnect, or not sent: a request that filled)."""
        for token in [t for t, r in self._open.items() if r.end_by <= now]:
            del self._open[token]

    def _lasting(self, now: float) -> str | None:
        """An open request (not a returned fill's) that may still bring messages and has not
        expired at the server by ``now``: the one ending last, if several."""
        lasting = self._counted_on(now)
        return max(lasting, key=lambda item: item[1].end_by)[0] if lasting else None

    def _counted_on(self, until: float) -> list[tuple[str, _Request]]:
        """The open requests a wait may count on until ``until`` (loop time): with messages still
        to come, open at the server past it, and not a returned fill's (a fill's ends just after
        its window: the next window must not count on it)."""
        self._tails &= self._open.keys()
        return [(t, r) for t, r in self._open.items() if r.left > 0 and t not in self._tails and r.end_by - _END_GRACE_S >= until]

    def _raise_refused(self) -> None:
        """Raise the error status the last request ended with (once)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise PullError(f"JetStream refused a pull: {error}")

    async def _request(self, body: dict[str, Any]) -> None:
        self._seq += 1
        self.pulls += 1
        self._current, self._ended = str(self._seq), False
        expires_s = body.get("expires", 0) / 1e9
        now = asyncio.get_running_loop().time()
        if len(self._open) > 8:
            self._forget_over(now)
        token = self._current
        self._open[token] = _Request(int(body["batch"]), self._deliveries, now + expires_s + _END_GRACE_S)
        try:
            await self._nc.publish(self._api, json.dumps(body).encode(), reply=f"{self._replies}{token}")
        except Exception:
            # Not sent (the connection closed, the outbound buffer full: nats-py raises those
            # before it queues the message): nothing will come of it. A cancellation comes only
            # after it was queued, so that request goes out and stays counted.
            self._open.pop(token, None)
            raise

    async def _wait(self, batch: int, deadline: float) -> None:
        """Until the batch is full, the current request ends, or ``deadline`` (loop time)."""
        self._waiting = True
        try:
            async with asyncio.timeout_at(deadline):  # one timer, no task
                while len(self._buffer) < batch and not self._ended and not (self._holding and self._interrupted):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            pass
        finally:
            self._waiting = False

    def _take(self, batch: int) -> list[Msg]:
        n = min(batch, len(self._buffer))
        return [self._buffer.popleft() for _ in range(n)]
