"""Answering orphaned queues: requests stored for a model no live worker registers
(``worker/orphans.py`` says when a queue is due) are answered ``unknown_model`` by a task of
their own, off the serve loop: its fetches and stores must not hold the worker's turns.

A model the model registry (``registry.py``) does not name at all was never registered by any
worker: its requests (sent by a producer that skipped the registry's lookup, such as an older
SDK or a bare NATS client, which the models stream's wildcards take) are answered at once, not
after the grace, and whether or not this worker hears its peers."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection
from typing import Any

import anyio

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import ErrorCode, Priority, ProtocolError, Subjects

from ..config import StreamsConfig
from ..errors import TRANSPORT_ERRORS
from ..replies import Answer
from ..streams import StreamSetupError, ensure_model_consumer, model_consumer_name
from .execution import BatchRunner
from .orphans import Orphans
from .queues import QueueView

__all__ = ["ORPHAN_BATCH", "ORPHAN_FETCH_S", "ORPHAN_WARN_EVERY_S", "OrphanAnswers"]

log = logging.getLogger("jetbatch.worker")

# An orphaned queue is answered this many requests a line a count, each fetch waiting at most
# this long (what the count said is stored is there at once).
ORPHAN_BATCH = 64
ORPHAN_FETCH_S = 0.5
ORPHAN_WARN_EVERY_S = 60.0


class OrphanAnswers:
    """Warns of unregistered models' queues and answers the ones due (``run`` is its task)."""

    def __init__(self, js: Any, subjects: Subjects, streams: StreamsConfig, *, queues: QueueView, runner: BatchRunner, grace_s: float | None) -> None:
        self.js = js
        self.subjects = subjects
        self.streams = streams
        self.queues = queues
        self.runner = runner
        self.orphans = Orphans(grace_s)
        self._due: set[str] = set()
        # Stored, unregistered models looked up in the model registry: whether it names them
        # (a model it does not name is answered at once); and those to look up.
        self._in_registry: dict[str, bool] = {}
        self._lookups: set[str] = set()
        self._wake = anyio.Event()
        self._warned_at = -math.inf

    @property
    def watched(self) -> bool:
        """Whether some unregistered queue is being watched (counted toward its grace)."""
        return bool(self.orphans.watched)

    def check(self, now: float, registered: set[str]) -> None:
        """After a count: warn of the unregistered queues, and hand the ones due to the task."""
        due = self.orphans.due(self.queues.unregistered, registered, now)
        self._warn(now)
        if due:
            self._due.update(due)
            self._wake.set()

    def check_registry(self, peers: Collection[str]) -> None:
        """After a count: the unregistered queues the registry does not name are due now; the
        ones not looked up yet are handed to the task to look up. ``peers``: models live peers
        are known to register, left alone whatever the registry says."""
        stored = {m: n for m, n in self.queues.unregistered.items() if m not in peers}
        for model in [m for m in self._in_registry if m not in stored]:
            del self._in_registry[model]  # answered or gone: looked up again if it comes back
        never = {m for m in stored if self._in_registry.get(m) is False}
        fresh = {m for m in stored if m not in self._in_registry}
        if never or fresh:
            self._due.update(never)
            self._lookups.update(fresh)
            self._wake.set()

    async def _named_in_registry(self, model: str) -> bool | None:
        """Whether the model registry names ``model`` (None: it did not answer, or the name is
        none a worker could register, which the grace leaves to the warning)."""
        try:
            await self.js.get_msg(self.subjects.registry_stream, subject=self.subjects.registry_key(model), direct=True)
        except failures.NOT_FOUND:
            return False
        except TRANSPORT_ERRORS + (ProtocolError,):
            return None
        return True

    def _warn(self, now: float) -> None:
        """Say at once, and once a minute after, which models have requests stored that no live
        worker registers: they wait for one (or for ``worker.orphan_grace_s``)."""
        waiting = self.orphans.unregistered_since()
        if not waiting or now - self._warned_at < ORPHAN_WARN_EVERY_S:
            return
        self._warned_at = now
        grace = self.orphans.grace_s
        then = "never answered by a worker that does not register them" if grace is None else f"answered unknown_model after {grace:g} s"
        for model, since in sorted(waiting.items()):
            log.warning(
                "model %s: %d requests stored for %.0f s and no live worker registers it (%s)",
                model, self.queues.unregistered.get(model, 0), now - since, then,
            )  # fmt: skip

    async def run(self) -> None:
        """Answer the queues :class:`Orphans` found due, a model at a time, off the serve loop."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            lookups, self._lookups = sorted(self._lookups), set()
            for model in lookups:
                named = await self._named_in_registry(model)
                if named is not None:
                    self._in_registry[model] = named
                if named is False:
                    self._due.add(model)
            due, self._due = sorted(self._due), set()
            for model in due:
                try:
                    await self._answer(model)
                except Exception as exc:  # noqa: BLE001 - the next count tries again; serving goes on
                    log.warning("answering model %s's orphaned queue failed: %r", model, exc)

    async def _answer(self, model: str) -> None:
        """Answer ``unknown_model`` to a batch of each line of ``model``'s queue that holds
        requests, which no live worker registers (worker/orphans.py): through its shared consumer
        (made if it expired), so workers doing the same at once answer each request once. One
        batch a line a count: a deep queue drains over a few counts."""
        bulk = self.queues.unregistered_bulk.get(model, 0)
        lines = {Priority.INTERACTIVE: self.queues.unregistered.get(model, 0) - bulk, Priority.BATCH: bulk}
        for priority in [p for p, n in lines.items() if n > 0]:  # an empty line's fetch would wait its whole timeout
            consumer = model_consumer_name(model, priority)
            try:
                await ensure_model_consumer(self.js, self.subjects, self.streams, model, priority)
                psub = await self.js.pull_subscribe_bind(consumer, stream=self.subjects.models_stream)
            except TRANSPORT_ERRORS + (StreamSetupError,) as exc:
                log.debug("orphaned queue %s: no consumer: %r", consumer, exc)
                continue
            try:
                try:
                    msgs = await psub.fetch(ORPHAN_BATCH, timeout=ORPHAN_FETCH_S)
                except TRANSPORT_ERRORS + failures.TIMEOUTS:
                    continue
                now = time.time()
                requests = [self.runner.parse(m, now) for m in msgs]
                for r in requests:
                    r.action = "term"
                    why = "no worker has ever registered it" if self._in_registry.get(model) is False else f"none has registered it for {self.orphans.grace_s or 0:g} s"
                    r.answer = Answer.failure(r.meta, ErrorCode.UNKNOWN_MODEL, f"no worker serves model {model!r} ({why})", {})
                if requests:
                    log.warning("answered %d requests for model %s unknown_model: no live worker registers it", len(requests), model)
                    await self.runner.finish(model, requests)
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        await psub.unsubscribe()
                    except TRANSPORT_ERRORS + (ValueError,):
                        pass
