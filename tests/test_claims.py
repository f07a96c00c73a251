"""Load claims (sidecar/cluster.py) against a real nats-server: a placement change claims every
model it touches, all or nothing, so two workers can never swap models at the same moment."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import nats
import pytest

from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.cluster import ClusterView

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
