"""Requests stored for a model that no live worker registers: answered ``unknown_model``.

The models stream takes every model's subject (two wildcards) and the model registry keeps every
name a worker once registered (``registry.py``), so a model taken out of every worker's config
keeps taking requests that no consumer will ever fetch: its callers waited out their timeouts
and the requests stayed stored for good, with no answer, no dead letter and nothing in any log.
(A model the registry never named is answered at once: ``orphan_answers.py``.) Every worker counts every
queue (``QueueView.refresh``); one that sees requests stored for a model neither it nor any
live peer registers (its advert's ``models``) says so at once (a warning a minute), and after
``worker.orphan_grace_s`` (10 minutes) in a row answers them ``unknown_model``. The grace rides
out a rolling restart or a scale-up from zero, where a model's only workers are gone for a while
and their peers must leave its queue alone; a stale view of the peers (a lost node)
keeps every peer last heard, so it counts as registered, and a worker that does not hear its
peers at all (coordination off, or its own advert not heard lately) answers nothing: a live
peer's models would look unregistered to it. Several workers may answer the same queue at once:
they share its consumer, so each request is answered once.

Pure: the caller passes the counts, the registered models and the time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["DEFAULT_ORPHAN_GRACE_S", "Orphans"]

DEFAULT_ORPHAN_GRACE_S = 600.0


class Orphans:
    """Which unregistered models' queues are due to be answered ``unknown_model``."""

    def __init__(self, grace_s: float | None = DEFAULT_ORPHAN_GRACE_S) -> None:
        self.grace_s = grace_s
        self._since: dict[str, float] = {}  # model -> when it was first seen stored and unregistered

    def due(self, stored: Mapping[str, int], registered: Collection[str], now: float) -> list[str]:
        """The models whose stored requests (``stored``: count per model) no live worker has
        registered for ``grace_s`` as of ``now``, in name order (none with no grace)."""
        for model in [m for m in self._since if stored.get(m, 0) <= 0 or m in registered]:
            del self._since[model]  # answered, gone, or registered again: the clock starts over
        for model, count in stored.items():
            if count > 0 and model not in registered:
                self._since.setdefault(model, now)
        if self.grace_s is None:
            return []
        return sorted(m for m, since in self._since.items() if now - since >= self.grace_s)

    def unregistered_since(self) -> dict[str, float]:
        """Each model with requests stored and no live worker registering it: since when."""
        return dict(self._since)

    @property
    def watched(self) -> int:
        """How many unregistered models have requests stored (due or not)."""
        return len(self._since)
