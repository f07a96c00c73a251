"""Admission: refuse a request with ``Overloaded`` at once when what waits ahead of it cannot be
served within its remaining time by the workers that serve its model (docs/reliability.md,
"Backpressure").

The facts come from the workers' adverts, which every worker already puts into the
``<STREAMS>_WORKERS`` key-value bucket each heartbeat: per model, the backlog it sees, what it
holds in flight and how many requests/s it drains. A KV put is a plain publish on
``$KV.<bucket>.<key>``, so a core-NATS subscription there receives every advert live: no
JetStream consumer, no request a call. A caller without permission to subscribe there has no
view and admits everything (the server's stream limits still apply).

Between two adverts the view counts the requests this process admitted, so a burst is seen
before the next heartbeat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .protocol import Subjects

__all__ = ["ADMIT_FRACTION", "Admission", "ModelLoad", "follow_adverts", "wait_estimate_s"]

# A request is admitted while the wait ahead of it is at most this share of its remaining time:
# the rest covers its own batch, an advert up to a heartbeat old and other producers' bursts.
ADMIT_FRACTION = 0.5

# Keys of the workers' bucket that are load claims, not adverts (sidecar/cluster.py).
_CLAIM_PREFIX = "claim."
# An advert that says nothing of how long it holds is dropped after this long unheard.
_DEFAULT_VALID_S = 5.0


class _Advert(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a worker's ``SidecarReport`` that admission reads (the rest is skipped)."""

    role: str = ""
    backlog: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    drain_rps: dict[str, float] = {}
    valid_s: float = 0.0


_decoder = msgspec.json.Decoder(_Advert)


@dataclass(frozen=True)
class ModelLoad:
    """One model's queue as the adverts tell it: ``waiting`` requests not yet fetched (the
    largest backlog any worker sees: they count the same stream), ``in_flight`` held by the
    workers, ``drain_rps`` the sum of the workers' drain rates, ``heard_at`` when the latest
    advert came (monotonic seconds)."""

    waiting: int
    in_flight: int
    drain_rps: float
    heard_at: float


def wait_estimate_s(load: ModelLoad, admitted_since: int, now: float) -> float:
    """Seconds until the workers reach a request admitted ``now``: what was ahead at the last
    advert, less what they drained since, plus the ``admitted_since`` requests sent after it,
    at ``drain_rps``. Infinite for a model with backlog and no drain rate advertised."""
    drained = load.drain_rps * max(now - load.heard_at, 0.0)
    ahead = max(load.waiting + load.in_flight - drained, 0.0) + admitted_since
    if load.drain_rps <= 0:
        return 0.0 if ahead <= 0 else float("inf")
    return ahead / load.drain_rps


@dataclass
class Admission:
    """The adverts' view of each model's queue and the admission rule. Fed by :meth:`on_advert`
    (a subscription to the adverts bucket); :meth:`refusal` is a dict lookup and a division."""

    fraction: float = ADMIT_FRACTION
    _adverts: dict[str, tuple[float, _Advert]] = field(default_factory=dict)
    _loads: dict[str, ModelLoad] = field(default_factory=dict)
    _admitted: dict[str, int] = field(default_factory=dict)

    def on_advert(self, key: str, data: bytes, deleted: bool, now: float | None = None) -> None:
        """One message of the adverts bucket: a worker's advert under ``key`` (its id), or its
        withdrawal (``deleted``, or an empty value). Unreadable adverts are ignored."""
        if key.startswith(_CLAIM_PREFIX):
            return
        now = time.monotonic() if now is None else now
        if deleted or not data:
            self._adverts.pop(key, None)
        else:
            try:
                advert = _decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return  # not an advert this SDK reads: it tells nothing about queues
            if advert.role != "worker":
                return
            self._adverts[key] = (now, advert)
        self._rebuild(now)

    def _rebuild(self, now: float) -> None:
        live = {k: (at, a) for k, (at, a) in self._adverts.items() if now - at <= (a.valid_s or _DEFAULT_VALID_S)}
        self._adverts = live
        loads: dict[str, ModelLoad] = {}
        for at, advert in live.values():
            for model in set(advert.backlog) | set(advert.drain_rps):
                prev = loads.get(model)
                waiting = advert.backlog.get(model, 0)
                in_flight = advert.in_flight.get(model, 0)
                drain = max(advert.drain_rps.get(model, 0.0), 0.0)
                if prev is not None:
                    waiting, in_flight, drain = max(waiting, prev.waiting), in_flight + prev.in_flight, drain + prev.drain_rps
                    at = max(at, prev.heard_at)
                loads[model] = ModelLoad(waiting, in_flight, drain, at)
        for model, load in loads.items():
            old = self._loads.get(model)
            if old is None or load.heard_at > old.heard_at:
                self._admitted.pop(model, None)  # the fresh advert counts what we sent before it
        self._loads = loads

    def known(self, model: str) -> bool:
        """Whether an advert gave ``model`` a drain rate: admission applies to it."""
        load = self._loads.get(model)
        return load is not None and load.drain_rps > 0

    def drain_rps(self, model: str) -> float:
        """The requests/s the adverts say ``model``'s workers drain together (0: not known)."""
        load = self._loads.get(model)
        return 0.0 if load is None else load.drain_rps

    def refusal(self, model: str, remaining_s: float, now: float | None = None) -> str | None:
        """Why a request for ``model`` with ``remaining_s`` left is refused, or None to admit it
        (then counted as sent). A model no advert speaks of, or with none drain, is admitted:
        nobody serves it yet and a load will come, or the view is not there."""
        load = self._loads.get(model)
        if load is None:
            return None
        now = time.monotonic() if now is None else now
        if now - load.heard_at > _DEFAULT_VALID_S:
            self._rebuild(now)  # every advert of it went silent: forget them
            load = self._loads.get(model)
            if load is None:
                return None
        if load.drain_rps <= 0:
            return None
        admitted = self._admitted.get(model, 0)
        wait_s = wait_estimate_s(load, admitted, now)
        if wait_s > self.fraction * remaining_s:
            return (
                f"model {model!r} is overloaded: about {wait_s:.2f}s of queue ahead "
                f"({load.drain_rps:.1f} req/s drained), more than {self.fraction:g} of the {remaining_s:.2f}s left"
            )
        self._admitted[model] = admitted + 1
        return None


async def follow_adverts(nc: Any, subjects: Subjects, admission: Admission) -> Any:
    """Subscribe ``admission`` to the workers' adverts under ``subjects`` on connection ``nc``
    (core NATS: a caller not allowed to subscribe there gets a permissions error from the server,
    no view, and admits everything). Returns the subscription."""
    skip = len(subjects.adverts) - 1  # "$KV.<bucket>." before the key

    async def on_advert(msg: Any) -> None:
        deleted = (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE")
        admission.on_advert(msg.subject[skip:], msg.data, deleted)

    return await nc.subscribe(subjects.adverts, cb=on_advert)
