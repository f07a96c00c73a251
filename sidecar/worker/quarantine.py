"""Poison requests: evidence before a verdict, and an end for every message.

A request that JetStream redelivers may be what killed the previous worker. Redelivered requests
(the *suspects*) run one at a time, in a random order, after the first-time requests of their
batch are answered. Just before a suspect's model code runs alone, the worker records that in a
key-value bucket under the message's stream sequence, and clears the record as soon as the code
returns. A record that survives is evidence: the process died while that request, and only it,
was inside the model's code.

Verdicts, with ``max_deliver`` from the configuration:

- a suspect with ``max_deliver - 1`` recorded alone-crashes is the culprit: it gets
  ``model_failed`` and a dead letter without running again (so a poison costs ``max_deliver``
  crashes, its first batched one included, and an innocent that was merely in flight during
  crashes is never convicted);
- a request delivered ``give_up_after`` times without ever completing (an endless kill pattern,
  or no evidence store) is answered ``model_failed`` as *not proven* and dead-lettered, so no
  message waits forever;
- otherwise it runs alone.

JetStream's own delivery limit is off for the model queues (see sidecar/streams.py): a message
that hit it unacked would stay in the work queue forever, unanswered, counted as backlog.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import StorageType

from jetbatch.sdk.protocol import Subjects

from ..streams import ensure_key_value

__all__ = ["Quarantine", "Verdict", "give_up_after"]

log = logging.getLogger("jetbatch.quarantine")


class Verdict(enum.Enum):
    RUN_ALONE = "run-alone"
    CULPRIT = "culprit"
    GIVE_UP = "give-up"


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

    async def crashes(self, model: str, seq: int) -> int:
        """Alone attempts recorded for this message that never completed."""
        if self._kv is None or seq <= 0:
            return 0
        try:
            entry = await self._kv.get(self._key(model, seq))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return 0
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("reading poison evidence for %s/%s failed: %r", model, seq, exc)
            return 0
        try:
            return int((entry.value or b"0").decode())
        except ValueError:
            return 0

    def verdict(self, deliveries: int, crashes: int) -> Verdict:
        if self.max_deliver > 1 and crashes >= self.max_deliver - 1:
            return Verdict.CULPRIT
        if deliveries >= give_up_after(self.max_deliver):
            return Verdict.GIVE_UP
        return Verdict.RUN_ALONE

    async def begin(self, model: str, seq: int, crashes: int) -> None:
        """Record that this message starts running alone (before it runs)."""
        if self._kv is None or seq <= 0:
            return
        try:
            await self._kv.put(self._key(model, seq), str(crashes + 1).encode())
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("recording the alone run of %s/%s failed: %r", model, seq, exc)

    async def clear(self, model: str, seq: int) -> None:
        """The message completed (answered): its record is no evidence any more."""
        if self._kv is None or seq <= 0:
            return
        try:
            await self._kv.purge(self._key(model, seq))
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            pass  # the bucket's TTL forgets it
