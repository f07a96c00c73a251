"""Every example is exercised: the quickstart producer, the web app, the custom handler, the
locustfile, the Dockerfile (the README's producer code, compose.yaml and examples/k8s/:
test_deployment_files.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from jetbatch import sdk
from jetbatch.sidecar.dev.example_models import sample_inputs
from jetbatch.sidecar.dev.deployment import Deployment
from tests.helpers import make_config, running_worker, wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def deployment(examples_dir: Path, nats_server: Any) -> Iterator[Deployment]:
    """Classifier and worker with the example models, on the session's nats-server."""
    text = (examples_dir / "up.toml").read_text().replace("[worker]", '[nats]\nprefix = "exm"\n\n[worker]', 1)
    (examples_dir / "examples-test.toml").write_text(text)
    with Deployment(examples_dir / "examples-test.toml", nats_url=nats_server.url) as dep:
        yield dep


def test_quickstart(deployment: Deployment) -> None:
    script = ROOT / "examples" / "quickstart.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _with_prefix(script, "exm"), deployment.url], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if "model=" in line and "batch=" in line) == 8
    assert "typed error, as expected: UnknownModel" in proc.stdout


def _with_prefix(script: Path, prefix: str) -> str:
    # The quickstart uses the default prefix; this test's deployment uses its own.
    source = script.read_text().replace("sdk.Client.connect(url, **options)", f"sdk.Client.connect(url, prefix={prefix!r}, **options)")
    return source


def _readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


@pytest.mark.anyio
async def test_protocol_doc_json_request_gets_a_readable_json_answer(deployment: Deployment) -> None:
    """docs/protocol.md's raw NATS example: a JSON body of 16 numbers published with the documented
    headers is answered live on the caller's answer subject, in JSON (the probabilities as a
    list), and the same answer is in the results store under that subject."""
    import nats

    text = (ROOT / "docs" / "protocol.md").read_text()
    body = re.search(r"nats pub jetbatch\.model\.sentiment '(\[[^']*\])'", text)
    assert body, "the nats pub example is gone from docs/protocol.md"
    nc = await nats.connect(deployment.url)
    try:
        assert "nats sub 'jetbatch.result._.me.*'" in text and "-H Jetbatch-Reply-Key:me" in text
        sub = await nc.subscribe("exm.result._.me.*")
        headers = {"Nats-Msg-Id": "doc-req-1", "Jetbatch-Reply-Key": "me", "Content-Type": "application/json"}
        await nc.publish("exm.model.sentiment", body.group(1).encode(), headers=headers)
        msg = await sub.next_msg(timeout=60)
        assert msg.subject == "exm.result._.me.doc-req-1"
        assert msg.headers and msg.headers.get("Content-Type") == "application/json"
        probs = json.loads(msg.data)
        assert len(probs) == 3 and abs(sum(probs) - 1.0) < 1e-4
        # The live copy can reach its subscriber before the stream has stored it (the server hands
        # a message to its subscribers and to the stream's queue at once; a full suite's load saw
        # the direct get come back empty): read the store until it has it.
        stored: list[Any] = []

        async def in_the_store() -> bool:
            reply = await nc.request("$JS.API.DIRECT.GET.EXM_RESULTS.exm.result._.me.doc-req-1", b"", timeout=10)
            stored.extend([reply] if reply.data else [])
            return bool(stored)

        await wait_until(in_the_store, timeout_s=10, what="the answer in the results store")
        assert json.loads(stored[0].data) == probs
    finally:
        await nc.close()
    async with sdk.Client.connect(deployment.url, prefix="exm") as client:
        out = await client.infer([0.5] * 16, model="spam", content_type="application/json", timeout=30)
    assert isinstance(out, list) and len(out) == 2


def test_webapp(deployment: Deployment) -> None:
    from examples.webapp import make_handler

    from http.server import ThreadingHTTPServer

    client = sdk.BlockingClient.connect(deployment.url, prefix="exm")
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(client))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        x, truth = sample_inputs(1, seed=9)
        req = urllib.request.Request(f"{base}/items/batch/42", data=json.dumps({"values": x[0].tolist()}).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = json.loads(resp.read())
        assert body["item_id"] == "42" and body["model"] == truth[0]
        assert abs(sum(body["output"]) - 1.0) < 1e-4 and body["batch_size"] >= 1
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(f"{base}/items/batch/1", data=b"not json", method="POST"), timeout=30)
        assert info.value.code == 400
        info.value.close()
        with urllib.request.urlopen(f"{base}/healthz", timeout=10) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}
    finally:
        server.shutdown()
        server.server_close()
        client.close()


@pytest.mark.anyio
async def test_custom_handler(nats_url: str, prefix: str) -> None:
    config = make_config(prefix, {"scaler": {"handler": "examples.custom_handler:ScaleHandler", "options": {"factor": 3.0}}})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            out = await client.infer([1.0, 2.0, 3.0], model="scaler", timeout=20)
            with pytest.raises(sdk.BadRequest, match="1-d tensor"):
                await client.infer({"no": "numbers"}, model="scaler", timeout=20)
    assert out.to_torch().tolist() == [3.0, 6.0, 9.0]


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed (it is in the [dev] extra)")
def test_the_locustfile_defines_a_user_that_posts_to_the_app() -> None:
    """Imported in a process of its own: importing locust monkey-patches the standard library
    with gevent, which would change every test after it in this process."""
    check = (
        "import runpy, locust\n"
        "m = runpy.run_path('examples/locustfile.py')\n"
        "user = m['WebAppUser']\n"
        "assert issubclass(user, locust.HttpUser) and user.tasks, user\n"
        "print('ok', [t.__name__ for t in user.tasks])\n"
    )
    r = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok ['infer']"), r.stderr[-2000:]


# The Python each base image ships (what `python3` is in it).
_IMAGE_PYTHON = {"ubuntu22.04": (3, 10), "ubuntu24.04": (3, 12), "bookworm": (3, 11), "debian12": (3, 11)}


def _image_python(image: str) -> tuple[int, int]:
    match = re.match(r"python:(\d+)\.(\d+)", image)
    if match:
        return int(match.group(1)), int(match.group(2))
    for tag, version in _IMAGE_PYTHON.items():
        if tag in image:
            return version
    raise AssertionError(f"unknown Python in base image {image}: add it to _IMAGE_PYTHON")


def test_every_image_stage_ships_a_python_that_requires_python_accepts() -> None:
    import tomllib

    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=(\d+)\.(\d+)", floor)
    assert match, floor
    minimum = (int(match.group(1)), int(match.group(2)))
    bases = re.findall(r"^FROM (\S+) AS (\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    images = [image for image, _ in bases if "$" not in image]
    assert len(images) >= 2, bases  # a CPU and a CUDA stage
    for image in images:
        assert _image_python(image) >= minimum, f"{image} ships Python {_image_python(image)}, below {floor}"


def test_dockerfile_is_non_root_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "\nUSER jetbatch" in text and "HEALTHCHECK" in text
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None, reason="FastAPI is not installed (pip install fastapi httpx)")
def test_fastapi_app_from_the_migration_page(nats_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dynamic-batcher quickstart, migrated: its processor served by the function handler
    (examples/migration/jetbatch.toml), its FastAPI app on the SDK; a bad body is a 502 with a
    plain message, not a stack trace."""
    from fastapi.testclient import TestClient

    from jetbatch.sidecar.dev.deployment import Deployment

    with Deployment(ROOT / "examples" / "migration" / "jetbatch.toml", nats_url=nats_server.url, classifier=False):
        monkeypatch.setenv("NATS_URL", nats_server.url)
        from examples.fastapi_app import app

        with TestClient(app) as http:
            body = {"content": "string", "nested": {"key": "string", "values": [1, 5, 2]}}
            r = http.post("/items/batch/1", json=body)
            assert r.status_code == 200, r.text
            assert r.json() == {"item_id": 1, "data": {"content": "string", "nested": {"key": "string", "values": [2, 6, 3]}}}
            bad = http.post("/items/batch/2", json={"nested": {"values": ["not a number"]}})
            assert bad.status_code == 502
            assert "Traceback" not in bad.text and "/" not in bad.json()["detail"].split(":")[0]


def test_one_version_and_package_metadata() -> None:
    """The version is written once (hatch reads jetbatch.sdk.__version__), and the metadata says
    which Pythons the package runs on, matching requires-python."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert re.search(r'^__version__ = "\d+\.\d+\.\d+"', (ROOT / "sdk" / "jetbatch" / "sdk" / "__init__.py").read_text(), re.MULTILINE)
    floor = project["requires-python"].removeprefix(">=")
    minors = sorted(int(c.rsplit(".", 1)[1]) for c in project["classifiers"] if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert minors and minors[0] == int(floor.split(".")[1])
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "sdk" / "jetbatch" / "sdk" / "py.typed").exists() and (ROOT / "sidecar" / "jetbatch" / "sidecar" / "py.typed").exists()
