"""Load claims (sidecar/cluster.py) against a real nats-server: a placement change claims every
model it touches, all or nothing, so two workers can never swap models at the same moment."""

from __future__ import annotations

import asyncio

import nats
import pytest

from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.cluster import ClusterView

pytestmark = pytest.mark.anyio


async def _views(url: str, prefix: str, n: int) -> tuple[list[ClusterView], list[nats.NATS]]:
    conns = [await nats.connect(url) for _ in range(n)]
    views = [ClusterView(nc.jetstream(), Subjects(prefix), f"w{i}", heartbeat_s=5.0) for i, nc in enumerate(conns)]
    for v in views:
        await v.start()
    return views, conns


async def test_two_simultaneous_swaps_cannot_both_claim(nats_url: str, prefix: str) -> None:
    views, conns = await _views(nats_url, prefix, 2)
    try:
        for _ in range(10):
            # A: load m2 evicting m1; B: load m1 evicting m2. Started together, every time.
            a, b = await asyncio.gather(views[0].claim(["m2", "m1"]), views[1].claim(["m1", "m2"]))
            assert sorted([a, b]) == [False, True], (a, b)
            winner = views[0] if a else views[1]
            await winner.release(["m1", "m2"])
    finally:
        for v in views:
            await v.stop()
        for nc in conns:
            await nc.close()


async def test_a_lost_claim_gives_back_what_it_took(nats_url: str, prefix: str) -> None:
    views, conns = await _views(nats_url, prefix, 2)
    try:
        assert await views[0].claim(["m2"]) is True
        assert await views[1].claim(["m1", "m2"]) is False  # m1 was taken first, then given back
        assert await views[0].claim(["m1"]) is True
        await views[0].release(["m1", "m2"])
        assert await views[1].claim(["m1", "m2"]) is True
        await views[1].release(["m1", "m2"])
    finally:
        for v in views:
            await v.stop()
        for nc in conns:
            await nc.close()


async def test_disjoint_changes_go_ahead_together(nats_url: str, prefix: str) -> None:
    views, conns = await _views(nats_url, prefix, 2)
    try:
        a, b = await asyncio.gather(views[0].claim(["m1", "m2"]), views[1].claim(["m3", "m4"]))
        assert a is True and b is True
    finally:
        for v in views:
            await v.stop()
        for nc in conns:
            await nc.close()
