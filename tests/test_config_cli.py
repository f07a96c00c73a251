"""Configuration errors are one line naming the file and key, with exit status 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jetbatch.sidecar.config import ConfigError, load_config, parse_config


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "jetbatch", *args], capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[models.m1]\nhandler = "sleep"\nmax_batch_size = "big"\n', "models.m1.max_batch_size: Expected `int`, got `str`"),
        # A number written as a string in the file is refused, not coerced (environment values are strings and coerce).
        ('[models.m1]\nhandler = "sleep"\nmax_batch_size = "16"\n', "models.m1.max_batch_size: Expected `int`, got `str`"),
        ('[worker]\nheartbeat_s = "1"\n', "worker.heartbeat_s: Expected `float`, got `str`"),
        ('[models.m1]\nhandler = "sleep"\nmax_batch_size = 0\n', "models.m1.max_batch_size: Expected `int` >= 1"),
        ('[models.m1]\nhandler = "sleep"\nbatch = 3\n', "models.m1: unknown key `batch`"),
        ('[models.m1]\nmax_batch_size = 3\n', "missing required key `handler`"),
        ('[models."a.b"]\nhandler = "sleep"\n', "invalid model name 'a.b'"),
        ('[worker]\npoll_interval_ms = 1\n', "worker.poll_interval_ms: Expected `float` >= 10"),
        # Found by an attack: an id that is no key of the workers' bucket served with every advert failing.
        ('[streams]\nmax_msg_size = 9223372036854775807\n', "streams.max_msg_size: Expected `int` <= 67108864"),  # refused by the server, after connecting
        ('[worker]\nid = "evil.>"\n', "worker.id: Expected `str` matching regex"),
        ('[worker]\nid = "a..b"\n', "worker.id: Expected `str` matching regex"),
        ('[classifier]\nid = "c 1"\n', "classifier.id: Expected `str` matching regex"),
        ("[models.m1\n", "invalid TOML"),
        ('[models.m1]\nhandler = "sleep"\nmax_delay_s = 0.01\nmax_delay_ms = 20\n', "models.m1.max_delay_s: 0.01 s and max_delay_ms: 20.0 ms disagree"),
        ('[models.m1]\nhandler = "sleep"\nmax_wait_s = -1\n', "models.m1.max_wait_s: Expected `float` > 0"),
        ('[models.m1]\nhandler = "sleep"\nmax_delay_s = inf\n', "models.m1.max_delay_s: Expected `float` <= 1000000000.0"),
        # Checked when the file is read, so the file is named before any connection is tried.
        ('[worker]\npolicy = "lifo"\n', "worker.policy: unknown policy 'lifo'"),
        # Pins that leave no room for the other models, by count or by bytes.
        ('[worker]\nmax_resident_models = 1\n[models.a]\nhandler = "sleep"\npin = true\n[models.b]\nhandler = "sleep"\n',
         "worker.max_resident_models: 1 pinned models (a) do not fit 1 slots and leave a slot for the other models"),
        ('[worker]\nmax_resident_models = 4\nmemory_budget_bytes = 100\n[models.a]\nhandler = "sleep"\npin = true\nmemory_bytes = 200\n',
         "worker.memory_budget_bytes: the pinned models (a) need 200 bytes, over 100"),
        ("[worker]\npolicy_options = { bogus = 1 }\n", "worker.policy_options: "),
        ('[classifier]\nrules = [{ header = "X", equals = "a", model = "bad name*" }]\n', "classifier.rules[0].model: invalid model name"),
        ('[classifier]\nrouter = "torch"\nhandler = "x:y"\nlabels = { "0" = "a b" }\n', "classifier.labels.0: invalid model name 'a b'"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path))
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ('handler = "nosuch.module:Thing"', "models.m1.handler: handler 'nosuch.module:Thing': cannot import nosuch.module"),
        ('handler = "jetbatch.sdk:Client"', "models.m1.handler: handler 'jetbatch.sdk:Client' is not a subclass of jetbatch.sidecar.handlers.Handler"),
        ('handler = "nohandler"', "models.m1.handler: handler 'nohandler' is neither a built-in"),
        ('handler = "state_dict"\npath = "w.safetensors"', "models.m1.module_class: the state_dict handler needs `module_class`"),
        ('handler = "state_dict"\npath = "w.safetensors"\nmodule_class = "nosuch:Net"', "models.m1.module_class: module_class 'nosuch:Net': cannot import nosuch"),
        ('handler = "state_dict"\npath = "w.safetensors"\nmodule_class = "jetbatch.sdk:Client"', "models.m1.module_class: module_class 'jetbatch.sdk:Client' is not a torch.nn.Module subclass"),
        ('handler = "export"', "models.m1.path: the export handler needs `path`"),
        ('handler = "function"\nfunction = "nosuch:f"', "models.m1.function: function 'nosuch:f': cannot import nosuch"),
    ],
)
def test_handler_config_errors_name_file_and_key(tmp_path: Path, model: str, expected: str) -> None:
    from jetbatch.sidecar.handlers import check_model_configs

    path = tmp_path / "models.toml"
    path.write_text(f"[models.m1]\n{model}\n")
    config = load_config(path)
    with pytest.raises(ConfigError) as info:
        check_model_configs(config.models, str(path))
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_model_file_is_not_a_config_error(tmp_path: Path) -> None:
    """The worker starts and reports the model broken (its requests get model_failed)."""
    from jetbatch.sidecar.handlers import check_model_configs

    path = tmp_path / "models.toml"
    path.write_text('[models.m1]\nhandler = "export"\npath = "ghost.pt2"\n')
    check_model_configs(load_config(path).models, str(path))


def test_a_worker_config_without_models_names_its_file(tmp_path: Path) -> None:
    """Found by an independent attack on the CLI: the line named neither the file nor the key."""
    path = tmp_path / "w.toml"
    path.write_text('[worker]\nid = "w1"\n')
    proc = run_cli("worker", "--config", str(path), "--nats-url", "nats://127.0.0.1:1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"jetbatch worker: {path}: no [models.<name>] section: a worker needs a model to serve"


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ('[nats]\ncreds_file = "/nonexistent.creds"\n', "nats.creds_file: file /nonexistent.creds not found"),
        ('[worker]\ndevice = "tpu9"\n', "worker.device: invalid device 'tpu9'"),
    ],
)
def test_a_worker_configs_connection_files_and_device_name_the_file(tmp_path: Path, section: str, expected: str) -> None:
    """Found by an independent attack on the CLI: these lines named neither the file nor (the
    device) the key."""
    path = tmp_path / "w.toml"
    path.write_text(section + '[models.m1]\nhandler = "sleep"\n')
    proc = run_cli("worker", "--config", str(path), "--nats-url", "nats://127.0.0.1:1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(f"jetbatch worker: {path}: {expected}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_classifier_handler_errors_name_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[classifier]\nrouter = "torch"\nhandler = "nosuch:Net"\nlabels = { "0" = "m1" }\n[models.m1]\nhandler = "sleep"\n')
    proc = run_cli("classifier", "--config", str(path), "--nats-url", "nats://127.0.0.1:1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"jetbatch classifier: {path}: classifier.handler: 'nosuch:Net': cannot import nosuch: no module named 'nosuch' in the working directory or on PYTHONPATH"


def test_seconds_at_the_boundary_and_the_milliseconds_of_0_2_as_aliases() -> None:
    cfg = parse_config('[models.a]\nhandler = "sleep"\nmax_delay_s = 0.02\nmax_wait_s = 3\n[models.b]\nhandler = "sleep"\n'
                       '[models.c]\nhandler = "sleep"\nmax_delay_ms = 20\nmax_wait_ms = 3000\n'
                       '[classifier]\nmax_delay_ms = 7\n')  # fmt: skip
    a, b, c = cfg.models["a"], cfg.models["b"], cfg.models["c"]
    assert (a.max_delay_s, a.max_wait_s) == (0.02, 3.0)
    assert (b.max_delay_s, b.max_wait_s) == (0.005, None)  # the defaults, as in workload files
    assert (c.max_delay_s, c.max_wait_s) == (0.02, 3.0)
    assert cfg.classifier is not None and cfg.classifier.max_delay_s == 0.007
    from jetbatch.sidecar.simulator import build_workload

    simulated = build_workload({"models": {"b": {"load_cost_s": 0.1, "batch_cost_s": 0.01, "item_cost_s": 0.0}}}).models["b"]
    assert (simulated.max_delay_s, simulated.max_wait_s) == (b.max_delay_s, b.max_wait_s)  # one default, live and simulated


def test_environment_overrides() -> None:
    text = '[models.m1]\nhandler = "sleep"\n'
    cfg = parse_config(text, environ={"JETBATCH_MODELS__m1__MAX_BATCH_SIZE": "32", "JETBATCH_WORKER__POLICY": "fifo", "NATS_URL": "nats://x:1"})
    assert cfg.models["m1"].max_batch_size == 32
    assert cfg.worker.policy == "fifo"
    assert cfg.nats.url == "nats://x:1"
    with pytest.raises(ConfigError, match="JETBATCH_MODELS__m1__MAX_BATCH_SIZE"):
        parse_config(text, environ={"JETBATCH_MODELS__m1__MAX_BATCH_SIZE": "many"})


def test_model_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "models.toml").write_text('[models.m1]\nhandler = "torchscript"\npath = "m1.pt"\n')
    assert load_config(tmp_path / "models.toml").models["m1"].path == str(tmp_path / "m1.pt")


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models.m1]\nhandler = "sleep"\nmax_delay_ms = -1\n')
    proc = run_cli("worker", "--config", str(path), "--nats-url", "nats://127.0.0.1:1")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(path) in lines[0] and "models.m1.max_delay_ms" in lines[0]


def test_cli_missing_config_file(tmp_path: Path) -> None:
    proc = run_cli("worker", "--config", str(tmp_path / "nope.toml"))
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("nope.toml: file not found")


def test_cli_unknown_policy_and_handler(tmp_path: Path, nats_url: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[worker]\npolicy = "psychic"\n[models.m1]\nhandler = "sleep"\n')
    proc = run_cli("worker", "--config", str(path), "--nats-url", nats_url)
    assert proc.returncode == 2 and "worker.policy" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    path.write_text('[models.m1]\nhandler = "nosuch.module:Thing"\n')
    proc = run_cli("worker", "--config", str(path), "--nats-url", "nats://127.0.0.1:1")  # refused before connecting
    assert proc.returncode == 2 and f"{path}: models.m1.handler: handler 'nosuch.module:Thing': cannot import nosuch.module" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_server_down_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models.m1]\nhandler = "sleep"\n')
    proc = run_cli("worker", "--config", str(path), "--nats-url", "nats://127.0.0.1:1", "--http-port", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "cannot connect to NATS at nats://127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Found by an attack: the credentials in the URL were printed with it.
    secret = run_cli("status", "--nats-url", "nats://alice:s3cret@127.0.0.1:1,nats://tok3n@127.0.0.1:2", "--wait", "0.2")
    assert secret.returncode == 2 and "s3cret" not in secret.stderr and "tok3n" not in secret.stderr, secret.stderr
    assert "nats://***@127.0.0.1:1, nats://***@127.0.0.1:2" in secret.stderr, secret.stderr


def test_cli_answers_help_version_status_dlq_and_probe_without_torch(nats_url: str, prefix: str) -> None:
    """The producer-side commands never import torch: with torch made unimportable they still
    run, and their failures are one line, never an ImportError."""
    runner = "import sys; sys.modules['torch'] = None; from jetbatch.sidecar.cli import main; sys.exit(main(sys.argv[1:]))"
    for argv, codes in (
        (["--help"], {0}),
        (["--version"], {0}),
        (["status", "--nats-url", nats_url, "--prefix", prefix, "--wait", "0.2"], {1}),  # nobody answers
        (["dlq", "list", "--nats-url", nats_url, "--prefix", prefix], {0, 2}),
        (["probe", "--port", "9"], {1}),
    ):
        r = subprocess.run([sys.executable, "-c", runner, *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode in codes, (argv, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "torch" not in r.stderr, (argv, r.stderr)


_WORKLOADS = {
    "models.json": '{"models": 5}',
    "zero.toml": '[models.m1]\nload_cost_s = 0.5\nmax_batch_size = 0\n',
    "negative.toml": "[models.m1]\nload_cost_s = -1\n",
    "typo.toml": "[models.m1]\nload_cost_s = 1\n[budget]\nmax_modelz = 1\n",
    "options.toml": "[models.m1]\nload_cost_s = 1\n[policy]\nbogus = 2\n",
    "huge.toml": '[models.m1]\nload_cost_s = 1\n[arrivals]\nkind = "poisson"\nrate = 1e8\n',
    "burst.toml": "[models.m1]\nload_cost_s = 0.1\n",
    "inf.toml": "[models.m1]\nload_cost_s = inf\n",
    # Found by a second attack on the CLI: each hung, or ended in a traceback.
    "idle.toml": '[models.m1]\nload_cost_s = 0.1\nidle_unload_s = 1e-20\n[arrivals]\nkind = "poisson"\nrate = 5\nduration_s = 2\n',
    "onoff.toml": '[models.m1]\nload_cost_s = 0.1\n[arrivals]\nkind = "onoff"\nrate = 10\non_s = 0.001\noff_s = 1e6\nduration_s = 10\n',
    "deep.toml": "a = " + "[" * 5000 + "]" * 5000 + "\n",
    "deep.json": "[" * 100_000 + "]" * 100_000,
    "bigint.json": '{"models": {"m1": {"load_cost_s": ' + "9" * 5000 + "}}}",
    "strict.toml": '[models.m1]\nload_cost_s = 0.1\nmax_batch_size = "8"\n',
    "trace.toml": '[models.m1]\nload_cost_s = 0.1\n[arrivals]\nkind = "trace"\npath = "deep.jsonl"\n',
    "deep.jsonl": "[" * 100_000 + "]" * 100_000 + "\n",
    "devzero.toml": '[models.m1]\nload_cost_s = 0.1\n[arrivals]\nkind = "trace"\npath = "/dev/zero"\n',
    "idle-config.toml": '[models.m1]\nhandler = "sleep"\nidle_unload_s = 1e-20\n',
    "empty-trace.toml": '[models.m1]\nload_cost_s = 0.1\n[arrivals]\nkind = "trace"\npath = "empty.jsonl"\n',
    "empty.jsonl": "\n",
}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["examples", "build", "--dir", "{file}"], "exists and is not a directory"),
        (["demo", "--dir", "{file}"], "exists and is not a directory"),
        (["demo", "--requests", "-5"], "must be >= 0"),
        (["demo", "--concurrency", "0"], "must be >= 1"),  # it hung forever
        # Found by an independent attack on the CLI: each printed a traceback, or (a concurrency of
        # 1e11) took all the memory and left the embedded server running when it was killed.
        (["demo", "--requests", "99999999999999"], "<= 1e+07"),
        (["bench", "--concurrency", "99999999999"], "<= 100000"),
        (["bench", "--concurrency", "2", "--mix", "m1=nan"], "not a finite number"),
        (["bench", "--concurrency", "2", "--payload", "bytes:-1"], "bytes:N must be 0 to"),
        (["bench", "--concurrency", "2", "--payload", "bytes:999999999999"], "bytes:N must be 0 to"),
        (["bench", "--concurrency", "2", "--payload", "tensor:x"], "takes a whole number"),
        (["simulate", "--workload", "{dir}/inf.toml"], "models.m1.load_cost_s: Expected `float`"),
        (["simulate", "--workload", "{dir}/models.json"], "models: Expected `object`, got `int`"),
        (["simulate", "--workload", "{dir}/zero.toml"], "models.m1.max_batch_size: Expected `int` >= 1"),
        (["simulate", "--workload", "{dir}/negative.toml"], "models.m1.load_cost_s: Expected `float` >= 0.0"),
        (["simulate", "--workload", "{dir}/typo.toml"], "budget: unknown key `max_modelz`"),
        (["simulate", "--workload", "{dir}/options.toml"], "options.toml: policy: "),
        (["simulate", "--workload", "{dir}/huge.toml"], "over 20000000 requests"),
        (["simulate", "--workload", "{dir}/burst.toml", "--policy", ""], "--policy: name at least one"),
        (["simulate", "--workload", "{dir}/idle.toml"], "models.m1.idle_unload_s: Expected `float` >= 0.01"),  # it hung
        (["simulate", "--workload", "{dir}/onoff.toml"], "shorter than one on/off cycle"),  # MemoryError
        (["simulate", "--workload", "{dir}/deep.toml"], "deep.toml: invalid TOML: nested too deep"),
        (["simulate", "--workload", "{dir}/deep.json"], "deep.json: invalid JSON: nested too deep"),
        (["simulate", "--workload", "{dir}/bigint.json"], "bigint.json: invalid JSON: "),
        (["simulate", "--workload", "{dir}/strict.toml"], "models.m1.max_batch_size: Expected `int`, got `str`"),  # it ran
        (["simulate", "--workload", "{dir}/trace.toml"], "arrivals.path: line 1: expected"),
        (["simulate", "--workload", "{dir}/devzero.toml"], "arrivals.path: /dev/zero: larger than"),
        (["simulate", "--workload", "/dev/zero"], "/dev/zero: larger than"),
        (["simulate", "--workload", "{dir}/empty-trace.toml"], "empty.jsonl holds no requests"),  # nan everywhere
        (["worker", "--config", "{dir}/idle-config.toml"], "models.m1.idle_unload_s: Expected `float` >= 0.01"),
        (["bench", "--rate", "1e308", "--duration", "1"], "<= 1e+06"),  # it never ended
        (["simulate", "--workload", "{dir}/burst.toml", "--plot", "{dir}/missing/x.png"], "does not exist"),
        (["bench", "--concurrency", "2", "--duration", "-1"], "must be > 0"),
        (["bench", "--concurrency", "2", "--out", "{dir}/missing/out.json"], "does not exist"),
        (["probe", "--timeout", "-1"], "must be > 0"),
        (["probe", "--timeout", "1e10"], "<= 604800"),  # a socket timeout's overflow, as a traceback
        (["status", "--wait", "1e10"], "<= 604800"),
        (["probe", "--host", "no such host!"], "expected a host name or address"),
        (["up", "--config", "{dir}/none.toml", "--port", "70000"], "out of range 0-65535"),
        (["up", "--config", "{dir}/none.toml", "--port", "-1"], "out of range 0-65535"),
        (["status", "--wait", "-1"], "must be > 0"),
        (["worker", "--config", "{dir}/none.toml", "--log-level", "VERBOSE"], "expected one of DEBUG"),
    ],
)
def test_cli_bad_arguments_are_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    """Found by a review that tried every subcommand with bad input: each of these printed a
    traceback, hung, or ran on nonsense. Each must be refused at once, in one line, with status 2."""
    (tmp_path / "afile").write_text("not a directory")
    for name, text in _WORKLOADS.items():
        (tmp_path / name).write_text(text)
    argv = [a.format(file=tmp_path / "afile", dir=tmp_path) for a in args]
    proc = run_cli(*argv, env={"JETBATCH_HOME": str(tmp_path / "home")}, timeout=30)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert expected in proc.stderr, proc.stderr
    # One line of error (argparse adds its usage line before its own).
    errors = [line for line in proc.stderr.splitlines() if line and not line.startswith(("usage:", " "))]
    assert len(errors) == 1, proc.stderr


def test_probe_at_a_port_that_is_not_http_is_one_line_and_exit_1(nats_url: str) -> None:
    """A health check pointed at the NATS port by mistake got a traceback (the server's INFO line
    is no HTTP status line): it is a port that does not answer as a sidecar, exit 1."""
    port = nats_url.rsplit(":", 1)[1]
    proc = run_cli("probe", "--port", port, "--timeout", "5", timeout=30)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip().count("\n") == 0 and "not an HTTP answer" in proc.stdout, proc.stdout


def _hostile_http(answer: str) -> tuple[int, Any]:
    """A listener that answers every connection as ``answer`` says: ``drip`` (a status line, one
    byte every 0.2 s), ``endless`` (200 and a body that never ends), ``huge`` (a Content-Length of
    10**8 and the body dripped). Returns the port and a function that stops it."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(4096)
                if answer == "drip":
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok":
                        if stop.wait(0.2):
                            return
                        conn.sendall(bytes([byte]))
                elif answer == "endless":
                    conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
                    while not stop.is_set():
                        conn.sendall(b"A" * 65536)
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n")
                    while not stop.wait(0.2):
                        conn.sendall(b"A")
            except OSError:
                return

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def close() -> None:
        stop.set()
        server.close()

    return server.getsockname()[1], close


@pytest.mark.parametrize("answer", ["drip", "endless", "huge"])
def test_a_probe_ends_within_its_timeout_whatever_answers(answer: str) -> None:
    """Found by an attack: `probe --timeout 2` against a server that dripped its answer byte by
    byte ran on past 40 s (urllib's timeout is per socket read), and one that sent an endless body
    was read whole into memory (MemoryError). A port now gets one deadline for the whole exchange
    and at most 4 KiB of answer, one short line printed, well before the subprocess's own limit: a
    status line that did not come in time is no answer (exit 1); a 200 that came is the answer,
    however its body goes on."""
    port, close = _hostile_http(answer)
    try:
        proc = run_cli("probe", "--port", str(port), "--timeout", "1", timeout=30)
    finally:
        close()
    assert proc.returncode == (1 if answer == "drip" else 0), (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stdout.strip().splitlines()) == 1, proc.stdout + proc.stderr
    assert len(proc.stdout) < 400


def test_probe_arguments_that_are_no_host_or_model_are_one_line() -> None:
    """Found by an attack: `--host '[::1'` and a `--model` that is not UTF-8 ended in tracebacks."""
    for args, expected in ((["--host", "[::1"], "expected a host name or address"), (["--model", "a/b"], "not a model name")):
        proc = run_cli("probe", "--port", "9", *args, timeout=30)
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    raw = subprocess.run([sys.executable, "-m", "jetbatch", "probe", "--port", "9", "--model", b"\xff"], capture_output=True, timeout=30)
    assert raw.returncode == 2 and b"not a model name" in raw.stderr and b"Traceback" not in raw.stderr, raw.stderr
    named = run_cli("probe", "--host", "app_worker_1.", "--port", "9", "--timeout", "1", timeout=30)  # a container name
    assert named.returncode == 1 and "expected a host name" not in named.stderr, named.stdout + named.stderr
    bracketed = run_cli("probe", "--host", "[::1]", "--port", "9", "--timeout", "1", timeout=30)
    assert bracketed.returncode == 1 and bracketed.stdout.startswith("http://[::1]:9/readyz: "), bracketed.stdout + bracketed.stderr


@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_otlp_over_grpc_is_refused_in_one_line(tmp_path: Path, var: str) -> None:
    """Not "exporting with http/protobuf" to the gRPC port, failing every few seconds."""
    path = tmp_path / "models.toml"
    path.write_text('[models.m1]\nhandler = "sleep"\n')
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", var: "grpc"}
    proc = run_cli("worker", "--config", str(path), "--nats-url", "nats://127.0.0.1:1", env=env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"jetbatch worker: environment {var}=grpc: jetbatch exports OTLP over http/protobuf only")


def test_cli_hostile_config_files_are_one_line_and_exit_2(tmp_path: Path) -> None:
    """Found by an attack: TOML nested past the parser's recursion limit printed a traceback
    (exit 1), and ``--config /dev/zero`` never returned (the whole file was read)."""
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    endless = Path("/dev/zero")
    for path, expected in ((deep, "nested too deep"), *(((endless, "not a config file"),) if endless.exists() else ())):
        proc = run_cli("worker", "--config", str(path), "--nats-url", "nats://127.0.0.1:1")
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and str(path) in lines[0], proc.stderr


def _numeric_keys() -> list[tuple[str, bool]]:
    from jetbatch.sidecar.config import Config
    from tests.helpers import numeric_keys

    return numeric_keys(Config)


@pytest.mark.parametrize(("key", "is_int"), _numeric_keys(), ids=[k for k, _ in _numeric_keys()])
def test_every_number_in_a_config_file_is_bounded(tmp_path: Path, key: str, is_int: bool) -> None:
    """Found by an attack: `streams.consumer_idle_s = inf` passed the check and the worker died
    with a traceback at its first consumer; `max_batch_size = 10**30` passed and the worker served
    nothing (nats-server cannot read such a batch). Every number of the file, walked from the
    config's own types (a key added later is covered), refuses an integer past 64 bits and an
    infinite float, naming its file and key."""
    section, _, rest = key.partition(".")
    value = str(10**30) if is_int else "inf"
    if rest.endswith(".[]"):
        rest, value = rest.removesuffix(".[]"), f"[{value}]"
    if section == "models":
        name, _, field = rest.partition(".")
        text = f'[models.{name}]\nhandler = "sleep"\n{field} = {value}\n'
    else:
        text = f"[{section}]\n{rest} = {value}\n"
    path = tmp_path / "bounded.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    shown = key.removesuffix(".[]")
    assert str(info.value).startswith(str(path)) and shown in str(info.value), str(info.value)


def test_a_config_or_workload_that_is_a_pipe_is_read_or_refused_within_a_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an attack: a named pipe given as `--config` or `--workload` blocked the command
    forever (opening a pipe nobody writes to waits for a writer). A pipe with a writer is still
    read, as `--config <(envsubst < tmpl)` needs; one without is refused once the wait ends."""
    import os
    import threading

    from jetbatch.sidecar import config as config_module
    from jetbatch.sidecar.simulator import load_workload
    from jetbatch.sidecar.simulator.workloads import WorkloadError

    fifo = tmp_path / "models.toml"
    os.mkfifo(fifo)
    monkeypatch.setattr(config_module, "PIPE_WAIT_S", 0.3)
    with pytest.raises(ConfigError, match="cannot read: a pipe that gave no end of file within 0.3 s"):
        load_config(fifo)
    with pytest.raises(WorkloadError, match="cannot read: a pipe"):
        load_workload(fifo)
    monkeypatch.setattr(config_module, "PIPE_WAIT_S", 30.0)  # the writer below starts when it starts

    def write() -> None:
        with open(fifo, "w") as f:
            f.write('[models.m1]\nhandler = "sleep"\n')

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert list(load_config(fifo).models) == ["m1"]
    finally:
        writer.join(30)


def test_running_out_of_memory_is_a_user_error_not_a_traceback() -> None:
    """A workload or payload too large for this process is the input's size, said in one line."""
    from jetbatch.sidecar.cli import _user_error

    found = _user_error(MemoryError())
    assert found is not None and "out of memory" in str(found)


_USER_MODULE = '''
import torch
from jetbatch.sidecar.handlers import Handler


class Net(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 2)


class Shout(Handler):
    inline = True

    def load(self, device: torch.device) -> None:
        self.device = device

    def unload(self) -> None:
        pass

    def predict(self, inputs: list) -> list:
        return [bytes(x).upper() for x in inputs]
'''


def _console_script(tmp_path: Path) -> list[str]:
    """The installed ``jetbatch`` console script, else a copy of what pip writes for it (a script
    in its own folder, so the folder, not the working directory, is first on ``sys.path``)."""
    installed = Path(sys.executable).parent / "jetbatch"
    if installed.is_file():
        return [str(installed)]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "jetbatch").write_text("import sys\nfrom jetbatch.sidecar.cli import main\nsys.exit(main())\n")
    return [sys.executable, str(bin_dir / "jetbatch")]


@pytest.mark.anyio
async def test_the_console_script_imports_models_and_handlers_from_the_working_directory(nats_url: str, prefix: str, tmp_path: Path) -> None:
    """Found by a new user: ``module_class = "mynets:Net"`` with ``mynets.py`` in the working
    directory worked under ``python -m jetbatch`` and ``jetbatch up`` but not under the ``jetbatch
    worker`` console script (``No module named 'mynets'``), whose ``sys.path`` starts with its
    ``bin`` folder. Through the real console script: a state_dict model and a custom handler from
    the working directory serve, and a module that is nowhere is a one-line error, exit 2."""
    import asyncio
    import os

    import torch
    from safetensors.torch import save_file

    from jetbatch import sdk
    from tests.helpers import wait_until

    work = tmp_path / "work"
    work.mkdir()
    (work / "mynets.py").write_text(_USER_MODULE)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2).eval()
    save_file(net.state_dict(), str(work / "net.safetensors"))
    (work / "jetbatch.toml").write_text(
        f'[nats]\nprefix = "{prefix}"\n[worker]\npoll_interval_ms = 50\n'
        '[models.net]\nhandler = "state_dict"\npath = "net.safetensors"\nmodule_class = "mynets:Net"\noptions = { input_shape = [4] }\n'
        '[models.shout]\nhandler = "mynets:Shout"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    console = _console_script(tmp_path)
    proc = subprocess.Popen(
        [*console, "worker", "--config", "jetbatch.toml", "--nats-url", nats_url, "--http-port", "off"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        x = torch.randn(4, generator=torch.Generator().manual_seed(1))
        answers: list[Any] = []
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:

            async def served() -> bool:
                if proc.poll() is not None:
                    return True  # exited: its output says why
                try:
                    answers.extend(await asyncio.gather(client.infer(x, model="net", timeout=60), client.infer(b"hi", model="shout", timeout=60)))
                except sdk.StreamNotFound:
                    return False  # the worker has not made its streams yet
                return True

            await wait_until(served, timeout_s=60, what="answers or the worker's exit")
        assert proc.poll() is None, proc.communicate()[0].decode()
        out, shouted = answers
        with torch.inference_mode():
            torch.testing.assert_close(out.to_torch(), net(x))
        assert shouted == b"HI"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)

    (work / "gone.toml").write_text('[models.m1]\nhandler = "state_dict"\npath = "net.safetensors"\nmodule_class = "nonets:Net"\n')
    gone = subprocess.run([*console, "worker", "--config", "gone.toml", "--nats-url", nats_url], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 2, gone.stderr
    assert gone.stderr.strip() == (
        "jetbatch worker: gone.toml: models.m1.module_class: module_class 'nonets:Net': cannot import nonets: "
        "no module named 'nonets' in the working directory or on PYTHONPATH"
    )


def test_no_help_text_shows_docstring_markup() -> None:
    """Found in a day of use: ``--help`` printed docstrings as written, reStructuredText's double
    backticks and :class: roles included."""
    import contextlib
    import io

    from jetbatch.sidecar.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "worker" in a.choices)
    for name, command in [("jetbatch", parser), *sub.choices.items()]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            command.print_help()
        assert "``" not in out.getvalue() and not re.search(r":[a-z]+:`", out.getvalue()), (name, out.getvalue())
