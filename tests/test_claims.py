"""Load claims (sidecar/cluster.py) against a real nats-server: a placement change claims every
model it touches, all or nothing, so two workers can never swap models at the same moment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import nats
import pytest

from jetbatch.sdk.protocol import SidecarReport, Subjects
from jetbatch.sidecar import cluster
from jetbatch.sidecar.cluster import ClusterView
from jetbatch.sidecar.dev.natsserver import EmbeddedNats
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def views(nats_url: str, prefix: str) -> AsyncIterator[list[ClusterView]]:
    """Two workers' views of one bucket, each on its own connection."""
    conns = [await nats.connect(nats_url) for _ in range(2)]
    out = [ClusterView(nc.jetstream(), Subjects(prefix), f"w{i}", heartbeat_s=5.0) for i, nc in enumerate(conns)]
    for v in out:
        await v.start()
    try:
        yield out
    finally:
        for v in out:
            await v.stop()
        for nc in conns:
            await nc.close()


async def test_two_simultaneous_swaps_cannot_both_claim(views: list[ClusterView]) -> None:
    for _ in range(10):
        # A: load m2 evicting m1; B: load m1 evicting m2. Started together, every time.
        a, b = await asyncio.gather(views[0].claim(["m2", "m1"]), views[1].claim(["m1", "m2"]))
        assert sorted([a, b]) == [False, True], (a, b)
        winner = views[0] if a else views[1]
        await winner.release(["m1", "m2"])


async def test_a_lost_claim_gives_back_what_it_took(views: list[ClusterView]) -> None:
    assert await views[0].claim(["m2"]) is True
    assert await views[1].claim(["m1", "m2"]) is False  # m1 was taken first, then given back
    assert await views[0].claim(["m1"]) is True
    await views[0].release(["m1", "m2"])
    assert await views[1].claim(["m1", "m2"]) is True
    await views[1].release(["m1", "m2"])


async def test_disjoint_changes_go_ahead_together(views: list[ClusterView]) -> None:
    a, b = await asyncio.gather(views[0].claim(["m1", "m2"]), views[1].claim(["m3", "m4"]))
    assert a is True and b is True


async def test_expired_adverts_are_forgotten_and_a_flood_of_them_is_bounded(nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an attack on a running worker: the bucket drops an expired advert with no event
    to its watchers, so every worker id ever heard stayed in the view (100 000 fake keys: each
    decision scanned them, every request took 1.7 s instead of 24 ms, until a restart; each
    restarted worker leaves one too). Adverts unheard past the timeout are forgotten while the
    view is fresh, and a view keeps at most ``MAX_PEERS``."""
    monkeypatch.setattr(cluster, "MAX_PEERS", 20)
    nc = await nats.connect(nats_url)
    view = ClusterView(nc.jetstream(), Subjects(prefix), "me", heartbeat_s=0.1, peer_timeout_s=0.3)
    await view.start()
    kv = await nc.jetstream().key_value(Subjects(prefix).kv_bucket)

    def beating(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
        """``check``, polled with the worker's heartbeat before each look: the view stays fresh
        only while it hears its own advert."""

        async def poll() -> bool:
            await view.advertise(SidecarReport(role="worker", id="me"))
            return check()

        return poll

    try:
        # In a task group, as the worker runs it: a cancel scope cancels again at the watch's
        # next wait, where a plain task.cancel() was seen lost in its wait for an update (the
        # test hung at the end in 4 runs of 6).
        async with anyio.create_task_group() as tg:
            tg.start_soon(view.watch)
            await wait_until(beating(view.view_fresh), what="our own advert heard")
            for i in range(50):
                await kv.put(f"ghost{i}", msgspec.json.encode(SidecarReport(role="worker", id=f"ghost{i}", models=["m1"])))
            await wait_until(beating(lambda: len(view.peers()) == 19), what="the ghosts heard, up to the bound")
            assert view.heard == 20
            # No delete comes when they expire (the bucket's TTL, 0.3 s): they leave the view all the same.
            await wait_until(beating(lambda: view.heard == 1), timeout_s=10, what="the expired adverts forgotten")
            assert view.peers() == {}
            tg.cancel_scope.cancel()
    finally:
        await view.stop()
        await nc.close()


async def test_the_workers_bucket_lost_with_a_server_restart_is_made_again(tmp_path: Path) -> None:
    """The workers' bucket is memory state: a nats-server restart loses it. Found with the
    recovery benchmark (an 8 s outage): from then on every advert and every load claim of the
    worker waited out a 1 s timeout and failed, so each load cost a second more and no peer heard
    it again. The view opens the bucket again once its own advert goes unheard for a TTL, and
    keeps watching it."""
    with EmbeddedNats(store_dir=tmp_path / "store") as server:
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        view = ClusterView(nc.jetstream(), Subjects("p"), "me", heartbeat_s=0.1, peer_timeout_s=0.3)
        await view.start()

        async def advertised() -> bool:
            await view.advertise(SidecarReport(role="worker", id="me"))
            return view.view_fresh()

        async def claimed() -> bool:
            fresh = await advertised()  # the worker's heartbeat, which notices the loss
            ok = await view.claim(["m1"])
            await view.release(["m1"])
            return fresh and ok is True

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(view.watch)
                await wait_until(advertised, what="our own advert heard")
                await anyio.to_thread.run_sync(server.restart)
                await wait_until(lambda: nc.is_connected, what="reconnected")
                await wait_until(claimed, timeout_s=10, what="claims taken and our own advert heard again")
                tg.cancel_scope.cancel()
        finally:
            await view.stop()
            await nc.close()


async def test_a_second_live_worker_under_one_id_is_refused_or_reported(nats_url: str, prefix: str) -> None:
    """Found by an attack: two live workers started under one id (a copied config) swapped their
    models about every 0.1 s (465 loads where 2 would do), each taking the other's residency and
    claims for its own, and nothing said why. A worker that finds its id advertised by a live
    worker (an advert put again while it looks) refuses to start; one whose id an advert it did
    not put arrives under at runtime (two started together) counts it and says so. A dead
    process's advert under the id (a restart) is neither."""
    conns = [await nats.connect(nats_url) for _ in range(3)]
    subjects = Subjects(prefix)
    first = ClusterView(conns[0].jetstream(), subjects, "dup", heartbeat_s=0.2)
    try:
        await first.start()
        async with anyio.create_task_group() as tg:

            stopped = anyio.Event()

            async def heartbeat() -> None:
                # The worker's advert loop: an advert every heartbeat until the test is done.
                while not stopped.is_set():
                    await first.advertise(SidecarReport(role="worker", id="dup", resident=["m1"], started_at=1000.0))
                    with anyio.move_on_after(first.heartbeat_s):
                        await stopped.wait()

            tg.start_soon(heartbeat)
            tg.start_soon(first.watch)
            await wait_until(lambda: first.view_fresh(), what="the first worker's advert heard")
            second = ClusterView(conns[1].jetstream(), subjects, "dup", heartbeat_s=0.2)
            with pytest.raises(cluster.DuplicateWorkerId, match="'dup' is in use by another live worker"):
                await second.start()
            # One that got past the check (both started together) puts its own adverts: the first
            # hears adverts under its id it did not put.
            await second.advertise(SidecarReport(role="worker", id="dup", resident=["m2"], started_at=2000.0))
            await wait_until(lambda: first.duplicate_adverts >= 1, what="the foreign advert counted")
            # Its own adverts, however late they come back (an outage), are never counted.
            assert first.duplicate_adverts == 1
            stopped.set()
            tg.cancel_scope.cancel()
        # The first stops beating, as a killed process does: a restart under its id starts
        # (its advert, still in the bucket until the TTL, is put again by nobody).
        restarted = ClusterView(conns[2].jetstream(), subjects, "dup", heartbeat_s=0.2)
        await restarted.start()
        await restarted.stop()
    finally:
        await first.stop()
        for nc in conns:
            await nc.close()


async def test_a_restarted_worker_never_counts_its_killed_predecessor_as_a_live_peer(nats_url: str, prefix: str) -> None:
    """A worker killed (-9) leaves its last advert in the bucket until the TTL; its replacement
    (a new process, a new id) read it with the bucket's contents and counted it as a live peer
    for a whole peer timeout (5 s): its in-flight requests hid backlog and its models looked
    served. An advert only read from the contents counts until 1.5 heartbeats after it was put,
    unless heard put again; a live peer, which puts every heartbeat, stays in view."""
    conns = [await nats.connect(nats_url) for _ in range(3)]
    subjects = Subjects(prefix)
    dead, live, restarted = (ClusterView(nc.jetstream(), subjects, wid, heartbeat_s=1.0) for nc, wid in zip(conns, ("w-dead", "w-live", "w-new")))
    try:
        for view in (dead, live):
            await view.start()
        async with anyio.create_task_group() as tg:
            stopped = anyio.Event()

            async def beat(view: ClusterView) -> None:
                while not stopped.is_set():
                    await view.advertise(SidecarReport(role="worker", id=view.worker_id, resident=["m1"], in_flight={"m1": 4}, started_at=1.0))
                    with anyio.move_on_after(view.heartbeat_s):
                        await stopped.wait()

            tg.start_soon(beat, live)
            await dead.advertise(SidecarReport(role="worker", id="w-dead", resident=["m2"], in_flight={"m2": 8}, started_at=1.0))
            killed_at = anyio.current_time()  # it puts nothing more, as a killed process
            await restarted.start()
            tg.start_soon(restarted.watch)
            tg.start_soon(beat, restarted)
            await wait_until(lambda: restarted.heard == 3 and restarted.view_fresh(), what="the bucket read and our own advert heard")
            await wait_until(lambda: "w-dead" not in restarted.peers(), timeout_s=2.5, what="the dead predecessor out of view")
            assert anyio.current_time() - killed_at < 2.5  # the peer timeout (5 s) kept it before
            assert restarted.not_ours() == {"m1": 4}  # what the dead one held is backlog again
            # Its own snapshot window ended before the dead one's: it is in view on a live put.
            assert set(restarted.peers()) == {"w-live"}
            stopped.set()
            tg.cancel_scope.cancel()
    finally:
        for view in (dead, live, restarted):
            await view.stop()
        for nc in conns:
            await nc.close()
