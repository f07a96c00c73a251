"""The flight recorder and exact replay: a recorded core, simulated or live against a real
nats-server under mixed traffic, replays action for action; a changed recording is caught at its
first divergence; bad recordings are one-line errors."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from jetbatch import sdk
from jetbatch.sidecar.core import Action, Event, ModelRules, Started, WorkerCore
from jetbatch.sidecar.policy import POLICIES
from jetbatch.sidecar.recording import FlightRecorder, RecordLine, RecordingError, RingRecorder, replay, replay_file
from jetbatch.sidecar.simulator import simulate
from jetbatch.sidecar.simulator.workloads import build_workload
from tests.helpers import make_config, ring_worker_process, running_worker, sleep_model

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def _mixed_workload() -> object:
    """Bursts and Poisson arrivals over five models, two slots, a warm tier and prefetch,
    deadlines and cancelling callers, an idle unload."""
    models = {
        "a": {"load_cost_s": 0.3, "max_batch_size": 8, "deadline_s": 4.0},
        "b": {"load_cost_s": 0.1, "max_batch_size": 8, "cancel_after_s": 0.5},
        "c": {"load_cost_s": 1.0, "max_batch_size": 4, "memory_bytes": 100},
        "d": {"load_cost_s": 0.2, "max_batch_size": 16, "idle_unload_s": 2.0},
        "e": {"load_cost_s": 0.5, "max_batch_size": 8, "warm_load_cost_s": 0.05},
    }
    return build_workload({
        "models": models, "budget": {"max_models": 2}, "host": {"budget_bytes": 1000, "prefetch": True},
        "arrivals": {"kind": "onoff", "rate": 30.0, "duration_s": 20, "zipf": 1.0, "seed": 5},
    })  # fmt: skip


def test_a_simulated_run_replays_exactly(tmp_path: Path) -> None:
    path = tmp_path / "sim.jsonl"
    recorder = FlightRecorder(path)
    result = simulate(_mixed_workload(), "cost-aware", record=recorder)  # type: ignore[arg-type]
    recorder.close()
    assert result.completed > 0
    replayed = replay_file(path)
    assert replayed.ok, replayed.divergence
    assert replayed.by_action.get("fetch", 0) > 10 and replayed.by_action.get("load", 0) > 2
    assert not replayed.truncated


def test_a_changed_recording_diverges_at_its_first_changed_action(tmp_path: Path) -> None:
    path = tmp_path / "sim.jsonl"
    recorder = FlightRecorder(path)
    simulate(_mixed_workload(), "exhaustive", record=recorder)  # type: ignore[arg-type]
    recorder.close()
    lines = path.read_bytes().splitlines()
    target = next(i for i, line in enumerate(lines) if b'"type":"fetch"' in line and b'"action"' in line)
    lines[target] = lines[target].replace(b'"max_items":', b'"max_items":1', 1)
    result = replay(lines)
    assert not result.ok and result.divergence is not None
    assert result.divergence.line == target + 1
    # The CLI says where, and exits 1.
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = subprocess.run([sys.executable, "-m", "jetbatch", "replay", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"diverged at line {target + 1}" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "jetbatch", "replay", "--json", str(path)], capture_output=True, text=True, timeout=60)
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["ok"] is False and report["divergence"]["line"] == target + 1


def test_a_recording_stops_at_its_bound_and_replays_what_it_kept(tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"
    recorder = FlightRecorder(path, max_bytes=64 * 1024)
    simulate(_mixed_workload(), "cost-aware", record=recorder)  # type: ignore[arg-type]
    recorder.close()
    assert path.stat().st_size <= 64 * 1024 and recorder.truncated
    result = replay_file(path)
    assert result.ok and result.truncated and result.events > 10


@pytest.mark.parametrize("content", [b"", b"not json\n", b'{"event":{"type":"turn","now":1.0,"facts":[]}}\n', b'{"event":{"type":"started","policy":"nope","options":{},"models":{}}}\n'])
def test_bad_recordings_are_one_line_errors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(RecordingError):
        replay_file(path)
    out = subprocess.run([sys.executable, "-m", "jetbatch", "replay", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


async def test_a_live_run_under_mixed_traffic_replays_exactly(nats_url: str, prefix: str, tmp_path: Path) -> None:
    """A real worker, two slots over three models, bursts and a steady trickle, both priority
    lines, deadlines that pass and callers that give up: every action replays as recorded."""
    config = make_config(
        prefix,
        {
            "a": sleep_model(max_batch_size=4, options={"load_cost_s": 0.05, "batch_cost_s": 0.01, "item_cost_s": 0.0}),
            "b": sleep_model(max_batch_size=4, options={"load_cost_s": 0.05, "batch_cost_s": 0.01, "item_cost_s": 0.0}),
            "c": sleep_model(max_batch_size=8, idle_unload_s=0.5, options={"load_cost_s": 0.1, "batch_cost_s": 0.02, "item_cost_s": 0.0}),
        },
        worker={"max_resident_models": 2},
    )
    path = tmp_path / "live.jsonl"
    recorder = FlightRecorder(path)
    outcomes: list[str] = []

    async def call(client: sdk.Client, model: str, i: int, **kw: object) -> None:
        try:
            await client.infer(f"{model}{i}".encode(), model=model, **kw)  # type: ignore[arg-type]
            outcomes.append("ok")
        except sdk.JetbatchError as exc:
            outcomes.append(type(exc).__name__)

    async with running_worker(config, nats_url, record=recorder) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            for burst in range(3):
                async with anyio.create_task_group() as tg:
                    for i in range(12):
                        model = "abc"[(i + burst) % 3]
                        priority = "batch" if i % 4 == 0 else "interactive"
                        tg.start_soon(functools.partial(call, client, model, i, timeout=20, priority=priority))
                    # A caller whose deadline is shorter than a load: answered without it, or late.
                    tg.start_soon(functools.partial(call, client, "c", 99, timeout=0.05))
                # a trickle between bursts: holds, recounts and idles
                for i in range(5):
                    await call(client, "ab"[i % 2], 100 + i, timeout=20)
        worker.stop()
    recorder.close()
    assert outcomes.count("ok") >= 3 * 12 + 15
    result = replay_file(path)
    assert result.ok, result.divergence
    assert result.by_action.get("fetch", 0) >= 10 and result.by_action.get("load", 0) >= 3
    assert result.events > result.matched  # batches done, loads and checks were replayed too


# --- the ring: the last minutes, replayed from a snapshot of the core --------------------------


def _ring_run(tmp_path: Path, window_s: float, policy: str = "cost-aware") -> tuple[RingRecorder, Path]:
    """A simulated run recorded by a ring whose clock is the count of events it was told (a
    hundredth of a second each): no real time passes."""
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 0.01
        return ticks[0]

    ring = RingRecorder(window_s, clock=clock)

    class Attaching:  # what the live worker does at its start (Worker(record=...))
        def write(self, event: Event, action: Action | None) -> None:
            ring.write(event, action)

    recorder = Attaching()
    original = WorkerCore.__init__

    def init(self: WorkerCore, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        if self.recorder is recorder:
            ring.attach(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WorkerCore, "__init__", init)
        simulate(_mixed_workload(), policy, record=recorder)  # type: ignore[arg-type]
    path = tmp_path / "ring.jsonl"
    ring.dump(path)
    return ring, path


@pytest.mark.parametrize("policy", POLICIES)
def test_a_ring_keeps_the_last_windows_and_replays_from_its_snapshot(tmp_path: Path, policy: str) -> None:
    _, path = _ring_run(tmp_path, window_s=2.0, policy=policy)
    lines = path.read_bytes().splitlines()
    result = replay_file(path)
    assert result.ok and result.from_snapshot, result.divergence
    # Between one and two windows of events (200 to 400 ticks), not the whole run.
    assert 200 <= result.events <= 400
    # Without the snapshot the same events do not replay: the core's state is what it learnt.
    without = [lines[0], *lines[2:]]
    assert not replay(without).ok


def test_a_ring_snapshot_is_plain_json_an_operator_can_read(tmp_path: Path) -> None:
    """The snapshot is JSON data (no code, no base64): the core's fields, the policy's and the
    estimator's, with a non-finite float written as a string; it reads back bit for bit."""
    _, path = _ring_run(tmp_path, window_s=2.0)
    snapshot = json.loads(path.read_bytes().splitlines()[1])["snapshot"]
    assert set(snapshot) == {"core", "policy", "costs"}
    assert snapshot["policy"]["name"] == "cost-aware" and snapshot["policy"]["demand"]
    assert all(isinstance(v, (int, float, str)) for v in snapshot["core"]["last_used"].values())
    core = WorkerCore(json_started(path))
    core.import_state(snapshot)
    assert core.export_state() == snapshot  # the same data back: nothing lost, floats exact


def json_started(path: Path) -> Started:
    return msgspec.json.decode(path.read_bytes().splitlines()[0], type=RecordLine).event  # type: ignore[return-value]


def test_a_cores_state_round_trips_non_finite_floats_exactly() -> None:
    """inf, -inf, nan and the shortest and longest floats survive the JSON text unchanged."""
    started = Started(policy="cost-aware", options={}, models={"a": ModelRules(max_batch_size=4, load_cost_s=0.5, batch_cost_s=0.01, item_cost_s=0.001)})
    state = WorkerCore(started).export_state()
    assert state["core"]["idle_wake"] == "inf" and state["core"]["forget_at"] == "-inf"
    state["core"]["last_used"] = {"a": 0.1 + 0.2, "b": 5e-324, "c": "nan"}
    state["costs"]["fastest"] = {"a": 5e-324}
    state["policy"]["busy"] = 1.7976931348623157e308
    text = msgspec.json.encode(state)
    other = WorkerCore(started)
    other.import_state(msgspec.json.decode(text))
    assert other.last_used["a"] == 0.1 + 0.2 and other.last_used["b"] == 5e-324 and math.isnan(other.last_used["c"])
    assert other.idle_wake == math.inf and other.costs.deadline_estimate_s("a", 1) == 5e-324
    assert msgspec.json.encode(other.export_state()) == text


@pytest.mark.parametrize(
    ("snapshot", "message"),
    [
        ('"gASVIQAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAplY2hvIG93bmVklIWUUpQu"', "not a recorded step"),  # a pickle (os.system)
        ('{"core": {}, "policy": {"name": "fifo"}, "costs": {}}', "policy 'fifo', not of 'cost-aware'"),
        ('{"core": {"current": 3}, "policy": {"name": "cost-aware"}, "costs": {}}', "$.current"),
        ('{"core": {}, "policy": {"name": "cost-aware", "busy": "rm -rf"}, "costs": {}}', "$.busy"),
        ('{"core": {}, "policy": {"name": "cost-aware"}, "costs": {"load": [["a", "cold"]]}}', "$.load[0]"),
        ('{"core": {"__class__": "os.system"}, "policy": {"name": "cost-aware"}, "costs": {}}', "__class__"),
        ('{"core": {}, "policy": {"name": "cost-aware"}}', "core, policy and costs"),
    ],
)
def test_a_ring_snapshot_that_is_not_a_cores_state_is_a_one_line_error(tmp_path: Path, snapshot: str, message: str) -> None:
    _, path = _ring_run(tmp_path, window_s=2.0)
    lines = path.read_bytes().splitlines()
    lines[1] = b'{"snapshot": ' + snapshot.encode() + b"}"
    with pytest.raises(RecordingError, match="line 2: ") as raised:
        replay(lines)
    assert message in str(raised.value)
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = subprocess.run([sys.executable, "-m", "jetbatch", "replay", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


def test_the_worker_writes_its_ring_on_sigusr1(nats_url: str, prefix: str, tmp_path: Path) -> None:
    """`jetbatch worker --ring-minutes M --ring-path P`: SIGUSR1 writes the ring, and it replays."""
    import signal
    import time

    ring = tmp_path / "ring.jsonl"
    text = f'[nats]\nprefix = "{prefix}"\n[models.m1]\nhandler = "identity"\nmax_batch_size = 4\n'
    with ring_worker_process(nats_url, prefix, text, tmp_path, "--ring-path", str(ring)) as proc:
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not ring.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)  # polled with a deadline: the dump is written by the worker's loop
        assert ring.exists(), proc.stderr.read() if proc.poll() is not None and proc.stderr else "no ring written"
        result = replay_file(ring)
        assert result.ok and result.from_snapshot and result.events > 0, result
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
