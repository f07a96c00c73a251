"""Fair shares and quotas between tenants (sidecar/tenancy.py), by state: no clock, no server.
The simulator's tenants (workloads with per-tenant streams) and the classifier's wiring are
checked at the end; docs/tenancy.md says what they promise."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jetbatch.sidecar.config import ConfigError, TenantsConfig, parse_config
from jetbatch.sidecar.simulator import build_workload, simulate
from jetbatch.sidecar.tenancy import ServiceFeed, TenantShares, fair_levels, fair_rates, shaped_rates

# --- the split ----------------------------------------------------------------------------------


def test_fair_rates_give_the_small_what_they_ask_and_split_the_rest_by_weight() -> None:
    rates = fair_rates(100.0, {"a": 500.0, "b": 20.0, "c": 500.0}, {"a": 3.0, "b": 1.0, "c": 1.0})
    assert rates["b"] == pytest.approx(20.0)
    assert rates["a"] == pytest.approx(60.0)  # 80 left, split 3:1
    assert rates["c"] == pytest.approx(20.0)
    levels = fair_levels(100.0, {"a": 500.0, "b": 20.0}, {"a": 1.0, "b": 1.0})
    assert levels["b"] == pytest.approx(50.0)  # what it could get, above what it asks
    assert levels["a"] == pytest.approx(80.0)


@settings(max_examples=300, deadline=None)
@given(
    pool=st.floats(0, 1e4),
    demand=st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 1e4), min_size=1),
    weights=st.dictionaries(st.sampled_from("abcdef"), st.floats(0.01, 100)),
)
def test_fair_rates_are_max_min_fair(pool: float, demand: dict[str, float], weights: dict[str, float]) -> None:
    w = {t: weights.get(t, 1.0) for t in demand}
    rates = fair_rates(pool, demand, w)
    assert set(rates) == set(demand)
    assert sum(rates.values()) <= pool * (1 + 1e-9) + 1e-9
    for t, r in rates.items():
        assert 0 <= r <= demand[t] + 1e-9
    # Nobody who gets less than it asks gets less per weight than anyone else: max-min fairness.
    short = [t for t in demand if rates[t] < demand[t] - 1e-6]
    for t in short:
        for u in demand:
            assert rates[t] / w[t] >= rates[u] / w[u] - 1e-6 * max(1.0, rates[u] / w[u])
    if short:
        assert sum(rates.values()) == pytest.approx(pool, rel=1e-6, abs=1e-6)  # work-conserving


# --- shaping ------------------------------------------------------------------------------------


def _drive(shares: TenantShares, rates: dict[str, float], seconds: float, *, served_rps: float, start: float = 0.0) -> dict[str, list[bool]]:
    """Each tenant sends evenly at its rate for ``seconds`` while the workers serve
    ``served_rps``; the verdicts (demoted or not) per tenant, in order."""
    events: list[tuple[float, str]] = []
    for t, r in rates.items():
        n = int(r * seconds)
        events += [(start + (k + 0.5) / r, t) for k in range(n)]
    events.sort()
    out: dict[str, list[bool]] = {t: [] for t in rates}
    served_at = start
    for at, t in events:
        while served_at + 0.1 <= at:
            served_at += 0.1
            shares.served(round(served_rps * 0.1), served_at)
        verdict = shares.admit(t, at)
        assert verdict.refused is None
        out[t].append(verdict.demoted)
    return out


def test_one_tenant_is_never_shaped_however_much_it_sends() -> None:
    shares = TenantShares(TenantsConfig())
    verdicts = _drive(shares, {"a": 1000.0}, 30, served_rps=100)
    assert not any(verdicts["a"])


def test_tenants_sending_alike_are_not_shaped_under_saturation() -> None:
    shares = TenantShares(TenantsConfig())
    verdicts = _drive(shares, {"a": 300.0, "b": 300.0}, 30, served_rps=100)
    assert not any(verdicts["a"]) and not any(verdicts["b"])


def test_a_flooding_tenant_is_shaped_to_its_share_and_the_other_never() -> None:
    shares = TenantShares(TenantsConfig())
    calm = _drive(shares, {"a": 35.0, "b": 35.0}, 30, served_rps=70)
    assert not any(calm["a"]) and not any(calm["b"])
    flood = _drive(shares, {"a": 350.0, "b": 35.0}, 30, served_rps=100, start=30)
    assert not any(flood["b"])
    # Past the ramp of its measured rate, a's interactive admissions come to its token rate:
    # share_of_service x service less what b sends (0.75 x 100 - 35 = 40 req/s of 350).
    late = flood["a"][len(flood["a"]) // 2 :]
    kept = late.count(False) / 15.0  # per second, over the last 15 s
    assert 30 <= kept <= 50, kept
    assert shares.fair_rps()["a"] == pytest.approx(40, rel=0.15)


def test_weights_set_the_shares_of_two_saturating_tenants() -> None:
    shares = TenantShares(TenantsConfig(weights={"a": 3.0}))
    verdicts = _drive(shares, {"a": 400.0, "b": 400.0}, 40, served_rps=100)
    # Equal demand, weights 3:1, each over the service alone: both are shaped. The batch line (25
    # of 100) carries their excess first come, first served, b's the larger part; the interactive
    # line is split so that each gets its weighted part of all service (75 and 25), not 3:1 of
    # the 75 alone (56 and 19, which gave a 0.66 of service in the simulator).
    kept = {t: v[len(v) // 2 :].count(False) / 20.0 for t, v in verdicts.items()}
    assert kept["a"] == pytest.approx(63.4, rel=0.2) and kept["b"] == pytest.approx(11.6, rel=0.3), kept


def test_shaped_rates_give_each_tenant_its_weighted_part_of_the_interactive_and_the_batch_line() -> None:
    rates = shaped_rates(75.0, 25.0, {"a": 400.0, "b": 400.0}, {"a": 3.0, "b": 1.0})
    excess = {t: 400.0 - r for t, r in rates.items()}
    total = {t: rates[t] + 25.0 * excess[t] / sum(excess.values()) for t in rates}
    assert sum(rates.values()) == pytest.approx(75.0)
    assert total == pytest.approx({"a": 75.0, "b": 25.0})
    # One shaped tenant gets the pool, as before.
    assert shaped_rates(40.0, 25.0, {"a": 350.0}, {"a": 1.0}) == pytest.approx({"a": 40.0})


@settings(max_examples=300, deadline=None)
@given(
    st.floats(1.0, 1e4),
    st.floats(0.0, 1e4),
    st.dictionaries(st.sampled_from("abcdef"), st.floats(1.0, 1e5), min_size=1),
    st.dictionaries(st.sampled_from("abcdef"), st.floats(0.1, 10.0)),
)
def test_shaped_rates_stay_within_demand_and_spend_at_most_the_pool(pool: float, line: float, demand: dict[str, float], weights: dict[str, float]) -> None:
    """Shaping applies while the shaped tenants send more than the pool and the line carry."""
    assume(sum(demand.values()) > pool + line + 1.0)
    w = {t: weights.get(t, 1.0) for t in demand}
    rates = shaped_rates(pool, line, demand, w)
    assert set(rates) == set(demand)
    assert all(0.0 <= rates[t] <= demand[t] * (1 + 1e-9) for t in demand)
    assert sum(rates.values()) <= pool * (1 + 1e-9) + 1e-6


def test_an_idle_tenant_banks_no_more_than_its_credit() -> None:
    cfg = TenantsConfig(credit_s=1.0)
    shares = TenantShares(cfg)
    _drive(shares, {"a": 350.0, "b": 35.0}, 20, served_rps=100)
    fair = shares.fair_rps()["a"]
    now = 1000.0  # a long silence of a alone: its bucket refills to the cap and no further
    shares._shares["a"].take(fair, max(1.0, fair * cfg.credit_s), now)
    assert shares._shares["a"].tokens <= fair * cfg.credit_s


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(0, 0.5), st.sampled_from(["a", "b", "c", None]), st.integers(0, 40), st.booleans()), min_size=1, max_size=300
    ),
    weights=st.dictionaries(st.sampled_from("abc"), st.floats(0.1, 10)),
)
def test_the_tenant_asking_least_per_weight_is_never_shaped(steps: list[tuple[float, str | None, int, bool]], weights: dict[str, float]) -> None:
    """Whatever the arrivals and the service, shaping never falls on the tenant that sends the
    least per weight (it cannot be over its level and over its weight's part at once), never
    raises, and keeps the shaped tenants' rates within the headroom of the service measured."""
    cfg = TenantsConfig(weights=weights)
    shares = TenantShares(cfg)
    now = 0.0
    for gap, tenant, served, interactive in steps:
        now += gap
        shares.served(served, now)
        verdict = shares.admit(tenant, now, interactive=interactive)
        assert verdict.refused is None
        if verdict.demoted:
            demand = shares.demand_rps(now)
            name = tenant or "_"
            least = min(demand, key=lambda t: demand[t] / cfg.weight(t))
            assert demand[name] / cfg.weight(name) > demand[least] / cfg.weight(least) or name != least
        service = shares._service.now(now, cfg.window_s)
        assert sum(shares.fair_rps().values()) <= cfg.share_of_service * service * (1 + 1e-9) + 1e-9


# --- quotas -------------------------------------------------------------------------------------


def test_a_rate_quota_refuses_past_its_burst_and_names_the_limit() -> None:
    shares = TenantShares(TenantsConfig(max_rps={"a": 10.0}))
    verdicts = [shares.admit("a", 5.0 + k * 0.001) for k in range(30)]
    refused = [v for v in verdicts if v.refused]
    assert len(refused) == 20  # a burst of 10 (a second of its rate), then nothing in 30 ms
    assert "quota of 10 requests/s" in (refused[0].refused or "")
    assert shares.admit("b", 5.0).refused is None  # another tenant has no quota
    assert shares.admit("a", 6.1).refused is None  # a second later its tokens came back


def test_a_waiting_quota_refuses_at_the_limit_and_a_default_applies_to_the_others() -> None:
    shares = TenantShares(TenantsConfig(max_waiting={"a": 5}, default_max_waiting=100))
    assert shares.admit("a", 0.0, waiting=4).refused is None
    assert "5" in (shares.admit("a", 0.0, waiting=5).refused or "")
    assert shares.admit("b", 0.0, waiting=99).refused is None
    assert shares.admit("b", 0.0, waiting=100).refused is not None
    assert shares.admit("b", 0.0, waiting=None).refused is None  # not known: not checked
    assert shares.refused == {"a": 1, "b": 1}


def test_any_number_of_tenant_names_keeps_the_tables_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an open server anyone may publish to ``<prefix>.in.<anything>``: new names every
    request must not grow the shares' tables without bound."""
    import jetbatch.sidecar.tenancy as tenancy

    monkeypatch.setattr(tenancy, "_MAX_TENANTS", 50)
    shares = TenantShares(TenantsConfig(default_max_rps=1.0))
    for k in range(2000):
        shares.admit(f"t{k}", k * 0.001)
        shares.admit(f"t{k}", k * 0.001 + 0.0001)  # over its burst of 1: refused, counted
    assert len(shares._demand) <= 50 and len(shares._quotas) <= 50
    assert len(shares.refused) <= 51 and shares.refused.get("_other", 0) > 0


def test_the_config_refuses_a_tenant_name_no_subject_could_carry() -> None:
    with pytest.raises(ConfigError, match="tenants"):
        parse_config('[tenants]\nweights = { "a.b" = 2.0 }\n')
    with pytest.raises(ConfigError, match="weight"):
        parse_config("[tenants]\nweights = { a = 0 }\n")
    cfg = parse_config("[tenants]\nweights = { a = 3 }\ndefault_max_rps = 50\n")
    assert cfg.tenants.weight("a") == 3 and cfg.tenants.weight("z") == 1 and cfg.tenants.rps_quota("z") == 50


# --- the service feed ---------------------------------------------------------------------------


def test_the_service_feed_counts_what_each_worker_served_since_its_last_advert() -> None:
    shares = TenantShares(TenantsConfig())
    feed = ServiceFeed(shares)
    advert = lambda n: msgspec.json.encode({"role": "worker", "stats": {"requests": n}})  # noqa: E731
    feed.on_advert("w1", advert(1000), False, 0.0)  # a baseline, not served now
    feed.on_advert("w1", advert(1100), False, 1.0)
    feed.on_advert("w2", advert(50), False, 1.0)
    feed.on_advert("w2", advert(10), False, 2.0)  # restarted: counted from 0
    feed.on_advert("claim.m1", b"x", False, 2.0)
    feed.on_advert("w3", b"\xff not json", False, 2.0)
    feed.on_advert("w4", msgspec.json.encode({"role": "worker", "stats": {"requests": -5}}), False, 2.0)
    assert shares._service.value * shares.config.window_s == pytest.approx(110, rel=0.2)


def test_the_feed_tells_a_tenants_waiting_requests_from_live_adverts_and_admissions_since() -> None:
    feed = ServiceFeed(TenantShares(TenantsConfig()))
    advert = lambda waiting, valid_s=3.0: msgspec.json.encode(  # noqa: E731
        {"role": "worker", "stats": {"requests": 0}, "tenant_backlog": waiting, "valid_s": valid_s}
    )
    feed.on_advert("w1", advert({"a": 40, "b": 2}), False, 100.0)
    feed.on_advert("w2", advert({"a": 55}), False, 100.5)  # counts the same queues: the most counts
    feed.admitted("a")
    assert feed.waiting("a", 101.0) == 56 and feed.waiting("b", 101.0) == 2 and feed.waiting("c", 101.0) == 0
    feed.on_advert("w1", advert({"a": 10}), False, 102.0)  # a fresh advert counts what was admitted
    assert feed.waiting("a", 103.0) == 55
    assert feed.waiting("a", 104.0) == 10  # w2's advert is past its valid_s: a dead worker counts nothing
    feed.on_advert("w1", b"", True, 104.0)
    assert feed.waiting("a", 104.0) == 0


# --- the simulator ------------------------------------------------------------------------------

_MODELS = {f"m{k}": {"load_cost_s": 0.5, "batch_cost_s": 0.02, "item_cost_s": 0.002, "max_batch_size": 16} for k in range(4)}


def test_a_workload_with_one_tenant_is_simulated_as_one_without_tenants() -> None:
    arrivals = {"kind": "poisson", "duration_s": 40, "utilization": 0.6, "seed": 5}
    plain = simulate(build_workload({"models": _MODELS, "arrivals": arrivals}), "cost-aware")
    one = build_workload({"models": _MODELS, "arrivals": {**arrivals, "seed": 5 - 7919}, "tenants": {"a": {"utilization": 0.6}}})
    tenanted = simulate(one, "cost-aware")
    assert [b[:4] for b in tenanted.batches] == [b[:4] for b in plain.batches]
    assert tenanted.latencies_s == plain.latencies_s
    assert tenanted.tenant_summary()["a"]["demoted"] == 0


def test_a_flood_in_the_simulator_is_shaped_and_nothing_is_lost() -> None:
    raw = {
        "models": _MODELS,
        "arrivals": {"kind": "poisson", "duration_s": 60, "seed": 3},
        "tenants": {"a": {"utilization": 0.35, "surge": {"factor": 10, "start_s": 20, "duration_s": 20}}, "b": {"utilization": 0.35}},
    }
    shared = simulate(build_workload(raw), "cost-aware")
    fcfs = simulate(build_workload({**raw, "tenancy": {"enabled": False}}), "cost-aware")
    s, f = shared.tenant_summary(), fcfs.tenant_summary()
    for r in (shared, fcfs):
        assert r.completed + r.deadline_exceeded + r.cancelled == len(build_workload(raw).arrivals)
    assert s["b"]["demoted"] == 0 and s["a"]["demoted"] > 0
    assert f["a"]["demoted"] == 0
    assert s["b"]["p50_ms"] < f["b"]["p50_ms"] / 2
    assert not math.isnan(s["a"]["p99_ms"])
