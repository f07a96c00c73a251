"""Poison requests: evidence before a verdict, and an end for every message.

A request that JetStream redelivers may be what killed the previous worker, or an innocent that
was in flight when a worker or a server went away. Redelivered requests (the *suspects*) are
tested after the first-time requests of their batch are answered: the suspects with no evidence
against them run together, as one batch (after a server restart or a worker killed from outside,
that is all it takes); a suspect that was inside the model's code when the process died runs
alone from then on (see :func:`groups` for why not in halves). Just before a group's model code
runs, the worker records each member in a key-value bucket under its stream sequence, with the
group's size, and clears the records as soon as the code returns. A record that survives is
evidence: the process died while that request was inside the model's code, in a group of that
size (``1``: alone).

Verdicts, with ``max_deliver`` from the configuration:

- a suspect with ``max_deliver - 1`` recorded alone-crashes is the culprit: it gets
  ``model_failed`` and a dead letter without running again (a poison costs ``max_deliver + 1``
  crashes: its first batch, its group, then the alone ones; an innocent that was merely in flight
  during crashes is never convicted);
- a request delivered ``give_up_after`` times without ever completing (an endless kill pattern,
  or no evidence store) is answered ``model_failed`` as *not proven* and dead-lettered, so no
  message waits forever;
- otherwise it runs: together with the suspects of no evidence, or alone.

JetStream's own delivery limit is off for the model queues (see sidecar/streams.py): a message
that hit it unacked would stay in the work queue forever, unanswered, counted as backlog.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import StorageType

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import Subjects

from ..errors import TRANSPORT_ERRORS
from ..streams import ensure_key_value

__all__ = ["Evidence", "Quarantine", "Verdict", "give_up_after", "groups"]

log = logging.getLogger("jetbatch.quarantine")


class Verdict(enum.Enum):
    RUN_ALONE = "run-alone"
    CULPRIT = "culprit"
    GIVE_UP = "give-up"


@dataclass(frozen=True)
class Evidence:
    """What the bucket says of one message: crashes while it ran alone, and the size of the group
    it was in when the process last died with it inside the model (None: no such crash)."""

    alone_crashes: int = 0
    crashed_in_group: int | None = None

    def encode(self, running_in: int) -> bytes:
        """The record written before a run in a group of ``running_in``."""
        alone = self.alone_crashes + (1 if running_in == 1 else 0)
        return f"{alone},{running_in}".encode()

    @staticmethod
    def decode(value: bytes | None) -> "Evidence":
        """A record as :meth:`encode` writes it (a bare count: alone crashes, as 0.2 wrote them);
        anything else is no evidence."""
        text = (value or b"").decode("ascii", "replace")[:32]
        alone, _, group = text.partition(",")
        try:
            crashes = max(0, int(alone or "0"))
            size = max(1, int(group)) if group else (1 if crashes else None)
        except ValueError:
            return Evidence()
        return Evidence(crashes, size)


def groups(suspects: list[tuple[int, Evidence]]) -> list[list[int]]:
    """Indices of ``suspects`` in the groups they run in: all those with no evidence against them
    together, as one batch; each with evidence (a crash in any group) alone.

    Why not halve a crashed group again and again: every crash costs a restart and an ack wait
    before the next delivery (seconds), while running alone costs one batch (milliseconds). One
    group run answers the common case (a server restart, a worker killed from outside, nothing
    poisonous) in one batch; once a group has crashed, alone runs find the poison at the price of
    one more crash than running everyone alone from the start."""
    together = [i for i, (_, ev) in enumerate(suspects) if ev.crashed_in_group is None]
    alone = [[i] for i, (_, ev) in enumerate(suspects) if ev.crashed_in_group is not None]
    return ([together] if together else []) + alone


def give_up_after(max_deliver: int) -> int:
    """Deliveries after which a request that never completed is answered anyway."""
    return max(3 * max_deliver, 10)


@dataclass
class Quarantine:
    """The evidence store (a KV bucket) and the verdict rule."""

    js: JetStreamContext
    subjects: Subjects
    max_deliver: int
    replicas: int = 1
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        self._kv: Any = None

    async def start(self) -> None:
        self._kv = await ensure_key_value(
            self.js,
            self.subjects.attempts_bucket,
            description="jetbatch: redelivered requests run alone (poison evidence)",
            ttl_s=self.ttl_s,
            storage=StorageType.FILE,  # evidence must survive a server restart
            replicas=self.replicas,
        )

    @staticmethod
    def _key(model: str, seq: int) -> str:
        return f"{model}.{seq}"

    async def evidence(self, model: str, seq: int) -> Evidence:
        """What the bucket records against this message."""
        if self._kv is None or seq <= 0:
            return Evidence()
        try:
            entry = await self._kv.get(self._key(model, seq))
        except failures.KEY_MISSING:
            return Evidence()
        except TRANSPORT_ERRORS as exc:
            log.warning("reading poison evidence for %s/%s failed: %r", model, seq, exc)
            return Evidence()
        return Evidence.decode(entry.value)

    def verdict(self, deliveries: int, crashes: int) -> Verdict:
        if self.max_deliver > 1 and crashes >= self.max_deliver - 1:
            return Verdict.CULPRIT
        if deliveries >= give_up_after(self.max_deliver):
            return Verdict.GIVE_UP
        return Verdict.RUN_ALONE

    async def begin(self, model: str, seq: int, evidence: Evidence, group_size: int) -> None:
        """Record that this message starts running in a group of ``group_size`` (before it runs)."""
        if self._kv is None or seq <= 0:
            return
        try:
            await self._kv.put(self._key(model, seq), evidence.encode(group_size))
        except TRANSPORT_ERRORS as exc:
            log.warning("recording the run of %s/%s failed: %r", model, seq, exc)

    async def clear(self, model: str, seq: int) -> None:
        """The message completed (answered): its record is no evidence any more."""
        if self._kv is None or seq <= 0:
            return
        try:
            await self._kv.purge(self._key(model, seq))
        except TRANSPORT_ERRORS:
            pass  # the bucket's TTL forgets it
