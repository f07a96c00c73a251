"""What a newcomer runs from the docs alone, run as written: each model recipe of
docs/handlers.md (its code blocks extracted from the page and executed, its TOML blocks used as
the config), served by one real `jetbatch worker` on the session's nats-server, each answer equal
to the model run here; and every exit code docs/cli.md documents for each of its commands (0, 2,
1 and 130 where documented) driven as a subprocess: the cases no other file drives run here
against that same worker, and for the rest the test that drives each is named and checked.

What other files already run is not repeated: the README's producer snippet and the deployment
files (test_deployment_files), the example scripts (test_examples), the Hugging Face example
config through the classifier (test_huggingface), Ctrl-C (test_interrupts, test_up_demo)."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from jetbatch import sdk
from jetbatch.sdk.protocol import Tensor

ROOT = Path(__file__).resolve().parent.parent
HANDLERS_MD = ROOT / "docs" / "handlers.md"
CLI_MD = ROOT / "docs" / "cli.md"

# The user's own code the recipes name (MyNet, a two-input forward(x, features), the doc's
# mypackage.models:SpamNet, a function handler): written into the worker's working directory.
MYNETS = """
import torch


class MyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(x).softmax(-1)


class TwoNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 4)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x, features):
        return self.a(x) * self.b(features)


def double(batch):
    return [x * 2 for x in batch]
"""
SPAMNET = """
import torch


class SpamNet(torch.nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)
"""


def blocks(path: Path, language: str) -> list[str]:
    """The fenced ``language`` code blocks of a markdown page, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETBATCH_") and k != "NATS_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "sdk"), str(ROOT / "sidecar"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.05)


class Recipes:
    """The page's recipes built in ``directory``; ``models`` are the eager modules they came from."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.models: dict[str, Any] = {}
        self.awaited: list[ast.expr] = []  # the page's `out = await client.infer(...)` calls


def build_recipes(directory: Path) -> Recipes:
    """Run the page's Python blocks in ``directory`` as a user would, and write a config of its
    TOML blocks plus the handlers the page's table names without a block."""
    (directory / "mynets.py").write_text(MYNETS)
    (directory / "mypackage").mkdir()
    (directory / "mypackage" / "__init__.py").write_text("")
    (directory / "mypackage" / "models.py").write_text(SPAMNET)
    sys.path.insert(0, str(directory))
    try:
        import mynets
        from mypackage.models import SpamNet
    finally:
        sys.path.remove(str(directory))
    recipes = Recipes(directory)
    python = blocks(HANDLERS_MD, "python")
    export_one, export_two = python[0], python[1]
    torch.manual_seed(0)
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        one: dict[str, Any] = {"MyNet": mynets.MyNet}
        exec(compile(export_one, "docs/handlers.md (export)", "exec"), one)  # noqa: S102 - the page's code, run as written (writes mynet.pt2)
        recipes.models["mynet"] = one["model"]
        two: dict[str, Any] = {
            "torch": torch,
            "batch": one["batch"],
            "model": mynets.TwoNet().eval(),
        }
        tree = ast.parse(textwrap.dedent(export_two).replace("await ", ""))
        for stmt in tree.body:  # the export runs here; the requests later, against the worker
            if "client.infer" in ast.unparse(stmt):
                assert isinstance(stmt, ast.Assign)
                recipes.awaited.append(stmt.value)
            else:
                code = compile(ast.Module([stmt], []), "docs/handlers.md (two inputs)", "exec")
                exec(code, two)  # noqa: S102 - the page's code, run as written
        torch.export.save(two["program"], "two.pt2")  # "exports the same way": saved as above
        recipes.models["two"] = two["model"]
        spam = SpamNet(hidden=64, classes=2).eval()
        from safetensors.torch import save_file

        save_file(spam.state_dict(), "spam.safetensors")
        recipes.models["spam"] = spam
        scripted = mynets.MyNet().eval()
        torch.jit.trace(scripted, torch.zeros(2, 16)).save("legacy.pt")
        recipes.models["legacy"] = scripted
    finally:
        os.chdir(cwd)
    toml = blocks(HANDLERS_MD, "toml")
    state_dict = next(b for b in toml if 'handler = "state_dict"' in b)
    config = [
        f'[nats]\nprefix = "newcomer"\n\n[worker]\nmax_resident_models = 8\n\n{state_dict}',
        '[models.mynet]\nhandler = "export"\npath = "mynet.pt2"\n',
        '[models.two]\nhandler = "export"\npath = "two.pt2"\n',
        '[models.legacy]\nhandler = "torchscript"\npath = "legacy.pt"\n',
        '[models.double]\nhandler = "function"\nfunction = "mynets:double"\n',
    ]
    hf = next(b for b in toml if 'handler = "transformers"' in b)
    try:
        from examples.huggingface.build import build

        build(directory / "models" / "sentiment")  # where the page's block points
        config.append(hf)
    except ImportError:
        pass  # without the [hf] extra, the transformers recipe is test_huggingface's skip too
    (directory / "jetbatch.toml").write_text("\n".join(config))
    return recipes


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, nats_server: Any) -> Iterator[tuple[Recipes, str, int]]:
    """The recipes, and one `jetbatch worker` serving them from their directory (module_class
    imports from there), with its /readyz port; it must stop with 0 on SIGTERM."""
    directory = tmp_path_factory.mktemp("newcomer")
    recipes = build_recipes(directory)
    out, err = directory / "worker.out", directory / "worker.err"
    with open(out, "wb") as out_file, open(err, "wb") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jetbatch", "worker", "--config", "jetbatch.toml", "--nats-url", nats_server.url, "--http-port", "0"],
            cwd=directory, stdout=out_file, stderr=err_file, env=_env(),
        )  # fmt: skip
    try:
        _until(
            lambda: b" ready" in out.read_bytes() or proc.poll() is not None,
            90,
            "the worker's ready line",
        )
        ready = re.search(r"http://127\.0\.0\.1:(\d+)", out.read_text())
        assert ready and proc.poll() is None, err.read_text()[-3000:]
        yield recipes, nats_server.url, int(ready.group(1))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, err.read_text()[-3000:]  # `worker`'s 0: stopped by SIGTERM, drained


def test_each_recipe_of_the_handlers_page_serves_what_the_model_computes_here(
    served: tuple[Recipes, str, int],
) -> None:
    recipes, url, _ = served
    torch.manual_seed(1)
    x, features = torch.randn(16), torch.randn(8)

    async def ask() -> dict[str, Any]:
        async with sdk.Client.connect(url, prefix="newcomer") as client:
            answers: dict[str, Any] = {}
            # The page's two-input calls, as written (a tuple in order, a mapping by name).
            for i, call in enumerate(recipes.awaited):
                code = compile(ast.Expression(call), "docs/handlers.md", "eval")
                answers[f"two#{i}"] = await eval(
                    code,
                    {
                        "client": client,
                        "x": Tensor.from_torch(x),
                        "features": Tensor.from_torch(features),
                    },
                )
            for name in ("mynet", "spam", "legacy", "double"):
                answers[name] = await client.infer(Tensor.from_torch(x), model=name, timeout=60)
            if (recipes.directory / "models" / "sentiment").exists():
                answers["sentiment"] = await client.infer("a great movie", model="sentiment", timeout=60)  # as the page writes it
            return answers

    answers = asyncio.run(ask())
    with torch.inference_mode():
        want = {
            "mynet": recipes.models["mynet"](x[None])[0],
            "spam": recipes.models["spam"](x[None])[0],
            "legacy": recipes.models["legacy"](x[None])[0],
            "double": x * 2,
            "two": recipes.models["two"](x[None], features[None])[0],
        }
    assert len(recipes.awaited) == 2, "the page's two-input example sends a tuple and a mapping"
    for name, got in answers.items():
        if name == "sentiment":
            assert set(got) == {"logits"}
            torch.testing.assert_close(
                got["logits"].to_torch(),
                _bert_logits(recipes.directory / "models" / "sentiment", "a great movie"),
                atol=1e-5,
                rtol=1e-4,
            )
            continue
        torch.testing.assert_close(got.to_torch(), want[name.split("#")[0]], atol=1e-5, rtol=1e-4, msg=name)


def _bert_logits(directory: Path, text: str) -> torch.Tensor:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    model = transformers.BertForSequenceClassification.from_pretrained(str(directory), local_files_only=True).eval()
    with torch.inference_mode():
        return model(**tokenizer(text, return_tensors="pt")).logits[0]


# docs/cli.md's exit codes: where each (command, code) the page documents is driven as a
# subprocess. Most are in the files that test the command; this file runs the rest.
ELSEWHERE = {
    ("ring", 0): "test_ring_dump.py::test_jetbatch_ring_fetches_a_running_workers_ring_and_it_replays",
    ("ring", 1): "test_ring_dump.py::test_a_worker_that_is_not_there_is_one_line_and_exit_1",
    ("ring", 2): "test_ring_dump.py::test_a_worker_id_that_is_no_subject_is_a_usage_error",
    ("worker", 0): "test_faults.py::test_sigterm_drains_in_flight_and_exits_0",
    ("worker", 2): "test_config_cli.py::test_cli_bad_config_is_one_line_and_exit_2",
    (
        "classifier",
        0,
    ): "test_health.py::test_a_sidecar_says_when_it_is_ready_and_where_its_endpoints_listen",
    (
        "classifier",
        2,
    ): "test_config_cli.py::test_classifier_handler_errors_name_file_and_key",
    (
        "up",
        2,
    ): "test_up_demo.py::test_a_taken_http_port_stops_the_sidecar_with_one_line",
    ("up", 130): "test_up_demo.py::test_up_serves_and_stops_on_sigint",
    ("demo", 0): "test_up_demo.py::test_demo_runs_and_summarises",
    ("demo", 2): "test_config_cli.py::test_cli_bad_arguments_are_one_line_and_exit_2",
    (
        "demo",
        130,
    ): "test_up_demo.py::test_demo_stopped_by_sigterm_leaves_nothing_running",
    (
        "examples",
        2,
    ): "test_deployment_files.py::test_examples_build_into_a_directory_this_user_cannot_write_is_one_line",
    (
        "status",
        0,
    ): "test_status.py::test_worker_answers_status_and_cli_shows_cluster_view",
    ("status", 1): "test_status.py::test_status_with_nobody_listening",
    ("status", 2): "test_config_cli.py::test_cli_bad_arguments_are_one_line_and_exit_2",
    ("probe", 0): "test_health.py::test_worker_serves_health_readiness_and_metrics",
    ("probe", 1): "test_health.py::test_worker_serves_health_readiness_and_metrics",
    (
        "probe",
        2,
    ): "test_config_cli.py::test_probe_arguments_that_are_no_host_or_model_are_one_line",
    ("dlq", 0): "test_dlq.py::test_list_show_replay_purge",
    ("dlq", 1): "test_dlq.py::test_replay_never_publishes_where_a_forged_letter_points",
    ("dlq", 2): "test_dlq.py::test_dlq_without_the_stream_is_a_one_line_error",
    ("bench", 0): "test_bench_cli.py::test_bench_against_an_embedded_deployment",
    ("bench", 2): "test_bench_cli.py::test_bad_mix_is_a_one_line_error",
    (
        "bench",
        130,
    ): "test_bench_cli.py::test_interrupted_bench_still_reports_what_it_measured",
    ("simulate", 0): "test_simulator.py::test_simulate_cli_table_json_and_plot",
    ("simulate", 2): "test_simulator.py::test_simulate_cli_errors_are_one_line",
    ("replay", 0): "test_recording.py::test_a_simulated_run_replays_exactly",
    (
        "replay",
        1,
    ): "test_recording.py::test_a_changed_recording_diverges_at_its_first_changed_action",
    ("replay", 2): "test_recording.py::test_bad_recordings_are_one_line_errors",
    ("demo", 1): "test_up_demo.py::test_demo_with_requests_unanswered_says_so_and_exits_1",
}
HERE = {
    ("worker", 0),
    ("examples", 0),
    ("bench", 1),
    ("up", 1),
}  # worker: the fixture's, on SIGTERM
NOT_DRIVEN: set[tuple[str, int]] = set()


def _documented() -> set[tuple[str, int]]:
    """(command, code) as docs/cli.md documents them: 0 and 2 for every command of its table,
    1 for those its exit-code table's row 1 names (and `up`, `replay` in their own text), 130
    where the page says a command exits 130."""
    text = CLI_MD.read_text()
    commands = re.findall(r"^\| `([a-z]+)[ `]", text, flags=re.MULTILINE)
    row1 = re.search(r"^\| 1 \|(.*)$", text, flags=re.MULTILINE)
    assert row1
    ones = {c for c in commands if f"`{c}" in row1.group(1) or f"/`{c}`" in row1.group(1)}
    flat = " ".join(text.split())
    ones |= {"up"} if "(exit 1)" in flat else set()
    ones |= {"replay"} if "exit 1 at the first divergence" in flat else set()
    interrupted = {"up", "demo", "bench"} if "SIGTERM for `up`, `demo` and `bench`" in flat else set()
    return {(c, code) for c in commands for code in (0, 2)} - {("up", 0)} | {(c, 1) for c in ones} | {(c, 130) for c in interrupted}


def test_every_documented_exit_code_of_every_command_is_driven_somewhere() -> None:
    from jetbatch.sidecar.cli import build_parser

    text = CLI_MD.read_text()
    commands = set(re.findall(r"^\| `([a-z]+)[ `]", text, flags=re.MULTILINE))
    parser = build_parser()
    choices = next(a.choices for a in parser._actions if isinstance(a.choices, dict))
    assert commands == set(choices), "docs/cli.md's table lists every command, and only those"
    documented = _documented()
    assert documented == set(ELSEWHERE) | HERE | NOT_DRIVEN, sorted(documented ^ (set(ELSEWHERE) | HERE | NOT_DRIVEN))
    for (command, code), where in ELSEWHERE.items():
        file, name = where.split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text())
        fn = next(
            (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
            None,
        )
        assert fn is not None, f"{where} (for {command} exit {code}) is gone"
        source = ast.unparse(fn)
        assert re.search(rf"\b{code}\b", source), f"{where} does not check exit {code}"


def test_examples_build_and_the_1s_no_other_file_drives(served: tuple[Recipes, str, int], tmp_path: Path) -> None:
    """`examples build` into a fresh folder (0); `bench` whose requests all go unanswered (a
    model nobody serves: 1); `up` whose worker dies (it stops the rest and says which: 1)."""
    recipes, url, _ = served
    examples = subprocess.Popen(
        [sys.executable, "-m", "jetbatch", "examples", "build", "--dir", str(tmp_path / "examples")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    bench = subprocess.run(
        [sys.executable, "-m", "jetbatch", "bench", "--nats-url", url, "--prefix", "newcomer", "--mix", "nobody=1",
         "--concurrency", "1", "--duration", "0.5", "--timeout", "0.5", "--json"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert bench.returncode == 1, bench.stderr[-2000:]
    assert json.loads(bench.stdout)["answered"] == 0
    out = tmp_path / "up.out"
    with open(out, "wb") as out_file:
        up = subprocess.Popen(
            [sys.executable, "-m", "jetbatch", "up", "--config", "jetbatch.toml", "--nats-url", url, "--no-classifier", "--http-port", "0"],
            cwd=recipes.directory, stdout=out_file, stderr=subprocess.PIPE, text=True, env=_env(),
        )  # fmt: skip
    try:
        _until(
            lambda: b"Ctrl-C to stop" in out.read_bytes() or up.poll() is not None,
            90,
            "up's ready line",
        )
        children = Path(f"/proc/{up.pid}/task/{up.pid}/children").read_text().split()
        assert len(children) == 1, children  # its worker
        os.kill(int(children[0]), signal.SIGKILL)
        _, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 1, err[-2000:]
    assert "exited with status -9; stopping" in err and "Traceback" not in err, err[-2000:]
    _, examples_err = examples.communicate(timeout=120)
    assert examples.returncode == 0, examples_err[-2000:]
    assert (tmp_path / "examples" / "up.toml").is_file()
