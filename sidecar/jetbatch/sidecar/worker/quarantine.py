"""Poison requests: evidence before a verdict, and an end for every message.

A request that JetStream redelivers may be what killed the previous worker, or an innocent that
was in flight when a worker or a server went away. Redelivered requests (the *suspects*) are
tested after the first-time requests of their batch are answered: the suspects with no evidence
against them run together, as one batch (after a server restart or a worker killed from outside,
that is all it takes); a group that was inside the model's code when the process died is cut into
parts (:func:`groups`), each run on its own, so a poison is cornered in ever smaller groups while
the innocents beside it complete in the first part that holds no poison. Just before a group's
model code runs, the worker records each member in a key-value bucket under its stream sequence,
with the group's size and tag, and clears the records as soon as the code returns. A record that
survives is evidence: the process died while that request was inside the model's code, in a group
of that size (``1``: alone).

Verdicts, with ``max_deliver`` from the configuration:

- a suspect whose record holds ``max_deliver - 1`` crashes, at least two of them alone (one where
  ``max_deliver`` is 2) and the last alone, is the culprit: ``model_failed`` and a dead letter
  without running again. An innocent that was merely in flight during crashes completes in a
  part without the poison and is never convicted;
- a request delivered ``give_up_after`` times without ever completing (an endless kill pattern,
  or no evidence store) is answered ``model_failed`` as *not proven* and dead-lettered, so no
  message waits forever;
- otherwise it runs: together with the suspects of no evidence, or in its part.

JetStream's own delivery limit is off for the model queues (see sidecar/streams.py): a message
that hit it unacked would stay in the work queue forever, unanswered, counted as backlog.
"""

from __future__ import annotations

import enum
import logging
import random
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import StorageType

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import Subjects

from ..errors import TRANSPORT_ERRORS
from ..buckets import ensure_key_value

__all__ = ["FANOUT", "Evidence", "Quarantine", "Verdict", "give_up_after", "groups"]

log = logging.getLogger("jetbatch.quarantine")


class Verdict(enum.Enum):
    RUN_ALONE = "run-alone"
    CULPRIT = "culprit"
    GIVE_UP = "give-up"


@dataclass(frozen=True)
class Evidence:
    """What the bucket says of one message: crashes while it ran alone, the size of the group it
    was in when the process last died with it inside the model (None: no such crash), every such
    crash in any group (``crashes``), and which group that last one was (``tag``: the group's
    lowest stream sequence, so the members of one crashed group are told apart from another's)."""

    alone_crashes: int = 0
    crashed_in_group: int | None = None
    crashes: int = 0
    tag: int = 0

    def encode(self, running_in: int, tag: int = 0) -> bytes:
        """The record written before a run in a group of ``running_in`` tagged ``tag``."""
        alone = self.alone_crashes + (1 if running_in == 1 else 0)
        return f"{alone},{running_in},{self.crashes + 1},{tag}".encode()

    def after_crash(self, running_in: int, tag: int = 0) -> "Evidence":
        """The evidence once the process died while this ran in a group of ``running_in``."""
        return Evidence.decode(self.encode(running_in, tag))

    @staticmethod
    def decode(value: bytes | None) -> "Evidence":
        """A record as :meth:`encode` writes it (``alone,size``, as 0.3 wrote them, or a bare
        count of alone crashes, as 0.2 did); anything else is no evidence."""
        text = (value or b"").decode("ascii", "replace")[:64]
        fields = text.split(",")
        try:
            crashes = max(0, int(fields[0] or "0"))
            size = max(1, int(fields[1])) if len(fields) > 1 and fields[1] else (1 if crashes else None)
            total = max(crashes, int(fields[2])) if len(fields) > 2 else crashes + (1 if size is not None and size > 1 else 0)
            tag = max(0, int(fields[3])) if len(fields) > 3 else 0
        except ValueError:
            return Evidence()
        return Evidence(crashes, size, total, tag)


# How many parts a group that crashed is cut into when it runs again. Only a crash costs (a restart
# and an ack wait, seconds); a part that runs clean costs one batch: the finer the cut, the fewer
# crashes and the sooner the innocents beside a poison are answered, halves being the worst
# (tests/test_quarantine.py counts them). Bounded so that a crashed fetch of thousands costs a
# round of 32 batches, not thousands.
FANOUT = 32


def groups(suspects: list[tuple[int, Evidence]], *, fanout: int = FANOUT, rng: random.Random | None = None) -> list[list[int]]:
    """Indices of ``suspects`` (stream sequence, evidence) in the groups they run in, in the order
    they run: all those with no evidence against them together, as one batch; those that crashed
    together (one ``tag``) cut into ``fanout`` parts by sequence; one that crashed alone alone.

    k poisons among n thus cost about k times log_fanout(n) crashes, not n, and an innocent is
    answered in the first run of its part that holds no poison. Weakest evidence runs first
    (fewer crashes, then a larger group), so the innocents complete before a likely poison kills
    the process again; ``rng`` orders equals at random, so a worker killed from outside soon after
    it starts does not find the same group running every time."""
    rng = rng or random.Random()
    out: list[tuple[tuple[int, int, float], list[int]]] = []
    together = [i for i, (_, ev) in enumerate(suspects) if ev.crashed_in_group is None]
    if together:
        out.append(((-1, 0, 0.0), together))
    # The members of one crashed group present here. Its tag is its lowest sequence, which a part
    # cut from it may have again after a crash of its own: the size and the crash count tell
    # them apart (a crash counts one more for each member).
    crashed: dict[tuple[int, int, int], list[int]] = {}
    for i, (_, ev) in enumerate(suspects):
        if ev.crashed_in_group == 1:
            out.append(((ev.crashes, -1, rng.random()), [i]))
        elif ev.crashed_in_group is not None:
            crashed.setdefault((ev.tag, ev.crashed_in_group, ev.crashes), []).append(i)
    for members in crashed.values():
        members.sort(key=lambda i: suspects[i][0])
        parts = min(max(fanout, 2), len(members))
        size, extra = divmod(len(members), parts)
        start = 0
        for p in range(parts):
            part = members[start : start + size + (1 if p < extra else 0)]
            start += len(part)
            worst = max((suspects[i][1] for i in part), key=lambda ev: (ev.crashes, -(ev.crashed_in_group or 0)))
            out.append(((worst.crashes, -(worst.crashed_in_group or 0), rng.random()), part))
    out.sort(key=lambda entry: entry[0])
    return [part for _, part in out]


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

    def verdict(self, deliveries: int, evidence: Evidence) -> Verdict:
        """CULPRIT: the process died ``max_deliver - 1`` times with this request inside the model,
        in ever smaller groups (each a cut of the crashed one before), and at least twice alone
        (once where ``max_deliver`` is 2): one kill from outside during a lone run is no proof."""
        alone_needed = min(2, self.max_deliver - 1)
        if (
            self.max_deliver > 1
            and evidence.crashed_in_group == 1
            and evidence.alone_crashes >= alone_needed
            and evidence.crashes >= self.max_deliver - 1
        ):
            return Verdict.CULPRIT
        if deliveries >= give_up_after(self.max_deliver):
            return Verdict.GIVE_UP
        return Verdict.RUN_ALONE

    async def begin(self, model: str, seq: int, evidence: Evidence, group_size: int, tag: int = 0) -> None:
        """Record that this message starts running in a group of ``group_size`` tagged ``tag``
        (before it runs)."""
        if self._kv is None or seq <= 0:
            return
        try:
            await self._kv.put(self._key(model, seq), evidence.encode(group_size, tag))
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
