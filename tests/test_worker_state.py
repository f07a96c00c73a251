"""The worker loop's state and counters: plain objects, tested without a server."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from jetbatch.sidecar.worker.counters import Counters
from jetbatch.sidecar.worker.state import InFlight, LoopState


def _msg(subject: str) -> object:
    return SimpleNamespace(subject=subject)


def test_in_flight_counts_held_messages_per_model_until_settled() -> None:
    held = InFlight()
    a, b, c = _msg("p.model.m1"), _msg("p.model.m1"), _msg("p.model.m2")
    held.add([a, b, c])
    model_of = lambda subject: subject.rsplit(".", 1)[1]  # noqa: E731
    assert held.by_model(model_of) == {"m1": 2, "m2": 1}
    assert held.settled([a, c, c]) == 2  # settling twice is harmless: each counts once
    assert held.by_model(model_of) == {"m1": 1}
    assert len(held) == 1 and bool(held)
    assert held.messages() == [b]
    held.clear()
    assert not held and held.by_model(model_of) == {}


def test_counters_count_events_and_time_steps() -> None:
    counters = Counters("batches", "loads")
    counters.add("batches")
    counters.add("batches", 2)
    counters.sample("claim", 0.002)
    counters.sample("claim", 0.004)
    snap = counters.snapshot()
    assert snap["batches"] == 3 and snap["loads"] == 0
    assert (snap["claim_n"], snap["claim_us"], snap["claim_us2"]) == (2, 6000, 2000**2 + 4000**2)
    assert counters["missing"] == 0
    snap["batches"] = 99  # a snapshot is a copy
    assert counters["batches"] == 3


def test_counts_due_come_before_the_schedules_and_each_is_taken_once() -> None:
    state = LoopState(started_at=0.0)
    state.next_refresh = 60.0  # the schedule: a minute away
    state.count_at(10.0, 3.0)
    assert state.next_count() == 3.0
    state.counted(3.0)
    assert state.next_count() == 10.0
    state.counted(9.0)  # a count before the next one due leaves it due
    assert state.next_count() == 10.0
    state.counted(60.0)
    assert state.next_count() == 60.0 and state.recounts == []


def test_a_peer_leaving_or_replaced_under_its_id_is_departed_once() -> None:
    """A peer's requests come back with no arrival event when it leaves, and when its process is
    replaced under the same id (its advert's start time changes): each is one departure."""
    from jetbatch.sidecar.worker.coordination import Coordinator

    class View:  # the cluster view's peers, as last heard
        live: dict[str, SimpleNamespace] = {}

        def peers(self, now: float | None = None) -> dict[str, SimpleNamespace]:
            return dict(self.live)

    view = View()
    peers = Coordinator(view, worker_id="w0", **{k: None for k in ("slots", "queues", "residency", "core", "budget", "counters", "report")}, heartbeat_s=1.0)  # type: ignore[arg-type]
    view.live = {"w1": SimpleNamespace(started_at=10.0), "w2": SimpleNamespace(started_at=11.0)}
    assert peers.departed(0.0) == []  # first seen
    assert peers.departed(1.0) == []
    view.live = {"w1": SimpleNamespace(started_at=20.0), "w2": SimpleNamespace(started_at=11.0)}  # w1 restarted
    assert peers.departed(2.0) == ["w1"]
    view.live = {"w1": SimpleNamespace(started_at=20.0)}  # w2 gone
    assert peers.departed(3.0) == ["w2"]
    assert peers.departed(4.0) == []


def test_take_events_are_heard_by_a_peer_in_view_or_by_unknown_peers_without_a_view() -> None:
    """A worker that knows it is alone sends no take events; with coordination off it cannot
    know, and sends them."""
    from jetbatch.sidecar.worker.coordination import Coordinator

    class View:
        live: dict[str, SimpleNamespace] = {}

        def peers(self, now: float | None = None) -> dict[str, SimpleNamespace]:
            return dict(self.live)

    nothing = {k: None for k in ("slots", "queues", "residency", "core", "budget", "counters", "report")}
    view = View()
    peers = Coordinator(view, worker_id="w0", **nothing, heartbeat_s=1.0)  # type: ignore[arg-type]
    assert not peers.heard()
    view.live = {"w1": SimpleNamespace(started_at=10.0)}
    assert peers.heard()
    assert Coordinator(None, worker_id="w0", **nothing, heartbeat_s=1.0).heard()  # type: ignore[arg-type]


def test_a_queue_is_left_only_to_a_peer_that_serves_its_model() -> None:
    """Workers may serve different models: a peer first in a model's taker order but not serving
    it must not hold its queue back (it deferred the queue a load time for nobody)."""
    from jetbatch.sidecar.policy import Budget, first_taker_rank
    from jetbatch.sidecar.worker.coordination import Coordinator

    # A peer id that comes before w0 for m1 when both have room.
    peer = next(p for p in (f"w{i}" for i in range(1, 100)) if first_taker_rank("m1", "w0", [p], has_warm=lambda _: False, has_room=lambda _: True))

    def advert(models: list[str]) -> SimpleNamespace:
        return SimpleNamespace(models=models, warm=[], resident=[], loading=None, memory_bytes=0, memory_budget_bytes=None, max_resident_models=None)

    class View:
        live: dict[str, SimpleNamespace] = {}

        def peers(self, now: float | None = None) -> dict[str, SimpleNamespace]:
            return dict(self.live)

        def held_by_peers(self, now: float | None = None) -> set[str]:
            return set()

        def registered(self, worker: str) -> frozenset[str] | None:
            return frozenset(self.live[worker].models)

    view = View()
    slot = SimpleNamespace(resident=False, oldest_enqueued_at=100.0, tier="cold")
    peers = Coordinator(
        view, worker_id="w0", slots={"m1": slot}, queues=SimpleNamespace(waiting={"m1": 3}),  # type: ignore[arg-type]
        residency=SimpleNamespace(resident_names=lambda: [], load_cost_s=lambda s: 2.0), core=SimpleNamespace(costs=SimpleNamespace(memory_bytes=lambda n: 1)),  # type: ignore[arg-type]
        budget=Budget(), counters=None, heartbeat_s=1.0, report=None,  # type: ignore[arg-type]
    )  # fmt: skip
    view.live = {peer: advert(["m1"])}
    assert peers.deferred(now=100.5) == {"m1": 102.0}  # one load time from the queue's head
    view.live = {peer: advert(["m2"])}
    assert peers.deferred(now=100.5) == {}


@pytest.mark.anyio
async def test_a_claim_waits_for_the_last_loads_release_that_runs_beside_its_batch() -> None:
    """A load's advert and release run in the worker's task group beside its first batch
    (``Coordinator.loaded_soon``); a claim made meanwhile would find our own claim keys and
    stand back as if a peer held them, so the next claim waits for the release."""
    from jetbatch.sidecar.worker.coordination import Coordinator

    released = anyio.Event()
    order: list[str] = []

    class View:
        def peers(self, now: float | None = None) -> dict[str, SimpleNamespace]:
            return {}

        def held_by_peers(self) -> set[str]:
            return set()

        async def advertise(self, advert: object, *, names: object = None) -> None:
            order.append("advert")

        async def release(self, models: list[str]) -> None:
            await released.wait()
            order.append(f"release {models}")

        async def claim(self, models: list[str]) -> bool:
            order.append(f"claim {models}")
            return True

    residency = SimpleNamespace(announce_loading=lambda name: None)
    peers = Coordinator(
        View(), worker_id="w0", slots={}, queues=None, residency=residency, core=None, budget=None, counters=Counters(),  # type: ignore[arg-type]
        heartbeat_s=1.0, report=lambda: None,  # type: ignore[arg-type,return-value]
    )  # fmt: skip
    async with anyio.create_task_group() as tg:
        peers.loaded_soon(tg, ["m1"])
        with anyio.fail_after(5):
            claiming = anyio.Event()

            async def claim() -> None:
                await peers.claim_load(SimpleNamespace(name="m2"), ("m1",), for_backlog=False)  # type: ignore[arg-type]
                claiming.set()

            tg.start_soon(claim)
            await anyio.wait_all_tasks_blocked()
            assert order == ["advert"] and not claiming.is_set()  # the release holds the next claim
            released.set()
            await claiming.wait()
    assert order == ["advert", "release ['m1']", "claim ['m2', 'm1']"]
