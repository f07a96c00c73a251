"""bench/ is thin scenarios on one harness: every scenario imports as ``bench.<group>.<name>``
without touching sys.path, imports no other scenario, writes no TOML by hand and starts its
servers and sidecars through the harness; and the harness's parts do what the scenarios rely on."""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from bench import harness
from bench.harness.raw import add_raw_streams, raw_replies, raw_requests
from jetbatch import sdk
from jetbatch.sidecar.config import Config, load_config

pytestmark = pytest.mark.anyio

BENCH = Path(__file__).resolve().parent.parent / "bench"
HARNESS = BENCH / "harness"
GROUPS = sorted(p.name for p in BENCH.iterdir() if p.is_dir() and p != HARNESS and (p / "__init__.py").exists())
SCENARIOS = sorted(f"{p.parent.name}.{p.stem}" for g in GROUPS for p in (BENCH / g).glob("*.py") if p.stem != "__init__")


def _source(name: str) -> str:
    return (BENCH / (name.replace(".", "/") + ".py")).read_text()


def _imported(name: str) -> set[str]:
    """Every module a scenario's import statements name (``from bench import harness`` names
    ``bench.harness``), at any depth (imports inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(_source(name))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_scenarios_are_grouped_and_nothing_lies_loose_beside_the_harness() -> None:
    assert set(GROUPS) >= {"scheduler", "overhead", "scale", "reliability", "models", "peers"}
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["__init__.py"]  # a scenario belongs to a group
    assert len(SCENARIOS) >= 30


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_imports_as_a_module_of_its_group(name: str) -> None:
    assert "sys.path" not in _source(name), f"bench/{name.replace('.', '/')}.py edits sys.path: run it as python -m bench.{name}"
    module = importlib.import_module(f"bench.{name}")
    assert module.__name__ == f"bench.{name}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_scenario_imports_another(name: str) -> None:
    """What two scenarios share belongs in the harness: a scenario imports bench.harness (and
    jetbatch), never a module of a group."""
    others = {m for m in _imported(name) if m.startswith("bench.") and not m.startswith("bench.harness")}
    assert others == set(), f"bench.{name} imports {sorted(others)}: move what it needs into bench/harness/"


def _strings(name: str) -> list[str]:
    """The string literals of a scenario's code (docstrings left out: they may quote a config)."""
    tree = ast.parse(_source(name))
    docs = {
        id(n.body[0].value) for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
        and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }  # fmt: skip
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_scenario_writes_toml_by_hand(name: str) -> None:
    """Configs for sidecars in processes go through harness.write_config, the one writer."""
    written = [m for m in ("[models.", "[worker]", "[nats]", "[streams]", "[classifier]") if any(m in text for text in _strings(name))]
    written += [m for m in ("tomli_w", "msgspec.toml") if m in _imported(name)]
    assert written == [], f"bench.{name} writes TOML by hand ({written}): use harness.write_config"


# What starts a nats-server or a jetbatch sidecar in this process; only the harness calls them.
_STARTERS = {"EmbeddedNats", "NatsCluster", "Deployment", "Worker", "Classifier"}


def _started(name: str) -> list[str]:
    """The starters a scenario calls, and the command lines it builds that run a sidecar
    (``-m jetbatch``) or the harness's raw processes itself."""
    out = []
    for node in ast.walk(ast.parse(_source(name))):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in _STARTERS:
                out.append(called)
        elif isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if "-m" in items and ({"jetbatch", "bench.harness.raw"} & set(items)):
                out.append("-m " + next(i for i in items if i in ("jetbatch", "bench.harness.raw")))
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_live_scenarios_start_servers_and_sidecars_only_through_the_harness(name: str) -> None:
    own = _started(name)
    assert own == [], f"bench.{name} starts {own} itself: use harness.server/cluster/in_process/processes/cli_processes"
    assert not {m for m in _imported(name) if m.startswith(("jetbatch.sidecar.dev.natsserver", "jetbatch.sidecar.dev.deployment"))}


def test_the_rule_checks_see_a_scenario_that_breaks_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The static checks above fail on the habits they forbid (a scenario importing a sibling,
    hand-written TOML, its own server), so their passing means something."""
    fake = tmp_path / "bench"
    (fake / "scale").mkdir(parents=True)
    (fake / "scale" / "bad.py").write_text(
        "from bench.overhead.deployed import x\n"
        "from jetbatch.sidecar.dev.natsserver import EmbeddedNats\n"
        "def f(p):\n    import bench.scale.many_models\n    p.write_text('[models.m]\\nhandler = \"sleep\"')\n    EmbeddedNats()\n"
        "    subprocess.Popen([sys.executable, '-m', 'jetbatch', 'worker'])\n"
    )
    monkeypatch.setitem(globals(), "BENCH", fake)
    assert _imported("scale.bad") >= {"bench.overhead.deployed", "bench.scale.many_models"}
    with pytest.raises(AssertionError, match="imports"):
        test_no_scenario_imports_another("scale.bad")
    with pytest.raises(AssertionError, match="by hand"):
        test_no_scenario_writes_toml_by_hand("scale.bad")
    assert _started("scale.bad") == ["EmbeddedNats", "-m jetbatch"]
    with pytest.raises(AssertionError, match="EmbeddedNats"):
        test_live_scenarios_start_servers_and_sidecars_only_through_the_harness("scale.bad")


def test_write_config_round_trips_sections_and_a_config(tmp_path: Path) -> None:
    """The one TOML writer: sections (nested tables, a model's inline options, a model name that
    is not a bare key, booleans, a None left out) read back as written, and a whole Config
    (every default spelled out) reads back equal."""
    sections: dict[str, Any] = {
        "nats": {"prefix": "wc1"}, "streams": {"replicas": 1, "consumers": "eager"},
        "worker": {"max_resident_models": 2, "prefetch_weights": False, "policy": None},
        "models": {"m-0": {"handler": "sleep", "max_batch_size": 16, "max_delay_s": 0.005, "options": {"load_cost_s": 0.2}}},
        "classifier": {"router": "rules", "default_model": "m-0"},
    }  # fmt: skip
    path = harness.write_config(sections, tmp_path, "wc")
    assert path == tmp_path / "wc.toml"
    read = tomllib.loads(path.read_text())
    assert read["models"]["m-0"]["options"] == {"load_cost_s": 0.2} and "policy" not in read["worker"]
    given = {**sections, "worker": {"max_resident_models": 2, "prefetch_weights": False}}  # None: the default
    assert load_config(str(path)) == msgspec.convert(given, Config)
    cfg = harness.config(given, tag="wc")
    assert load_config(str(harness.write_config(cfg, tmp_path, "whole"))) == cfg


def test_emit_appends_one_json_object_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs.jsonl"
    harness.emit({"run": 1, "x": 0.5}, str(out))
    harness.emit({"run": 2}, str(out))
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"run": 1, "x": 0.5}, {"run": 2}]
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"run": 1, "x": 0.5}, {"run": 2}]


async def test_in_process_worker_serves_a_gathered_burst(nats_url: str) -> None:
    cfg = harness.config({"models": {"ident": {"handler": "identity", "max_batch_size": 8, "max_delay_ms": 2}}}, tag="hb")
    other = harness.config({}, tag="hb")
    assert cfg.nats.prefix != other.nats.prefix  # runs on one server never share streams
    async with harness.in_process(cfg, nats_url) as worker, sdk.Client.connect(nats_url, prefix=cfg.nats.prefix) as client:
        run = await harness.gather(lambda: client.infer(b"abc", model="ident", timeout=30), 40, 8)
        assert run.results == [b"abc"] * 40
        assert run.rate > 0
        assert worker.stats["loads"] == 1


async def test_the_stored_raw_loop_stores_every_reply_and_acks_every_request(nats_url: str, prefix: str) -> None:
    """The baseline of ``--raw-stored``: every reply lands in the results stream, on the subjects
    its caller listens on (every caller answered), and every request is acked (the work queue
    empty)."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await add_raw_streams(js, prefix, stored=True)
        psub = await js.pull_subscribe(f"{prefix}.q", durable="c", stream=prefix.upper())
        stop = asyncio.Event()
        consumer = asyncio.create_task(raw_replies(nc, psub, stop, stored=True))
        _, latencies = await raw_requests(nc, prefix, 30, 8, b"x", stored=True)
        stop.set()
        await consumer
        assert len(latencies) == 30
        assert (await js.stream_info(f"{prefix.upper()}_R")).state.messages == 30
        assert (await js.stream_info(prefix.upper())).state.messages == 0
    finally:
        await nc.close()


@pytest.mark.parametrize("fast_ingest", [False, True], ids=["relay", "fast-ingest relay"])
async def test_the_raw_twin_of_the_classifier_path_relays_every_request_once_and_answers_it(nats_url: str, prefix: str, fast_ingest: bool) -> None:
    """The baseline of ``--raw-relayed`` (and ``--relay-fast-ingest``): every request published to
    the ingress stream is republished once to the consumer's stream and acked there, and its
    caller is answered from the results stream; both work queues end empty."""
    from bench.harness.raw import raw_relay, raw_relay_fast

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await add_raw_streams(js, prefix, stored=True, relayed=True, fast_ingest=fast_ingest)
        ingress = await js.pull_subscribe(f"{prefix}.in", durable="relay", stream=f"{prefix.upper()}_IN")
        queue = await js.pull_subscribe(f"{prefix}.q", durable="c", stream=prefix.upper())
        stop = asyncio.Event()
        relay = asyncio.create_task((raw_relay_fast if fast_ingest else raw_relay)(nc, ingress, prefix, stop))
        consumer = asyncio.create_task(raw_replies(nc, queue, stop, stored=True))
        _, latencies = await raw_requests(nc, prefix, 40, 8, b"x", stored=True, relayed=True)
        stop.set()
        await asyncio.gather(relay, consumer)
        assert len(latencies) == 40
        assert (await js.stream_info(f"{prefix.upper()}_R")).state.messages == 40
        for stream in (f"{prefix.upper()}_IN", prefix.upper()):
            assert (await js.stream_info(stream)).state.messages == 0
        assert (await js.stream_info(prefix.upper())).state.last_seq == 40  # each relayed once
    finally:
        await nc.close()


def test_sampled_stacks_are_charged_to_the_package_on_top_and_idle_waits_left_out(tmp_path: Path) -> None:
    """bench.overhead.process_profiles --sampler py-spy: each busy sample counts for the function on top
    of its stack (a socket write to asyncio, not to the jetbatch code that published); the
    event loop's epoll wait and an idle pool thread are not busy."""
    from bench.overhead.process_profiles import spy_summary

    raw = tmp_path / "worker.spy"
    raw.write_text(
        "run (sidecar/cli/worker.py:17);BaseEventLoop._run_once (asyncio/base_events.py:1910);EpollSelector.select (selectors.py:468) 50\n"
        "run (sidecar/cli/worker.py:17);Replier.deliver (sidecar/replies.py:140);_SelectorSocketTransport.write (asyncio/selector_events.py:1057) 7\n"
        "run (sidecar/cli/worker.py:17);parse_header_lines (sdk/connection.py:81) 2\n"
        "run (sidecar/cli/worker.py:17);parse_header_lines (sdk/connection.py:86) 1\n"
        "_bootstrap (threading.py:1002);WorkerThread.run (anyio/_backends/_asyncio.py:900);Condition.wait (threading.py:327) 40\n"
        "Parser.parse (nats/protocol/parser.py:193) 4\n"
    )
    busy, groups, functions = spy_summary(raw)
    assert busy == 14
    assert groups == {"asyncio": 7, "jetbatch SDK": 3, "nats-py": 4}
    assert functions["parse_header_lines (sdk/connection.py)"] == 3  # lines of one function together


def test_the_consumer_sides_messages_are_counted_per_connection_over_the_round() -> None:
    """bench.harness.rounds (bench.overhead.deployed's records): what each consumer-side connection published and was sent during a round,
    a connection made during it counted from zero (a sidecar's reconnect), per request."""
    from bench.harness.rounds import msgs_per_request

    before = {1: ("jetbatch-worker", 100, 50), 2: ("jetbatch-classifier", 10, 10)}
    after = {1: ("jetbatch-worker", 300, 250), 2: ("jetbatch-classifier", 10, 10), 3: ("jetbatch-worker", 20, 40)}
    counted = msgs_per_request(before, after, 100)
    assert counted["consumer_published"] == pytest.approx(2.2) and counted["consumer_received"] == pytest.approx(2.4)
    # Which hop pays what: the worker's two connections (one since the round began) together.
    assert counted["consumer_msgs_by_connection"] == {"jetbatch-classifier": [0.0, 0.0], "jetbatch-worker": [2.2, 2.4]}


async def _republished_round(nc: Any, prefix: str, *, protocol_headers: bool) -> tuple[Any, Any]:
    """Ten requests with random ids through the stored raw loop whose request stream republishes
    their headers (``protocol_headers``: the raw twin's), every one answered; the JetStream
    context and the subscription to the republished headers."""
    js = nc.jetstream()
    await add_raw_streams(js, prefix, stored=True, republish=True)
    arrived = await nc.subscribe(f"{prefix}.arrived")
    psub = await js.pull_subscribe(f"{prefix}.q", durable="c", stream=prefix.upper())
    stop = asyncio.Event()
    consumer = asyncio.create_task(raw_replies(nc, psub, stop, stored=True, protocol_headers=protocol_headers, prefix=prefix))
    _, latencies = await raw_requests(nc, prefix, 10, 4, b"x", stored=True, random_ids=True, protocol_headers=protocol_headers)
    stop.set()
    await consumer
    assert len(latencies) == 10
    return js, arrived


async def test_the_stored_raw_loop_republishes_and_takes_random_ids_as_jetbatch_does(nats_url: str, prefix: str) -> None:
    """``bench.overhead.server_profile``'s and ``--raw-republished``'s variants of the baseline: its request
    stream republishes each stored request's headers, and its ids are 32 random hex characters."""
    nc = await nats.connect(nats_url)
    try:
        _, arrived = await _republished_round(nc, prefix, protocol_headers=False)
        events = [await arrived.next_msg(timeout=10) for _ in range(10)]
        assert all(e.data == b"" and len(e.headers["Nats-Msg-Id"]) == 32 for e in events)
        assert len({e.headers["Nats-Msg-Id"] for e in events}) == 10
    finally:
        await nc.close()


async def test_the_raw_twin_carries_jetbatchs_headers_and_answers_under_the_key(nats_url: str, prefix: str) -> None:
    """``--raw-twin``: the stored raw loop asking nats-server for jetbatch's work. Its requests
    carry the SDK's four headers and no ``Reply``; each answer is stored at
    ``<prefix>.r.<key>.<id>`` (as a worker builds it) with a jetbatch answer's five headers; every
    caller is answered and every request acked."""
    nc = await nats.connect(nats_url)
    try:
        js, arrived = await _republished_round(nc, prefix, protocol_headers=True)
        request = (await arrived.next_msg(timeout=10)).headers
        assert {"Nats-Msg-Id", "Jetbatch-Reply-Key", "Content-Type", "Jetbatch-Deadline"} <= set(request) and "Reply" not in request
        answer = await js.get_last_msg(f"{prefix.upper()}_R", f"{prefix}.r.{request['Jetbatch-Reply-Key']}.{request['Nats-Msg-Id']}")
        assert set(answer.headers) == {"Jetbatch-Model", "Jetbatch-Batch", "Jetbatch-Status", "Jetbatch-Request-Id", "Content-Type"}
        assert answer.headers["Jetbatch-Request-Id"] == request["Nats-Msg-Id"]
        assert (await js.stream_info(f"{prefix.upper()}_R")).state.messages == 10
        assert (await js.stream_info(prefix.upper())).state.messages == 0
    finally:
        await nc.close()


@pytest.mark.parametrize("relayed", [False, True], ids=["twin", "relayed twin"])
async def test_the_one_process_twins_answer_every_request(nats_url: str, relayed: bool) -> None:
    """``bench.overhead.in_process --raw-twin`` / ``--raw-relayed-twin``: the same twin in one process, its
    streams wired to its prefix (a reply under the wrong subject is never answered) and removed
    after the round."""
    from bench.harness.raw import raw_round

    rate, latencies = await raw_round(nats_url, 20, 4, b"x", relayed=relayed, twin=True)
    assert len(latencies) == 20 and rate > 0
    nc = await nats.connect(nats_url)
    try:
        names = [s.config.name for s in await nc.jetstream().streams_info()]
        assert not [n for n in names if n.startswith("RAW")]
    finally:
        await nc.close()


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _pb(field: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _pb_varint(field << 3) + _pb_varint(value)
    return _pb_varint(field << 3 | 2) + _pb_varint(len(value)) + value


def test_a_go_cpu_profile_is_read_into_each_functions_inclusive_and_self_cpu(tmp_path: Path) -> None:
    """``bench.harness.pprof`` against a profile.proto written by hand: main calls f (10 ms on top) and
    g (30 ms), g inlined into main's location for one sample."""
    import gzip

    from bench.harness.pprof import read_profile

    strings = ["", "samples", "count", "cpu", "nanoseconds", "main", "f", "g"]
    functions = [_pb(5, _pb(1, i) + _pb(2, name)) for i, name in ((1, 5), (2, 6), (3, 7))]
    locations = [_pb(4, _pb(1, i) + _pb(4, _pb(1, i))) for i in (1, 2, 3)]
    inlined = _pb(4, _pb(1, 4) + _pb(4, _pb(1, 3)) + _pb(4, _pb(1, 1)))  # g inlined into main
    packed = lambda *xs: b"".join(_pb_varint(x) for x in xs)  # noqa: E731
    samples = [
        _pb(2, _pb(1, packed(2, 1)) + _pb(2, packed(1, 10_000_000))),  # f <- main
        _pb(2, _pb(1, packed(3, 1)) + _pb(2, packed(2, 20_000_000))),  # g <- main
        _pb(2, _pb(1, 4) + _pb(2, 1) + _pb(2, 10_000_000)),  # g inlined in main, unpacked fields
    ]
    body = b"".join([_pb(1, _pb(1, 1) + _pb(2, 2)), _pb(1, _pb(1, 3) + _pb(2, 4)), *samples, *locations, inlined, *functions])
    body += b"".join(_pb(6, s.encode()) for s in strings)
    path = tmp_path / "cpu.pb.gz"
    path.write_bytes(gzip.compress(body))
    profile = read_profile(path)
    assert profile.total_ns == 40_000_000
    assert profile.inclusive_ns == {"main": 40_000_000, "f": 10_000_000, "g": 30_000_000}
    assert profile.self_ns == {"f": 10_000_000, "g": 30_000_000}
    assert profile.share("g") == 0.75 and profile.share("absent") == 0.0
