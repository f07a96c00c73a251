"""Fair shares and quotas between tenants: which line a tenant's request joins, and whether its
quota refuses it (docs/tenancy.md).

The models stream keeps each model's queue in two FIFO lines, interactive and batch, and a worker
fills a batch from the interactive line first and weighs a model's interactive requests above its
batch ones (docs/protocol.md, ``policy/cost_aware.py``). The line is where a request's turn is
set without a consumer per (model, tenant) (docs/scaleout.md, "Tenants"): while arrivals outrun
service, each tenant sending gets a fair rate, the measured service rate shared by weighted
max-min fairness; what a tenant sends within it keeps its class, what it sends beyond it joins
the batch line. The worker still serves that line whenever the interactive lines are empty (work
conserving: a tenant alone gets everything), so a flooding tenant delays its own excess, not the
others' requests, and the models only it floods weigh as batch work in the scheduler's choice.

A token bucket per tenant fills at its fair rate and holds at most ``credit_s`` of it: a tenant
idle for a while banks no more than that. With fewer than two tenants sending, or while service
keeps up with arrivals, nothing changes: decisions are those of a deployment without tenants.

Sans-I/O, as the worker core: times come in as arguments, verdicts go out. The classifier (live)
and the simulator's admission (``simulator/engine.py``) call the same :class:`TenantShares`, fed
the same two facts: each admitted request, and each batch of requests served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import msgspec

from .config import TenantsConfig

__all__ = ["NO_TENANT", "ServiceFeed", "TenantShares", "Verdict", "fair_levels", "fair_rates", "shaped_rates"]

NO_TENANT = "_"  # the share of requests that name no tenant (the untenanted ingress)
# How much faster than service arrivals must run (over ``window_s``) before shares apply: an
# estimate of a steady load sits near 1 either side of it.
_SATURATED = 1.05
# A tenant is shaped only while it sends this much more than its fair level.
_OVER = 1.25
# Fair rates are computed again at most this often (a walk over the tenants sending).
_RECOMPUTE_S = 0.2
# Tenants tracked at most; past it the quietest is forgotten (a hostile set of names cannot grow
# the table: a tenant's name comes from a subject the server's permissions bind to a user).
_MAX_TENANTS = 10_000


@dataclass(frozen=True)
class Verdict:
    """What admission does with one request: ``refused`` (a quota's reason, answered
    ``Overloaded``), else ``demoted`` (an interactive request beyond its tenant's fair share joins
    the batch line)."""

    demoted: bool = False
    refused: str | None = None


ADMIT = Verdict()
DEMOTE = Verdict(demoted=True)


class _Rate:
    """An exponentially weighted rate (events per second) over a time constant ``tau_s``."""

    __slots__ = ("value", "at")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = -math.inf

    def now(self, now: float, tau_s: float) -> float:
        if self.at == -math.inf or now <= self.at:
            return self.value
        return self.value * math.exp(-(now - self.at) / tau_s)

    def add(self, n: float, now: float, tau_s: float) -> None:
        self.value = self.now(now, tau_s) + n / tau_s
        self.at = max(now, self.at)


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at

    def take(self, rate: float, cap: float, now: float) -> bool:
        """Refill at ``rate`` up to ``cap``, then take one token if there is one."""
        if now > self.at:
            self.tokens = min(cap, self.tokens + rate * (now - self.at))
            self.at = now
        self.tokens = min(self.tokens, cap)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def fair_rates(pool: float, demand: Mapping[str, float], weight: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair split of ``pool`` between tenants asking ``demand``: a tenant asking
    less than its weighted share gets what it asks, the rest is shared again among the others by
    weight. Every tenant in ``demand`` gets an entry; the sum never exceeds ``pool``."""
    return {t: min(demand[t], level) for t, level in fair_levels(pool, demand, weight).items()}


def fair_levels(pool: float, demand: Mapping[str, float], weight: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's level in the weighted max-min split of ``pool``: what it could get. Above
    its demand for a tenant asking less than its share (its :func:`fair_rates` is its demand),
    so a tenant sending steadily near its own rate is not caught by the noise of its arrivals."""
    out: dict[str, float] = {}
    left, weights = pool, sum(weight[t] for t in demand)
    for tenant in sorted(demand, key=lambda t: (demand[t] / weight[t], t)):
        out[tenant] = left * weight[tenant] / weights if weights > 0 else 0.0
        left -= min(demand[tenant], out[tenant])
        weights -= weight[tenant]
    return out


def shaped_rates(pool: float, batch_line: float, demand: Mapping[str, float], weight: Mapping[str, float]) -> dict[str, float]:
    """The token rates of the shaped tenants: ``pool`` req/s of interactive service between them,
    ``batch_line`` more carrying their excess first come, first served, so each tenant's part of
    that line is its part of all the excess. Rates are chosen so that what each gets in all, its
    tokens plus its part of the line, is its weighted max-min level of ``pool + batch_line``.

    With ``x`` a tenant's excess (demand less rate), ``X`` all of it (the demand less ``pool``)
    and ``L`` the line, a tenant gets ``d - x + L x / X``; setting that to its level ``g`` gives
    ``x = (d - g) X / (X - L)``. One shaped tenant gets ``pool`` (its level is all there is).
    Splitting ``pool`` by weight alone left a 3:1 split at 0.66 of service, not 0.75: the line
    carried more of the lighter tenant's larger excess."""
    total = sum(demand.values())
    excess, line = total - pool, max(0.0, batch_line)
    levels = fair_levels(pool + line, demand, weight)
    if excess <= line + 1e-9:
        return fair_levels(pool, demand, weight)  # all of it fits: nothing to correct for
    scale = excess / (excess - line)
    rates = {t: min(d, max(0.0, d - max(0.0, d - levels[t]) * scale)) for t, d in demand.items()}
    # A tenant whose excess alone outweighs its level is held at no tokens: the others' rates,
    # then over the pool, are scaled back into it (the line then favours them a little).
    spent = sum(rates.values())
    if spent > pool > 0:
        rates = {t: r * pool / spent for t, r in rates.items()}
    return rates


class TenantShares:
    """The tenants' shares and quotas of one admission point (a classifier replica, or the
    simulator's admission). Feed it :meth:`served` for each batch served; ask :meth:`admit` for
    each request, with the time and, where known, how many of its tenant's requests wait."""

    def __init__(self, config: TenantsConfig) -> None:
        self.config = config
        self._demand: dict[str, _Rate] = {}
        self._service = _Rate()
        self._shares: dict[str, _Bucket] = {}
        self._quotas: dict[str, _Bucket] = {}
        self._fair: dict[str, float] = {}  # tenant -> its token rate (req/s, fair_levels) while saturated
        self._fair_at = -math.inf
        self.saturated = False
        self.demoted: dict[str, int] = {}  # per tenant, requests sent to the batch line
        self.refused: dict[str, int] = {}  # per tenant, requests refused by a quota

    def served(self, n: int, now: float) -> None:
        """``n`` requests were served (answered from a batch) at ``now``."""
        if n > 0:
            self._service.add(n, now, self.config.window_s)

    def admit(self, tenant: str | None, now: float, *, interactive: bool = True, waiting: int | None = None) -> Verdict:
        """The verdict on one request of ``tenant`` (None: untenanted) arriving at ``now``;
        ``waiting``: how many of the tenant's requests wait already (None: not known, its
        ``max_waiting`` quota is not checked)."""
        name = tenant or NO_TENANT
        cfg = self.config
        limit = cfg.waiting_quota(name) if tenant else None
        if limit is not None and waiting is not None and waiting >= limit:
            return self._refuse(name, f"tenant {name!r} has {waiting} requests waiting, its quota is {limit}")
        rps = cfg.rps_quota(name) if tenant else None
        if rps is not None:
            bucket = self._quotas.get(name)
            if bucket is None:
                bucket = self._quotas[name] = _Bucket(max(1.0, rps), now)
            if not bucket.take(rps, max(1.0, rps), now):
                return self._refuse(name, f"tenant {name!r} is over its quota of {rps:g} requests/s")
        rate = self._demand.get(name)
        if rate is None:
            if len(self._demand) >= _MAX_TENANTS:
                self._forget_quietest(now)
            rate = self._demand[name] = _Rate()
        rate.add(1, now, cfg.window_s)
        if now - self._fair_at >= _RECOMPUTE_S:
            self._recompute(now)
        if not interactive or not self.saturated:
            return ADMIT
        fair = self._fair.get(name)
        if fair is None:
            return ADMIT  # within its share, or first heard since the last recompute
        cap = max(1.0, fair * cfg.credit_s)
        bucket = self._shares.get(name)
        if bucket is None:
            bucket = self._shares[name] = _Bucket(cap, now)
        if bucket.take(fair, cap, now):
            return ADMIT
        _count(self.demoted, name)
        return DEMOTE

    def fair_rps(self) -> dict[str, float]:
        """The token rate of each tenant shaped at the last recompute (over its fair level while
        saturated); the others are not shaped."""
        return dict(self._fair) if self.saturated else {}

    def demand_rps(self, now: float) -> dict[str, float]:
        return {t: r.now(now, self.config.window_s) for t, r in self._demand.items()}

    def _refuse(self, name: str, reason: str) -> Verdict:
        _count(self.refused, name)
        return Verdict(refused=reason)

    def _recompute(self, now: float) -> None:
        self._fair_at = now
        tau = self.config.window_s
        demand = {t: r.now(now, tau) for t, r in self._demand.items()}
        # A tenant whose rate decayed below one request a window is no longer sending.
        for t in [t for t, d in demand.items() if d * tau < 0.5]:
            del demand[t], self._demand[t]
            self._shares.pop(t, None)
            self._quotas.pop(t, None)  # refilled to its burst after a second anyway
        service = self._service.now(now, tau)
        self.saturated = len(demand) >= 2 and sum(demand.values()) > _SATURATED * service > 0
        if not self.saturated:
            self._fair = {}
            self._shares.clear()  # buckets start full at the next saturation
            return
        weights = {t: self.config.weight(t) for t in demand}
        levels = fair_levels(service, demand, weights)
        total_d, total_w = sum(demand.values()), sum(weights.values())
        # Only a tenant well over its level, and sending well over its weight's part of all that
        # is sent, is shaped: one near them is the noise of a steady rate, or of a service rate
        # measured low while the worker moves between models. It is shaped to less than its
        # level, so the interactive lines keep headroom to drain.
        over = {t for t, lv in levels.items() if demand[t] > _OVER * lv and demand[t] / total_d > _OVER * weights[t] / total_w}
        if not over:
            self._fair = {}
            return
        # The shaped tenants share what the interactive lines may carry with headroom
        # (``share_of_service``), after what the others send: a worker gives the batch line one
        # batch in BATCH_LINE_EVERY while both wait (policy/window.py), so interactive work over
        # 7/8 of service would grow without bound. When the others alone send more than that
        # (weights 3:1, both saturating), those over their level are shaped too, most over first.
        budget = self.config.share_of_service * service
        rest = sorted((t for t in demand if t not in over and demand[t] > _OVER * levels[t]), key=lambda t: demand[t] / weights[t], reverse=True)
        while rest and sum(d for t, d in demand.items() if t not in over) > budget:
            over.add(rest.pop(0))
        pool = max(0.0, budget - sum(d for t, d in demand.items() if t not in over))
        self._fair = shaped_rates(pool, service - budget, {t: demand[t] for t in over}, weights)
        for t in [t for t in self._shares if t not in self._fair]:
            del self._shares[t]

    def _forget_quietest(self, now: float) -> None:
        tau = self.config.window_s
        quietest = min(self._demand, key=lambda t: self._demand[t].now(now, tau))
        del self._demand[quietest]
        self._shares.pop(quietest, None)
        self._quotas.pop(quietest, None)


def _count(counts: dict[str, int], name: str) -> None:
    """One more for ``name``, the table bounded as the tenants are (past it, ``_other``)."""
    if name not in counts and len(counts) >= _MAX_TENANTS:
        name = "_other"
    counts[name] = counts.get(name, 0) + 1


class _Served(msgspec.Struct, frozen=True):
    """The fields of a worker's advert the service feed reads (the rest is skipped)."""

    role: str = ""
    stats: dict[str, int] = {}
    tenant_backlog: dict[str, int] = {}
    valid_s: float = 0.0


_served_decoder = msgspec.json.Decoder(_Served)
_CLAIM_PREFIX = "claim."  # keys of the workers' bucket that are load claims, not adverts
_MAX_WORKERS = 10_000
_MAX_TENANT_COUNTS = 64  # tenants an advert may name (the worker sends the most waiting)
_DEFAULT_VALID_S = 5.0  # an advert that says nothing of how long it holds


class ServiceFeed:
    """What the workers served and what waits, from their adverts: each carries its running count
    of requests served (``stats.requests``), fed to :meth:`TenantShares.served`, and how many
    requests each tenant has waiting (``tenant_backlog``), which :meth:`waiting` answers for a
    ``max_waiting`` quota. The first advert of a worker sets its baseline; a count that went down
    is a restarted worker, counted from 0. Unreadable adverts are ignored."""

    def __init__(self, shares: TenantShares) -> None:
        self.shares = shares
        self._last: dict[str, int] = {}
        # Per worker: when its advert came, how long it holds, each tenant's waiting requests.
        self._waiting: dict[str, tuple[float, float, dict[str, int]]] = {}
        self._admitted: dict[str, int] = {}  # per tenant, admitted since the last advert

    def waiting(self, tenant: str | None, now: float) -> int:
        """The requests of ``tenant`` waiting: the most any live advert counts (workers count the
        same queues) and what was admitted since the last advert."""
        name = tenant or ""
        counted = max((w.get(name, 0) for at, valid_s, w in self._waiting.values() if now - at <= valid_s), default=0)
        return counted + self._admitted.get(name, 0)

    def admitted(self, tenant: str | None) -> None:
        """A request of ``tenant`` was admitted: it waits until an advert counts it."""
        name = tenant or ""
        self._admitted[name] = self._admitted.get(name, 0) + 1

    def on_advert(self, key: str, data: bytes, deleted: bool, now: float | None = None) -> None:
        """One message of the adverts bucket (as ``jetbatch.sdk.admission.follow_adverts`` hands
        it); ``now``: the classifier's clock (monotonic seconds)."""
        if key.startswith(_CLAIM_PREFIX):
            return
        if deleted or not data:
            self._last.pop(key, None)
            self._waiting.pop(key, None)
            return
        try:
            advert = _served_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        count = advert.stats.get("requests")
        if advert.role != "worker" or not isinstance(count, int) or count < 0:
            return
        before = self._last.get(key)
        if before is None and len(self._last) >= _MAX_WORKERS:
            return
        self._last[key] = count
        if now is not None:
            valid_s = advert.valid_s if 0 < advert.valid_s < 3600 else _DEFAULT_VALID_S
            self._waiting[key] = (now, valid_s, {t: n for t, n in list(advert.tenant_backlog.items())[:_MAX_TENANT_COUNTS] if n > 0})
            self._admitted.clear()  # a fresh advert counts what was admitted before it
        if before is not None and now is not None:
            self.shares.served(count - before if count >= before else count, now)
