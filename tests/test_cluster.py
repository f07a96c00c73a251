"""Scale-out on a real 3-node NATS JetStream cluster with worker processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

import pytest

from jetbatch import sdk
from jetbatch.sidecar.dev.natsserver import NatsCluster
from jetbatch.sidecar.dev.deployment import Deployment
from tests.helpers import worker_reports

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    with NatsCluster(3) as c:
        yield c


def _config(
    tmp_path: Path, prefix: str, models: dict[str, dict[str, float]], *, ack_wait_s: float = 30.0, max_wait_ms: int = 3000, peer_timeout_s: float = 5.0
) -> Path:
    lines = [
        f'[nats]\nprefix = "{prefix}"\n',
        f"[streams]\nreplicas = 3\nack_wait_s = {ack_wait_s}\nmax_deliver = 10\n",
        f"[worker]\nmax_resident_models = 1\npoll_interval_ms = 100\nheartbeat_s = 0.3\npeer_timeout_s = {peer_timeout_s}\n",
    ]
    for name, opts in models.items():
        lines.append(
            f'[models.{name}]\nhandler = "sleep"\nmax_batch_size = 16\nmax_delay_ms = 5\n'
            f"load_cost_s = {opts['load_cost_s']}\nbatch_cost_s = {opts['batch_cost_s']}\nitem_cost_s = 0.0\nmax_wait_ms = {max_wait_ms}\n"
            f"options = {{ load_cost_s = {opts['load_cost_s']}, batch_cost_s = {opts['batch_cost_s']}, item_cost_s = 0.0 }}\n"
        )
    path = tmp_path / f"{prefix}.toml"
    path.write_text("\n".join(lines))
    return path


async def _load(url: str, prefix: str, mix: list[str], *, duration_s: float, concurrency: int) -> list[sdk.Result]:
    results: list[sdk.Result] = []
    unanswered: list[str] = []
    deadline = time.monotonic() + duration_s
    async with sdk.Client.connect(url, prefix=prefix) as client:

        async def caller(i: int) -> None:
            n = i
            while time.monotonic() < deadline:
                model = mix[n % len(mix)]
                n += concurrency
                try:
                    results.append(await client.infer_result(f"{model}-{n}".encode(), model=model, timeout=60))
                except sdk.RequestTimeout as exc:
                    unanswered.append(f"{model}: {exc.request_id}")
                    return

        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        if unanswered:
            # Where the queues stand, for whoever reads the failure (a request of this test went
            # unanswered once under the full suite, and was not seen again in 12 runs alone).
            consumers = []
            js = client.nats.jetstream()
            for info in await js.streams_info():
                if info.config.name.lower().startswith(prefix.lower()):
                    for c in await js.consumers_info(info.config.name):
                        consumers.append(
                            f"{info.config.name}/{c.name}: pending {c.num_pending}, ack pending {c.num_ack_pending}, "
                            f"redelivered {c.num_redelivered}, waiting {c.num_waiting}"
                        )
            raise AssertionError(f"unanswered within 60 s: {unanswered}; consumers: {consumers}")
    return results


def test_requests_survive_a_nats_node_dying(cluster: NatsCluster, tmp_path: Path) -> None:
    config = _config(tmp_path, "c1", {"m1": {"load_cost_s": 0.05, "batch_cost_s": 0.01}})
    with Deployment(config, nats_url=cluster.url, workers=1) as dep:

        async def scenario() -> list[object]:
            async with sdk.Client.connect(dep.url, prefix="c1") as client:
                first = await asyncio.gather(*(client.infer(f"a{i}".encode(), model="m1", timeout=60) for i in range(20)))
                cluster.nodes[2].kill()  # one of three: JetStream keeps a quorum
                second = await asyncio.gather(
                    *(client.infer(f"b{i}".encode(), model="m1", timeout=60) for i in range(40)), return_exceptions=True
                )
                return list(first) + list(second)

        try:
            outcome = asyncio.run(scenario())
        finally:
            cluster.nodes[2].restart()
            cluster.wait_for_jetstream()
    assert outcome == [f"a{i}".encode() for i in range(20)] + [f"b{i}".encode() for i in range(40)]


def test_three_workers_settle_on_three_models(cluster: NatsCluster, tmp_path: Path) -> None:
    models = {name: {"load_cost_s": 0.4, "batch_cost_s": 0.02} for name in ("a", "b", "c")}
    config = _config(tmp_path, "c2", models)
    with Deployment(config, nats_url=cluster.url, workers=3, log_level="INFO") as dep:
        try:
            results = asyncio.run(_load(dep.url, "c2", ["a", "b", "c"], duration_s=6.0, concurrency=24))
        except AssertionError as exc:
            # A model left unserved for a minute was seen twice under the full suite: what each
            # worker holds and says it did tells which part of the placement protocol stalled.
            reports = asyncio.run(worker_reports(dep.url, "c2"))
            raise AssertionError(f"{exc}\nworkers: {[(r.id, r.resident, r.loading, r.backlog, r.stats) for r in reports]}\n{dep.logs_tail(lines=40)}") from None
        reports = asyncio.run(worker_reports(dep.url, "c2"))
    assert len(reports) == 3
    resident = sorted(tuple(r.resident) for r in reports)
    assert resident == [("a",), ("b",), ("c",)], reports
    loads = sum(r.stats["loads"] for r in reports)
    assert loads <= 6, f"{loads} loads: workers thrashed ({[r.stats for r in reports]})"
    assert all(r.batch.model == r.output.decode().split("-")[0] for r in results)


def test_placement_stays_put_when_a_nats_node_is_lost(cluster: NatsCluster, tmp_path: Path) -> None:
    """Two workers, two equally busy models: one model each. Losing the node that leads the
    workers' bucket stalls their view of each other for a while; a worker that cannot hear its
    peer keeps its last view instead of concluding the peer left, so neither chases the other's
    model."""
    models = {name: {"load_cost_s": 0.4, "batch_cost_s": 0.02} for name in ("a", "b")}
    # A peer stalled past max_wait_ms, or silent past peer_timeout_s, while the cluster elects new
    # leaders (several seconds on a loaded 2-core host) is rightly helped or replaced by the other
    # worker. This test is about the stale view alone, so both are set above its 10 s window.
    config = _config(tmp_path, "c5", models, max_wait_ms=15000, peer_timeout_s=15.0)
    victim_index = None
    with Deployment(config, nats_url=cluster.url, workers=2, log_level="INFO") as dep:  # INFO: loads show in the failure message
        try:

            async def scenario() -> tuple[int, int, list[sdk.Result]]:
                settle = await _load(dep.url, "c5", ["a", "b"], duration_s=4.0, concurrency=16)
                before = sum(r.stats["loads"] for r in await worker_reports(dep.url, "c5"))
                nonlocal victim_index
                async with sdk.Client.connect(dep.url, prefix="c5") as client:
                    info = await client.nats.jetstream().stream_info("KV_C5_WORKERS")
                leader = info.cluster.leader if info.cluster else None
                victim_index = next((i for i, n in enumerate(cluster.nodes) if n.name == leader), 0)
                cluster.nodes[victim_index].kill()
                during = await _load(dep.url, "c5", ["a", "b"], duration_s=10.0, concurrency=16)
                after = sum(r.stats["loads"] for r in await worker_reports(dep.url, "c5"))
                return before, after, settle + during

            before, after, results = asyncio.run(scenario())
            logs = dep.logs_tail(lines=60)
        finally:
            if victim_index is not None:
                cluster.nodes[victim_index].restart()
                cluster.wait_for_jetstream()
    assert all(r.output.decode().split("-")[0] == r.batch.model for r in results)
    assert before <= 4, f"{before} loads before the node loss"
    assert after - before <= 1, f"{after - before} loads in 10 s after losing a node: placement thrashed\n{logs}"


def test_hot_model_gets_a_second_replica(cluster: NatsCluster, tmp_path: Path) -> None:
    models = {"hot": {"load_cost_s": 0.2, "batch_cost_s": 0.05}, "cold": {"load_cost_s": 0.2, "batch_cost_s": 0.05}}
    config = _config(tmp_path, "c3", models)
    with Deployment(config, nats_url=cluster.url, workers=2) as dep:
        results = asyncio.run(_load(dep.url, "c3", ["hot"] * 19 + ["cold"], duration_s=6.0, concurrency=128))
        reports = asyncio.run(worker_reports(dep.url, "c3"))
    second_half = results[len(results) // 2 :]  # appended in completion order
    workers_on_hot = {r.batch.worker for r in second_half if r.batch.model == "hot"}
    assert len(workers_on_hot) == 2, f"hot model served by {workers_on_hot} in the second half; {reports}"


def test_killed_worker_requests_are_redelivered_and_answered(cluster: NatsCluster, tmp_path: Path) -> None:
    models = {"m1": {"load_cost_s": 0.1, "batch_cost_s": 0.5}, "m2": {"load_cost_s": 0.1, "batch_cost_s": 0.5}}
    config = _config(tmp_path, "c4", models, ack_wait_s=2.0)
    with Deployment(config, nats_url=cluster.url, workers=2) as dep:

        async def scenario() -> list[sdk.Result]:
            async with sdk.Client.connect(dep.url, prefix="c4") as client:
                calls = [
                    asyncio.ensure_future(client.infer_result(f"{m}-{i}".encode(), model=m, timeout=60))
                    for i in range(30)
                    for m in ("m1", "m2")
                ]
                # Kill a worker once it is busy with a batch (its requests are in flight, unacked).
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    reports = await worker_reports(dep.url, "c4")
                    if all(r.resident for r in reports) and len(reports) == 2:
                        break
                victim = sorted(dep.procs)[0]
                dep.stop_process(victim, kill=True)
                return list(await asyncio.gather(*calls))

        results = asyncio.run(scenario())
        survivors = asyncio.run(worker_reports(dep.url, "c4"))
    assert len(results) == 60
    assert sorted(r.output for r in results) == sorted(f"{m}-{i}".encode() for i in range(30) for m in ("m1", "m2"))
    assert len(survivors) == 1
    # The survivor took over the victim's model as well.
    assert {r.batch.model for r in results if r.batch.worker == survivors[0].id} == {"m1", "m2"}
