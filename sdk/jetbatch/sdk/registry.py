"""Whether a model is registered, asked before the first request to it.

The models stream takes every model's subject (two wildcards, so its size does not grow with
the number of models: docs/scaleout.md), so it no longer refuses a publish for a model nobody
serves. The workers write each model they register into a key-value bucket
(``Subjects.registry_bucket``), and a producer that sends straight to a model (and the classifier,
for the model it routed to) reads that model's key with one direct get before its first request:
absent is ``UnknownModel`` at once, as the explicit subject list's refusal was.

A model found registered is remembered for the client's life (a model leaving every worker's
config is the workers' orphan check's case, docs/reliability.md). A registry that cannot be read
(a deployment older than it, a server without the permission, no answer in time) says "cannot
tell": the request is sent, and the models stream's own refusal, where it still has one, decides.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from . import failures
from .protocol import ProtocolError, Subjects

__all__ = ["RegisteredModels"]

# Models remembered as registered; past this the memory starts over (a lookup each again).
_MAX_REMEMBERED = 100_000
# A lookup's own bound (within the caller's deadline): the registry is one direct get away.
_LOOKUP_S = 1.0
# After a registry that could not be read, how long requests go out without asking it.
_UNREADABLE_S = 30.0


class RegisteredModels:
    """One client's view of the registry: :meth:`check` a model before sending to it."""

    def __init__(self, js: Any, subjects: Subjects) -> None:
        self._js = js
        self._subjects = subjects
        self._known: set[str] = set()
        self._unreadable_until = -1.0

    def remembers(self, model: str) -> bool:
        """Whether ``model`` was found registered before (no lookup)."""
        return model in self._known

    async def check(self, model: str, timeout_s: float) -> bool | None:
        """True: registered; False: the registry is there and does not name ``model``; None:
        cannot tell (no registry, no permission to read it, or no answer within ``timeout_s``)."""
        if model in self._known:
            return True
        if time.monotonic() < self._unreadable_until:
            return None
        bound_s = max(0.001, min(timeout_s, _LOOKUP_S))
        try:
            entry = await asyncio.wait_for(
                self._js.get_msg(self._subjects.registry_stream, subject=self._subjects.registry_key(model), direct=True), bound_s
            )
        except failures.NOT_FOUND:
            return False  # the bucket answered: no such key
        except failures.TIMEOUTS:
            if bound_s >= _LOOKUP_S:  # not merely a caller with little time left
                self._unreadable_until = time.monotonic() + _UNREADABLE_S
            return None
        except failures.TRANSPORT_ERRORS:
            self._unreadable_until = time.monotonic() + _UNREADABLE_S
            return None
        if (entry.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            return False
        if len(self._known) >= _MAX_REMEMBERED:
            self._known.clear()
        self._known.add(model)
        return True

    async def unregistered(self, models: Iterable[str], timeout_s: float) -> set[str]:
        """Which of ``models`` the registry does not name: one lookup for each not found before,
        together (none when every one was); an invalid name, or a registry that cannot be read,
        is not among them (the caller refuses an invalid name on its own)."""

        async def check(model: str) -> bool | None:
            try:
                return await self.check(model, timeout_s)
            except ProtocolError:
                return None

        names = [model for model in models if not self.remembers(model)]
        checked = await asyncio.gather(*(check(model) for model in names))
        return {model for model, registered in zip(names, checked) if registered is False}
