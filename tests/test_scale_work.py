"""What a worker does per count, per turn and per heartbeat does not grow with the number of
models it registers, only with the models that are waiting, on the device, loading or holding
something (issue 55: at 10 000 registered models, walks over every slot at each count and each
heartbeat were a third of the worker's samples). Checked by counting the slots each path reads,
not by timing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import nats
import pytest
from jetbatch.sdk.protocol import SidecarReport, Subjects
from jetbatch.sidecar.cluster import ClusterView
from jetbatch.sidecar.registered import KnownSets, Shipping, models_digest
from jetbatch.sidecar.worker import loop

from tests.helpers import make_config, sleep_model, wait_until

pytestmark = pytest.mark.anyio


class CountingSlots(dict):  # type: ignore[type-arg]
    """The worker's slots, counting every slot read (a lookup, or one step of a walk over the
    values or items) and every name a walk over the keys yields."""

    reads = 0
    names = 0

    def __getitem__(self, key: str) -> Any:
        self.reads += 1
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        for value in super().values():
            self.reads += 1
            yield value

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        for item in super().items():
            self.reads += 1
            yield item

    def __iter__(self) -> Iterator[str]:
        for key in super().__iter__():
            self.names += 1
            yield key


async def _work_done(url: str, prefix: str, registered: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int]]:
    """A worker registering ``registered`` models, five of them waiting, one holding requests
    back: the slots read (and names walked) by a count, a turn, and a report."""
    made = loop._make_slots
    monkeypatch.setattr(loop, "_make_slots", lambda config, handlers, device: CountingSlots(made(config, handlers, device)))
    config = make_config(prefix, {f"m{i:05d}": sleep_model() for i in range(registered)})
    nc = await nats.connect(url)
    try:
        worker = loop.Worker(config, nc)
        slots = worker.slots
        assert isinstance(slots, CountingSlots)
        now = time.time()
        for i in range(5):
            worker.queues.reconcile(slots[f"m{i:05d}"], 3, now, mine=0, not_ours=0)
        worker.queues.found_empty(slots["m00000"], now, 30.0)
        assert slots["m00000"].unfetchable == 3 and len(worker.queues.waiting) == 4
        stored = {config.subjects.model(f"m{i:05d}"): 3 for i in range(5)}
        work: dict[str, tuple[int, int]] = {}
        for what, step in (
            ("count", lambda: worker.queues.counted(stored, None, now, subjects=config.subjects, mine={}, not_ours={}, mine_bulk={})),
            ("hand back", None),
            ("turn", lambda: worker.executor.turn(now)),
            ("report", worker.report),
        ):
            slots.reads = slots.names = 0
            if step is None:
                await worker.lines.hand_back_leftovers()  # what every count hands back
            else:
                step()
            work[what] = (slots.reads, slots.names)
        report = worker.report()
        assert report.unfetchable == {"m00000": 3} and sorted(report.backlog) == [f"m{i:05d}" for i in range(1, 5)]
        assert len(report.models) == registered  # the status answer still names every model
        return work
    finally:
        await nc.close()


async def test_a_count_a_turn_and_a_report_read_as_many_slots_at_3000_models_as_at_100(
    nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    few = await _work_done(nats_url, f"{prefix}a", 100, monkeypatch)
    many = await _work_done(nats_url, f"{prefix}b", 3000, monkeypatch)
    for what in few:
        assert many[what][0] == few[what][0], f"{what}: {few[what][0]} slots read at 100 models, {many[what][0]} at 3000"
    # No walk over the names either, but the report's list of them (the status answer's).
    assert {what: names for what, (_, names) in many.items()} == {"count": 0, "hand back": 0, "turn": 0, "report": 3000}


def test_a_reader_keeps_a_peers_set_across_adverts_that_carry_only_its_digest() -> None:
    names = [f"m{i}" for i in range(50)]
    digest = models_digest(names)
    assert digest == models_digest(reversed(names)) and digest != models_digest(names[1:])
    known = KnownSets()
    full = SidecarReport(role="worker", id="w1", models=names, models_digest=digest, models_count=50)
    short = SidecarReport(role="worker", id="w1", models_digest=digest, models_count=50)
    known.heard("w1", short)
    assert known.of("w1", short) is None  # never named: not known
    known.heard("w1", full)
    known.heard("w1", short)
    assert known.of("w1", short) == frozenset(names)
    changed = SidecarReport(role="worker", id="w1", models_digest=models_digest(names[1:]), models_count=49)
    known.heard("w1", changed)
    assert known.of("w1", changed) is None  # its set changed: unknown until named again
    older = SidecarReport(role="worker", id="w1", models=names)  # an older worker names them every time
    known.heard("w1", older)
    assert known.of("w1", older) == frozenset(names)


def test_the_names_go_out_when_the_set_changes_when_a_peer_joins_and_at_a_low_rate() -> None:
    shipping = Shipping(every_s=30.0)
    assert shipping.due("d1", 0.0)  # the first advert
    shipping.sent("d1", 0.0, True)
    assert not shipping.due("d1", 1.0)
    assert shipping.due("d2", 1.0)  # changed
    shipping.newcomer()
    assert shipping.due("d1", 2.0)
    shipping.sent("d1", 2.0, True)
    assert not shipping.due("d1", 31.0) and shipping.due("d1", 32.0)


async def test_an_advert_does_not_grow_with_the_registered_models_once_peers_know_them(nats_url: str, prefix: str) -> None:
    """Against a real bucket: after the first advert (which names every model), a worker's
    adverts carry a digest and a count, the same size at 10 and at 10 000 models; a peer that
    joins gets the names in the next advert, and keeps them across the short ones."""
    nc = await nats.connect(nats_url)
    subjects = Subjects(prefix)
    try:
        sizes: dict[int, list[int]] = {}
        for n in (10, 10_000):
            view = ClusterView(nc.jetstream(), subjects, f"w{n:05d}", heartbeat_s=5.0)
            await view.start()
            kv = await nc.jetstream().key_value(subjects.kv_bucket)
            names = [f"model-{i:05d}" for i in range(n)]
            report = SidecarReport(role="worker", id=f"w{n:05d}", models=names)
            sizes[n] = []
            for _ in range(3):
                await view.advertise(report, names=names)
                sizes[n].append(len((await kv.get(f"w{n:05d}")).value))
            await view.stop()
        assert sizes[10_000][0] > 100_000  # the first names them all
        # The rest: a digest and a count (two more digits at 10 000), whatever the set.
        assert sizes[10_000][1] == sizes[10_000][2] <= sizes[10][1] + 3 and sizes[10][1] == sizes[10][2]

        # A peer that starts after the names went out reads a short advert first: the set is not
        # known to it until the next advert, which names them because the peer is new.
        first = ClusterView(nc.jetstream(), subjects, "first", heartbeat_s=5.0)
        peer = ClusterView(nc.jetstream(), subjects, "peer", heartbeat_s=5.0)
        names = [f"model-{i:05d}" for i in range(10_000)]
        report = SidecarReport(role="worker", id="first", models=names)
        async with anyio.create_task_group() as tg:
            await first.start()
            tg.start_soon(first.watch)
            await first.advertise(report, names=names)
            await first.advertise(report, names=names)  # short: nobody new heard
            await peer.start()
            tg.start_soon(peer.watch)
            await wait_until(lambda: "first" in peer._peers, timeout_s=10, what="the short advert read")
            assert not peer._peers["first"].models and peer.registered("first") is None
            await peer.advertise(SidecarReport(role="worker", id="peer", models=["x"]))
            await wait_until(lambda: "peer" in first._peers, timeout_s=10, what="the peer heard")
            await first.advertise(report, names=names)  # the newcomer gets the names
            await wait_until(lambda: peer.registered("first") == frozenset(names), timeout_s=10, what="the names")
            await first.advertise(report, names=names)
            await wait_until(lambda: not peer._peers["first"].models, timeout_s=10, what="a short advert again")
            assert peer.registered("first") == frozenset(names) and peer._peers["first"].models_count == 10_000
            tg.cancel_scope.cancel()
        for v in (first, peer):
            await v.stop()
    finally:
        await nc.close()


def test_an_advert_decodes_in_an_older_reader_and_an_older_advert_in_a_newer_one() -> None:
    """New fields with defaults: a reader of the older shape ignores them, and an older advert
    (no digest) decodes with an empty one, which ``KnownSets`` takes as naming the whole set."""

    class OlderReport(msgspec.Struct, kw_only=True):
        role: str
        id: str
        models: list[str] = []

    new = SidecarReport(role="worker", id="w", models_digest="abc", models_count=3)
    assert msgspec.json.decode(msgspec.json.encode(new), type=OlderReport).models == []
    old = msgspec.json.decode(msgspec.json.encode(OlderReport(role="worker", id="w", models=["a"])), type=SidecarReport)
    assert old.models_digest == "" and old.models == ["a"]
