"""The worker core by state: events in, actions out, no server and no clock. The scenarios are
the ones the live worker and the simulator used to write twice (arrivals during compute, holds,
recounts, two slots, idle unloads, cancellations and deadlines, peers and first takers)."""

from __future__ import annotations

import math

import msgspec

import pytest

from jetbatch.sidecar.core import (
    BatchChecked,
    BatchDone,
    ClaimLost,
    Computed,
    Evicted,
    Fetch,
    Fetched,
    Hold,
    LoadDue,
    Loaded,
    LoadModel,
    ModelRules,
    Proceed,
    Reap,
    Recount,
    Settled,
    Sleep,
    Started,
    Turn,
    Unload,
    WaitFree,
    WaitRoom,
    WorkerCore,
)
from jetbatch.sidecar.policy import ANSWERING_BATCHES, PROBE_AFTER_REFUSALS, QueueFacts, Tier, pipeline_has_room


def _core(*names: str, policy: str = "cost-aware", max_models: int | None = 1, idle_unload_s: float | None = None, pin: tuple[str, ...] = ()) -> WorkerCore:
    rules = {n: ModelRules(max_batch_size=4, load_cost_s=0.5, batch_cost_s=0.01, item_cost_s=0.001, idle_unload_s=idle_unload_s, pin=n in pin) for n in names}
    return WorkerCore(Started(policy=policy, options={}, models=rules, max_models=max_models))


def _facts(waiting: dict[str, int], *, resident: tuple[str, ...] = (), at: float = 0.0, **extra: object) -> list[QueueFacts]:
    out = []
    for name in sorted({*waiting, *resident}):
        n = waiting.get(name, 0)
        tier: Tier = "resident" if name in resident else "cold"
        out.append(QueueFacts(name=name, waiting=n, head_enqueued_at=at if n else None, head_deadline=None, tier=tier, reload_fits_host=False, max_batch_size=4, **extra))  # type: ignore[arg-type]
    return out


def _load(core: WorkerCore, model: str, now: float, waiting: int) -> None:
    core.handle(Loaded(model, "cold", 0.5, now, waiting))


def test_an_interleaved_burst_is_served_one_load_per_model() -> None:
    """[a, b, a, b, a, b] with a batch of 4: the core loads one model, drains it, then the other."""
    core = _core("a", "b")
    action = core.handle(Turn(now=0.0, facts=_facts({"a": 3, "b": 3})))
    assert isinstance(action, LoadModel) and action.evict == []
    first = action.model
    other = "b" if first == "a" else "a"
    _load(core, first, 0.5, 3)
    fetch = core.handle(Turn(now=0.5, facts=_facts({first: 3, other: 3}, resident=(first,))))
    assert isinstance(fetch, Fetch) and (fetch.model, fetch.max_items) == (first, 4)
    core.handle(Fetched(first, 3))
    core.handle(Computed(first))
    core.handle(BatchDone(first, taken=3, computed=3, seconds=0.013, now=0.52))
    core.handle(Settled(first))
    # first's batch filled its queue: it is served from held pulls, so before the switch the core
    # asks for a count of its line (a held pull leaves the count low).
    assert core.handle(Turn(now=0.52, facts=_facts({other: 3}, resident=(first,)))) == Recount(first)
    action = core.handle(Turn(now=0.53, facts=_facts({other: 3}, resident=(first,))))
    assert action == LoadModel(other, [first], action.reason)


def test_a_load_decided_while_its_victim_computes_waits_and_is_decided_again() -> None:
    """The live worker gathers the next batch while one computes: a load decided then would
    leave what arrives meanwhile a whole cycle. The core asks to wait, then decides again."""
    core = _core("a", "b")
    _load(core, "a", 0.0, 0)
    core.handle(Fetched("a", 1))  # a batch of a under way: it computes
    facts = _facts({"b": 8}, resident=("a",), at=0.0)
    assert core.handle(Turn(now=1.0, facts=facts)) == WaitFree(["a"])
    # Decided once more, the victim still busy: the load goes ahead (no second wait).
    action = core.handle(Turn(now=1.1, facts=facts))
    assert isinstance(action, LoadModel) and action.model == "b" and action.evict == ["a"]


def test_arrivals_during_compute_are_gathered_within_the_pipeline_bound() -> None:
    """The next batch is gathered while one computes and earlier answers are stored, a bounded
    number of them (``policy.pipeline_has_room``, written once, in the core): past the bound the
    core asks to wait for one of them and decides again; a model allowed two forward passes at
    once may have one more under way."""
    core = _core("a")
    _load(core, "a", 0.0, 16)
    facts = _facts({"a": 16}, resident=("a",))
    assert isinstance(core.handle(Turn(now=1.0, facts=facts)), Fetch)
    core.handle(Fetched("a", 4))  # computing
    assert isinstance(core.handle(Turn(now=1.0, facts=facts)), Fetch)
    core.handle(Fetched("a", 4))  # gathered while the first computes: it waits for the device
    assert (core.in_flight("a"), core.computing("a")) == (2, 2)
    assert core.handle(Turn(now=1.0, facts=facts)) == WaitRoom("a")
    for _ in range(2):  # both computed: their answers are being stored
        core.handle(Computed("a"))
    while core.in_flight("a") <= 1 + ANSWERING_BATCHES:
        assert isinstance(core.handle(Turn(now=1.0, facts=facts)), Fetch)
        core.handle(Fetched("a", 4))
        core.handle(Computed("a"))
    assert (core.in_flight("a"), core.computing("a")) == (2 + ANSWERING_BATCHES, 0)
    assert core.handle(Turn(now=1.0, facts=facts)) == WaitRoom("a")  # too many answers being stored
    core.handle(Settled("a"))
    assert isinstance(core.handle(Turn(now=1.0, facts=facts)), Fetch)
    # A served model about to idle holds its next batch only with room for it.
    assert core.serving == "a"
    idle = _facts({}, resident=("a",))
    core.handle(Fetched("a", 4))
    assert core.handle(Turn(now=2.0, facts=idle)) == WaitRoom("a")
    core.handle(Computed("a"))
    core.handle(Settled("a"))
    assert isinstance(core.handle(Turn(now=2.0, facts=idle)), Hold)
    # Forged or replayed ends of batches never count below zero.
    for _ in range(10):
        core.handle(Computed("a"))
        core.handle(Settled("a"))
    assert (core.in_flight("a"), core.computing("a")) == (0, 0)
    two = WorkerCore(Started(policy="cost-aware", options={}, models={"a": ModelRules(4, 0.5, 0.01, 0.001, max_concurrent_batches=2)}))
    _load(two, "a", 0.0, 16)
    two.handle(Fetched("a", 4))
    two.handle(Fetched("a", 4))
    assert isinstance(two.handle(Turn(now=1.0, facts=facts)), Fetch)


def test_a_lost_claim_leaves_the_queue_to_the_peer_until_its_advert_and_the_worker_goes_on() -> None:
    """A peer holds the load claim of the model the core chose: until the peer's advert (live:
    a heartbeat; simulated: the peer's load's end) the queue counts as the peer's, so the core
    serves its own work at once, or sleeps until then, instead of deciding the same load again."""
    rules = {n: ModelRules(max_batch_size=4, load_cost_s=0.5, batch_cost_s=0.01, item_cost_s=0.001) for n in ("a", "b")}
    core = WorkerCore(Started(policy="cost-aware", options={"idle_s": 100.0}, models=rules, max_models=2))
    _load(core, "a", 0.0, 0)
    action = core.handle(Turn(now=5.0, facts=_facts({"b": 8}, resident=("a",), at=0.0)))
    assert action == LoadModel("b", [], action.reason)  # type: ignore[union-attr]
    core.handle(ClaimLost("b", 6.0))
    assert core.stands_back("b", 5.5) and not core.stands_back("b", 6.0)
    action = core.handle(Turn(now=5.1, facts=_facts({"b": 8, "a": 2}, resident=("a",), at=0.0)))
    assert isinstance(action, Fetch) and action.model == "a"
    sleep = core.handle(Turn(now=5.2, facts=_facts({"b": 8}, resident=("a",), at=0.0)))
    assert isinstance(sleep, Sleep) and sleep.until == 6.0  # decides again when the peer has said
    action = core.handle(Turn(now=6.0, facts=_facts({"b": 8}, resident=("a",), at=0.0)))
    assert isinstance(action, LoadModel) and action.model == "b"


def test_about_to_idle_while_serving_the_core_holds_then_recounts_after_an_empty_hold() -> None:
    core = _core("a")
    _load(core, "a", 0.0, 2)
    core.handle(Fetched("a", 2))
    assert core.serving == "a"
    action = core.handle(Turn(now=1.0, facts=_facts({}, resident=("a",))))
    assert isinstance(action, Hold) and action.model == "a" and 0 < action.hold_s <= 0.02
    core.handle(Fetched("a", 0, held=True))
    assert core.serving is None and core.hold_missed
    assert isinstance(core.handle(Turn(now=1.1, facts=_facts({}, resident=("a",)))), Sleep)
    # After an empty hold, a batch of two no longer says more are coming (policy/interest.py).
    core.handle(Fetched("a", 2))
    assert core.serving is None
    core.handle(Fetched("a", 4))
    assert core.serving == "a" and not core.hold_missed


def test_a_lone_requests_batch_does_not_start_serving_from_held_pulls() -> None:
    core = _core("a")
    _load(core, "a", 0.0, 1)
    core.handle(Fetched("a", 1))
    assert core.serving is None and core.current == "a"
    assert isinstance(core.handle(Turn(now=1.0, facts=_facts({}, resident=("a",)))), Sleep)


def test_two_slots_load_without_eviction_and_serve_both_residents() -> None:
    core = _core("a", "b", max_models=2)
    _load(core, "a", 0.0, 0)
    action = core.handle(Turn(now=1.0, facts=_facts({"b": 4}, resident=("a",))))
    assert isinstance(action, LoadModel) and action.model == "b" and action.evict == []
    _load(core, "b", 1.5, 4)
    assert core.handle(Turn(now=1.5, facts=_facts({"b": 4, "a": 1}, resident=("a", "b")))).model in ("a", "b")  # type: ignore[union-attr]


def test_idle_models_are_unloaded_at_their_limit_unless_busy_or_pinned() -> None:
    core = _core("a", "p", max_models=2, idle_unload_s=5.0, pin=("p",))
    _load(core, "a", 0.0, 0)
    _load(core, "p", 0.0, 0)
    sleep = core.handle(Turn(now=1.0, facts=_facts({}, resident=("a", "p"))))
    assert isinstance(sleep, Sleep) and sleep.until is not None and sleep.until <= 5.0  # wakes for the unload at the latest
    assert core.idle_wake == 5.0
    core.handle(Fetched("a", 1))  # its batch, held unacked: not unloaded
    core.handle(Computed("a"))
    assert isinstance(core.handle(Turn(now=6.0, facts=_facts({}, resident=("a", "p")))), Sleep)
    core.handle(Settled("a"))
    assert core.handle(Turn(now=6.0, facts=_facts({}, resident=("a", "p")))) == Unload(["a"])
    core.handle(Evicted("a", 6.0))
    # A batch counts as use: the limit runs from its end.
    core.handle(BatchDone("p", taken=1, computed=1, seconds=0.01, now=7.0))
    assert core.last_used["p"] == 7.0


def test_a_load_nobody_waits_for_is_reaped_and_the_estimate_is_probed_after_a_run() -> None:
    core = _core("a")
    cancelled = LoadDue("a", "cold", 10.0, [(None, True), (20.0, True)])
    assert core.handle(cancelled) == Reap("a", pytest.approx(0.5 + core.costs.deadline_estimate_s("a", 1)))  # type: ignore[arg-type]
    # A deadline inside the load and a batch: refused on the estimate, PROBE_AFTER_REFUSALS times...
    soon = LoadDue("a", "cold", 10.0, [(10.2, False)])
    for _ in range(PROBE_AFTER_REFUSALS):
        assert isinstance(core.handle(soon), Reap)
    # ...then only deadlines already passed count, so an inflated estimate cannot lock it out.
    assert core.handle(soon) == Proceed()
    assert core.handle(LoadDue("a", "cold", 10.0, None)) == Proceed()  # a request never seen arriving may be wanted
    assert core.handle(LoadDue("a", "cold", 10.0, [(10.2, False)], peer_serves=True)) == Proceed()


def test_batches_refused_whole_on_a_prediction_lead_to_a_probe() -> None:
    core = _core("a")
    estimate = core.predicted_s("a", 4)
    assert estimate > 0
    for _ in range(PROBE_AFTER_REFUSALS):
        core.handle(BatchChecked("a", refused_whole=True))
    assert core.predicted_s("a", 4) == 0.0
    core.handle(BatchChecked("a", refused_whole=False))
    assert core.predicted_s("a", 4) == estimate


def test_a_load_owes_the_share_that_justified_it_never_more_than_waits() -> None:
    seen: list[int] = []
    core = _core("a", "b")
    core.driver.policy.on_loaded = lambda model, now, backlog=0: seen.append(backlog)  # type: ignore[method-assign]
    # A peer drains b fast: only part of b's queue is ours to chase.
    facts = _facts({"b": 40}, served_rps=10.0)
    action = core.handle(Turn(now=0.0, facts=facts))
    assert isinstance(action, LoadModel) and action.model == "b"
    share = core.driver.model_state(facts[0], 0.0).backlog
    _load(core, "b", 0.5, 100)
    _load(core, "a", 1.0, 3)  # a load the core did not decide (a preload) owes what waits
    assert seen == [share, 3] and share < 40


def test_a_queue_left_to_a_peers_first_take_wakes_the_core_when_it_falls_due() -> None:
    core = _core("a")
    action = core.handle(Turn(now=0.0, facts=_facts({"a": 3}, deferred=True), defer_until=0.7))
    assert isinstance(action, Sleep) and action.until is not None and action.until <= 0.7
    # Without the deferral, the queue is ours at once.
    assert isinstance(core.handle(Turn(now=0.0, facts=_facts({"a": 3}))), LoadModel)


def test_every_turn_asks_one_action_and_other_events_none() -> None:
    core = _core("a")
    assert core.handle(Fetched("a", 0)) is None
    assert core.handle(BatchDone("a", taken=1, computed=1, seconds=0.01, now=1.0)) is None
    assert core.handle(Turn(now=2.0, facts=_facts({}))) is not None


def test_last_used_times_are_forgotten_after_the_recent_window() -> None:
    core = _core("a", "b")
    core.handle(BatchDone("a", taken=1, computed=1, seconds=0.01, now=0.0))
    core.handle(BatchDone("b", taken=1, computed=1, seconds=0.01, now=100.0))
    core.handle(Turn(now=200.0, facts=_facts({})))
    assert core.last_used == {"b": 100.0}


@pytest.mark.parametrize("policy", ["cost-aware", "exhaustive", "fifo", "round-robin", "longest-backlog"])
def test_the_core_is_a_function_of_its_events(policy: str) -> None:
    """Two cores fed the same events answer the same actions, for every policy."""
    events = []
    t = 0.0
    for i in range(40):
        t += 0.1
        waiting = {"a": (i * 7) % 5, "b": (i * 3) % 4}
        events.append(Turn(now=t, facts=_facts(waiting, resident=("a",) if i % 3 else ())))
        events.append(Fetched("a", i % 5))
        events.append(BatchDone("a", taken=i % 5, computed=i % 5, seconds=0.01 * (i % 3), now=t + 0.05))
    first, second = _core("a", "b", policy=policy), _core("a", "b", policy=policy)
    assert [first.handle(e) for e in events] == [second.handle(e) for e in events]
    assert not math.isnan(t)


# --- properties -------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jetbatch.sidecar.core import Action, Event  # noqa: E402
from jetbatch.sidecar.recording import RecordLine, replay  # noqa: E402

_NAMES = ("a", "b", "c")


@st.composite
def _events(draw: st.DrawFn) -> list[Event]:
    """A run of a worker's events: turns on random facts (each model cold, warm or resident,
    waiting or not, pinned or not), batches fetched and done, loads due and done, evictions."""
    out: list[Event] = []
    t = 0.0
    for _ in range(draw(st.integers(1, 40))):
        t += draw(st.floats(0.0, 5.0))
        kind = draw(st.sampled_from(["turn", "turn", "fetched", "computed", "settled", "done", "due", "loaded", "evicted", "checked", "lost"]))
        model = draw(st.sampled_from(_NAMES))
        if kind == "turn":
            facts = []
            for name in _NAMES:
                n = draw(st.integers(0, 20))
                tier = draw(st.sampled_from(["cold", "warm", "resident"]))
                facts.append(QueueFacts(
                    name=name, waiting=n, head_enqueued_at=t - draw(st.floats(0, 10)) if n else None, head_deadline=None, tier=tier,
                    reload_fits_host=draw(st.booleans()), max_batch_size=4, pinned=name == "c" and tier == "resident",
                    served_rps=draw(st.sampled_from([0.0, 5.0])),
                ))  # fmt: skip
            out.append(Turn(now=t, facts=facts))
        elif kind == "fetched":
            out.append(Fetched(model, draw(st.integers(0, 4)), held=draw(st.booleans())))
        elif kind == "lost":
            out.append(ClaimLost(model, t + draw(st.floats(0.0, 2.0))))
        elif kind == "computed":
            out.append(Computed(model))
        elif kind == "settled":
            out.append(Settled(model))
        elif kind == "done":
            out.append(BatchDone(model, taken=3, computed=draw(st.integers(0, 3)), seconds=draw(st.floats(0, 0.1)), now=t))
        elif kind == "due":
            waiting = draw(st.none() | st.lists(st.tuples(st.none() | st.floats(t - 5, t + 5), st.booleans()), max_size=4))
            out.append(LoadDue(model, "cold", t, waiting, peer_serves=draw(st.booleans())))
        elif kind == "loaded":
            out.append(Loaded(model, "cold", draw(st.floats(0.01, 2.0)), t, waiting=draw(st.integers(0, 20))))
        elif kind == "evicted":
            out.append(Evicted(model, t))
        else:
            out.append(BatchChecked(model, refused_whole=draw(st.booleans())))
    return out


@settings(max_examples=150, deadline=None)
@given(events=_events(), policy=st.sampled_from(["cost-aware", "exhaustive", "fifo", "round-robin", "longest-backlog"]))
def test_any_run_of_events_is_answered_within_the_rules_and_replays_exactly(events: list[Event], policy: str) -> None:
    """Whatever a run's events, the core never raises, a turn always answers one action that
    respects the models' rules (a batch within its model's max size and pipeline bound, no pinned
    model evicted, a wait only for a model that computes), and a recording of the run replays
    action for action."""
    lines: list[bytes] = []

    class Lines:
        def write(self, event: Event, action: Action | None) -> None:
            lines.append(msgspec.json.encode(RecordLine(event=event, action=action)))

    core = _core(*_NAMES, policy=policy, max_models=2, pin=("c",))
    core.recorder = Lines()
    lines.append(msgspec.json.encode(RecordLine(event=core.started)))
    for event in events:
        in_flight = {n: (core.in_flight(n), core.computing(n)) for n in _NAMES}
        action = core.handle(event)
        if isinstance(event, Turn):
            assert action is not None
            if isinstance(action, (Fetch, Hold)):
                assert 1 <= action.max_items <= 4
                assert pipeline_has_room(*in_flight[action.model], 1)
            if isinstance(action, WaitRoom):
                assert not pipeline_has_room(*in_flight[action.model], 1)
            if isinstance(action, LoadModel):
                assert "c" not in action.evict or not any(f.name == "c" and f.pinned for f in event.facts)
            if isinstance(action, WaitFree):
                assert all(in_flight[n][1] > 0 for n in action.models)
        elif isinstance(event, LoadDue):
            assert isinstance(action, (Reap, Proceed))
        else:
            assert action is None
    result = replay(lines)
    assert result.ok, result.divergence
    assert result.events == len(events)


def test_a_load_that_was_not_paid_owes_nothing_to_a_later_one() -> None:
    """A LoadModel whose load never happened (a claim lost, a look that found nothing) leaves no
    share behind: the next load of that model, a preload, owes what waits then."""
    seen: list[int] = []
    core = _core("a", "b")
    core.driver.policy.on_loaded = lambda model, now, backlog=0: seen.append(backlog)  # type: ignore[method-assign]
    action = core.handle(Turn(now=0.0, facts=_facts({"b": 40}, served_rps=10.0)))
    assert isinstance(action, LoadModel)
    assert isinstance(core.handle(Turn(now=1.0, facts=_facts({}))), Sleep)  # the load did not happen
    _load(core, "b", 2.0, 40)  # a load the core did not decide this turn
    assert seen[-1] == 40
