"""Each worker's registered models in its adverts: a digest every heartbeat, the names only when
a peer may not know them.

An advert (``SidecarReport``) is put every heartbeat and decoded by every peer; with ten
thousand registered models, naming each one every time was 6% of a worker's samples and most
of the bytes on the bucket. The set changes only when a worker restarts with another config, so
each advert carries ``models_digest`` (a hash of the sorted names) and ``models_count``, and
``models`` itself only when the set changed, when a peer this worker had not heard joins the
view (it knows nothing of the set yet), and every :data:`FULL_MODELS_EVERY_S` (a peer that
missed one, and a reader of an older version, which takes ``models`` as the whole set: its
orphan check starts its grace over at each full advert). A reader keeps the last names heard
with their digest; an advert whose digest is not the one kept leaves the set unknown until the
names come, and a caller that needs every peer's set (the orphan check) decides nothing then.
Names that would not fit the server's ``max_payload`` are left out (:meth:`Shipping.encode`).

Pure: no I/O, the time passed in.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable

import msgspec

from jetbatch.sdk.protocol import SidecarReport

__all__ = ["FULL_MODELS_EVERY_S", "KnownSets", "Shipping", "models_digest"]

# How often an advert names every registered model even when no peer is new to it.
FULL_MODELS_EVERY_S = 30.0
# Room in a put for the headers and the protocol line beside an advert's body.
_ADVERT_HEADROOM_BYTES = 4096

log = logging.getLogger("jetbatch.cluster")
_encoder = msgspec.json.Encoder()


def models_digest(names: Iterable[str]) -> str:
    """A digest of a set of model names: the same set gives the same digest on any worker."""
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(names):
        h.update(name.encode())
        h.update(b"\n")
    return h.hexdigest()


class Shipping:
    """The writer's side: whether the next advert names every model (:meth:`due`)."""

    def __init__(self, every_s: float = FULL_MODELS_EVERY_S) -> None:
        self.every_s = every_s
        self._sent_digest: str | None = None  # the digest of the names last put
        self._sent_at = -math.inf
        self._newcomer = True  # a peer joined the view since the names were last put
        self._digest: tuple[list[str], str] | None = None  # the names' list last hashed, and its digest
        self._too_many = False  # said once: the names did not fit an advert

    def encode(self, advert: SidecarReport, names: list[str], now: float, max_payload: int) -> tuple[bytes, tuple[str, float, bool]]:
        """``advert``'s bytes with the digest and count of ``names`` (a list the caller keeps:
        hashed once), naming them when :meth:`due` and when they fit ``max_payload``; and what
        to pass to :meth:`sent` once it is put."""
        if self._digest is None or self._digest[0] is not names:
            self._digest = (names, models_digest(names))
        digest = self._digest[1]
        full = self.due(digest, now)
        advert = msgspec.structs.replace(advert, models=list(names) if full else [], models_digest=digest, models_count=len(names))
        data = _encoder.encode(advert)
        if full and len(data) > max_payload - _ADVERT_HEADROOM_BYTES:
            # Names past the server's max_payload (some 25 000 of 40 characters on a default
            # server): a put that fails each heartbeat would silence this worker for good. Its
            # peers keep its set unknown, which holds back their orphan check, nothing else.
            if not self._too_many:
                log.warning("this worker's %d registered model names do not fit an advert (max_payload %d): peers will not know them", len(names), max_payload)
            self._too_many = True
            data = _encoder.encode(msgspec.structs.replace(advert, models=[]))
        return data, (digest, now, full)

    def newcomer(self) -> None:
        """A peer this worker had not heard (or a restarted one) joined the view."""
        self._newcomer = True

    def due(self, digest: str, now: float) -> bool:
        """Whether the advert about to be put names every model."""
        return self._newcomer or digest != self._sent_digest or now - self._sent_at >= self.every_s

    def sent(self, digest: str, now: float, full: bool) -> None:
        """An advert was put (``full``: it named every model)."""
        if full:
            self._sent_digest, self._sent_at, self._newcomer = digest, now, False


class KnownSets:
    """The reader's side: each peer's registered set, as last named with its digest."""

    def __init__(self) -> None:
        self._sets: dict[str, tuple[str, frozenset[str]]] = {}  # worker -> (digest, names)

    def heard(self, worker: str, advert: SidecarReport) -> None:
        """``worker`` put ``advert``: keep its names when it carries them."""
        if advert.models or not advert.models_digest:
            # Named (or an older worker's advert, which always names them all).
            known = self._sets.get(worker)
            if known is None or known[0] != advert.models_digest or not advert.models_digest:
                self._sets[worker] = (advert.models_digest, frozenset(advert.models))
        elif worker in self._sets and self._sets[worker][0] != advert.models_digest:
            del self._sets[worker]  # its set changed: unknown until the names come

    def forget(self, worker: str) -> None:
        self._sets.pop(worker, None)

    def of(self, worker: str, advert: SidecarReport) -> frozenset[str] | None:
        """The models ``worker`` (whose last advert is ``advert``) registers; None: not known yet."""
        known = self._sets.get(worker)
        if known is None or known[0] != advert.models_digest:
            return None
        return known[1]
