"""What the worker's parts share: one served model (:class:`Slot`), one batch's use of it
(:class:`ModelTurn`), one request in a batch (:class:`Request`), and the report of a finished
batch."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio
from nats.aio.msg import Msg

from jetbatch.sdk.protocol import RequestMeta

from ..config import ModelConfig
from ..core import Computed, WorkerCore
from ..handlers import Handler
from ..policy import BatchWindow, Tier
from ..replies import Answer
from ..telemetry import LoadRecord

__all__ = ["AckInfo", "BatchReport", "FetchHealth", "ModelTurn", "Placement", "PullLines", "Request", "Slot", "ack_info", "enqueued_at"]


@dataclass(frozen=True)
class BatchReport:
    """What one batch did; passed to ``on_batch`` observers (the demo prints one line each)."""

    batch_id: str
    model: str
    size: int
    ok: int
    errors: int
    queue_wait_ms: tuple[float, ...]
    loaded: bool
    compute_s: float
    decision: str


@dataclass(eq=False, slots=True)
class Request:
    """One message of a batch, its checked headers, and what became of it."""

    msg: Msg
    meta: RequestMeta
    deliveries: int
    seq: int  # stream sequence: stable across redeliveries
    enqueued_at: float  # wall clock, from the JetStream timestamp
    reply_refused: bool = False  # a reply subject was given and the reply policy refused it
    value: Any = None
    answer: Answer | None = None
    exception: BaseException | None = None  # what the handler raised, for the batch span
    action: str = "ack"  # how the message is settled once answered: ack or term


@dataclass
class Placement:
    """Where the model is, and what its load left for the first batch. Written by
    ``worker/residency.py`` only."""

    tier: Tier = "cold"
    fresh_load: bool = False  # the next batch is the first after a load: it "paid" the load
    pending_load: LoadRecord | None = None  # reported under the first batch after the load
    broken: str | None = None  # why the model cannot load (a missing file), reported at startup


@dataclass
class PullLines:
    """The model's consumers and pull subscriptions. Written by ``worker/pullers.py`` only."""

    psub: Any = None
    bulk_psub: Any = None
    consumer_ready_at: float | None = None  # when this worker last made sure the consumer exists
    bulk_consumer_ready_at: float | None = None  # the same for the batch-class consumer
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one creation at a time


@dataclass
class FetchHealth:
    """What the model's empty fetches said. Written by ``worker/lines.py`` only."""

    # The last fetch came back empty while the consumer said requests were undelivered: the next
    # such miss holds them back like any other (a fetch that never delivers must not spin).
    missed: bool = False
    # When an empty fetch last looked "unreachable" (nothing undelivered, nothing unacked): the
    # stream is counted and the queue fetched again before that is believed.
    unreachable_seen_at: float = -math.inf
    unreachable_warned_at: float = -math.inf  # when the worker last warned of them (once a minute)


@dataclass
class Slot:
    """One model this worker serves: its configuration, and its state in records that one
    module each writes (``place``, ``lines``, ``fetches``; the queue's fields below are
    ``worker/queues.py``'s). Others read them, also through the properties below."""

    name: str
    config: ModelConfig
    handler: Handler
    window: BatchWindow
    place: Placement = field(default_factory=Placement)
    lines: PullLines = field(default_factory=PullLines)
    fetches: FetchHealth = field(default_factory=FetchHealth)
    backlog: int = 0
    arrivals: int = 0  # arrival events counted for this model, ever: an open window waits for the next
    oldest_enqueued_at: float | None = None
    head_deadline: float | None = None  # the oldest waiting request's deadline (Unix seconds)
    # Set (and replaced) each time one of this model's batches ends, or stops needing the model
    # (the core counts them: ``WorkerCore.in_flight``, ``computing``): what a wait for room, an
    # eviction and the drain wait on, instead of polling.
    batch_ended: anyio.Event = field(default_factory=anyio.Event)
    # Batches computing at once (``max_concurrent_batches``): held for the forward passes only.
    limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(1))
    # Stored messages nobody we know of holds and this worker never saw arrive: a dead worker's
    # in-flight (due for redelivery within the ack wait), or requests stored before we listened.
    # Counted as backlog until a fetch comes back empty; then held back (``unfetchable``) for one
    # ack wait, by which all of them are due, shrinking as they are acked (queues.py).
    stranded: int = 0
    unfetchable: int = 0
    hold_until: float = 0.0
    stranded_since: float | None = None  # when the count first showed stranded messages
    # A look before a load found nothing stored for this model: its arrival events are not
    # counted (anyone who may publish there can forge them) until a count of the stream shows
    # requests of it again (worker/lines.py, Lines.look).
    doubted: bool = False
    # Enqueue times (and deadlines) of the newest waiting interactive requests, oldest first,
    # from the arrival events; the same for the batch class (``known_bulk``); older waiting
    # requests' head, when read (None: not known). See queues.py.
    # Each entry: (enqueue time, deadline, (tenant, request id) when the event named one, the
    # stream sequence it was stored at when the event said).
    known_times: deque[tuple[float, float | None, tuple[str, str] | None, int | None]] = field(default_factory=deque)
    known_bulk: deque[tuple[float, float | None, tuple[str, str] | None, int | None]] = field(default_factory=deque)
    # The known waiting requests whose callers cancelled them (worker/cancellations.py): still in
    # the count until answered, but no load is paid for a queue of them (worker/loop.py, _load).
    cancelled_keys: set[tuple[str, str]] = field(default_factory=set)
    unknown_head_at: float | None = None
    unknown_head_deadline: float | None = None
    # Of the backlog, requests of the batch class (their own subject and consumer, pulled after
    # the interactive ones): counted like the backlog, from events and the bulk count.
    bulk: int = 0
    interactive_run: int = 0  # batches in a row that took the interactive line first while both waited

    @property
    def tier(self) -> Tier:
        return self.place.tier

    @property
    def resident(self) -> bool:
        return self.place.tier == "resident"

    @property
    def broken(self) -> str | None:
        return self.place.broken

    @property
    def psub(self) -> Any:
        return self.lines.psub

    @property
    def bulk_psub(self) -> Any:
        return self.lines.bulk_psub

    @property
    def known(self) -> int:
        """Waiting requests whose arrival this worker saw (both classes)."""
        return len(self.known_times) + len(self.known_bulk)

    @property
    def interactive(self) -> int:
        """Of the backlog, the interactive requests."""
        return max(0, self.backlog - self.bulk)

    @property
    def interactive_enqueued_at(self) -> float | None:
        """When the oldest waiting interactive request was enqueued (as far as known)."""
        if self.interactive == 0:
            return None
        if self.interactive > len(self.known_times) and self.unknown_head_at is not None:
            return self.unknown_head_at
        return self.known_times[0][0] if self.known_times else self.oldest_enqueued_at

    def moved(self) -> None:
        """One of this model's batches computed or was settled (the core was told): whoever
        waits on its batches looks again."""
        ended, self.batch_ended = self.batch_ended, anyio.Event()
        ended.set()

    async def wait_settled(self, core: WorkerCore) -> None:
        """Until none of this model's batches is in flight. Batches end by themselves (a batch is
        bounded by its requests' deadlines and the drain), so this needs no timer."""
        while core.in_flight(self.name) > 0:
            await self.batch_ended.wait()

    async def wait_batch_moves(self) -> None:
        """Until one of this model's batches computes or is settled (the core bounds how many
        are under way: ``WaitRoom``). Batches move on by themselves, so no timer."""
        await self.batch_ended.wait()

    async def wait_model_free(self, core: WorkerCore) -> None:
        """Until no batch may still run the model (before it is evicted)."""
        while core.computing(self.name) > 0:
            await self.batch_ended.wait()


class ModelTurn:
    """One batch's use of its model, from its fetch on.

    Only forward passes take the model's share (``max_concurrent_batches``, the slot's limiter):
    a batch's checks, decoding, stored-answer lookups and answers are I/O or host work that
    overlaps the forward passes of the batches around it. :meth:`take` before a forward pass
    (waits for the share), :meth:`lend` after one when the batch may run another (redelivered
    requests, after their lookups), :meth:`release` once it needs the model no more: then the
    core stops counting it as computing, and an eviction waiting for the model may go on."""

    def __init__(self, slot: Slot, core: WorkerCore) -> None:
        self._slot = slot
        self._core = core
        self._held = False
        self._done = False

    async def take(self) -> None:
        if not self._held:
            try:
                # Free: taken without yielding, so the forward pass is not queued behind
                # whatever else is ready on the loop (the serve loop's next decision).
                self._slot.limiter.acquire_nowait()
            except anyio.WouldBlock:
                await self._slot.limiter.acquire()
            self._held = True

    def lend(self) -> None:
        if self._held:
            self._held = False
            self._slot.limiter.release()

    def release(self) -> None:
        """Idempotent: the batch's error path calls it again."""
        self.lend()
        if not self._done:
            self._done = True
            self._core.handle(Computed(self._slot.name))
            self._slot.moved()


class AckInfo(NamedTuple):
    """What a JetStream delivery's ack subject says about it."""

    delivered: int  # how many times the consumer delivered it (1: the first time)
    stream_seq: int
    stored_at_s: float  # when the stream stored it (Unix seconds)
    pending: int  # what the consumer had left undelivered after it


def ack_info(msg: Msg) -> AckInfo | None:
    """The ack subject's fields (ADR-15: ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream
    seq>.<consumer seq>.<ns>.<pending>``, or with a domain and an account hash before the stream
    and a token after), None for any other message; never raises.

    nats-py's ``msg.metadata`` reads the same fields, but builds a datetime and three objects per
    message: a third of the worker's own per-request parsing (``bench.overhead.process_profiles --sampler
    py-spy``). The subject is the server's, but anyone who may publish to the pull's inbox can
    forge one, so a malformed one is simply not a JetStream delivery."""
    reply = msg.reply
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    first = 4 if len(tokens) == 9 else 6 if len(tokens) >= 11 else 0
    if not first:
        return None
    try:
        int(tokens[first + 2])  # the consumer's sequence: unused, but a delivery has one
        return AckInfo(int(tokens[first]), int(tokens[first + 1]), int(tokens[first + 3]) / 1e9, int(tokens[first + 4]))
    except ValueError:
        return None


def enqueued_at(msg: Msg, fallback: float) -> float:
    """When the stream stored ``msg``, never later than ``fallback`` (now, to the caller)."""
    info = ack_info(msg)
    return fallback if info is None else min(info.stored_at_s, fallback)

