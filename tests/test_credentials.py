"""The users `jetbatch up` makes for its embedded nats-server (sidecar/dev/credentials.py): private
files made once, and on the wire (a real nats-server with the generated config) an app that can
infer and can reach nothing else, while the worker and the classifier serve."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Iterator

import nats
import pytest

from jetbatch import sdk
from jetbatch.sdk.protocol import Subjects, Tensor
from jetbatch.sidecar.dev import credentials as creds
from jetbatch.sidecar.dev.deployment import Deployment
from jetbatch.sidecar.dev.example_models import sample_inputs
from jetbatch.sidecar.status import collect_status
from tests.helpers import wait_until

SUBJECTS = Subjects("jetbatch")


def test_credentials_are_made_once_for_their_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "home" / "credentials"
    first = creds.load_or_create(folder)
    assert set(first) == set(creds.ROLES) and len(set(first.values())) == len(creds.ROLES)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for role in creds.ROLES:
        path = folder / f"{role}.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, role
        assert json.loads(path.read_text()) == {"user": role, "password": first[role], "inbox_prefix": f"_INBOX.{role}"}
    assert creds.load_or_create(folder) == first  # a restart keeps them: apps need not be told again
    (folder / "app.json").chmod(0o644)
    assert creds.load_or_create(folder) == first
    assert stat.S_IMODE((folder / "app.json").stat().st_mode) == 0o600
    (folder / "worker.json").write_text('{"user": "worker", "password": "short\\" }"}')
    with pytest.raises(creds.CredentialsError, match="worker.json is not a worker credentials file"):
        creds.load_or_create(folder)


@pytest.fixture(scope="module")
def secured(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`jetbatch up`'s deployment of the example models: an embedded server with the generated users."""
    home = tmp_path_factory.mktemp("up-home")
    with Deployment(examples_dir / "up.toml", store_dir=home / "nats", credentials_dir=home / "credentials") as dep:
        yield dep


@pytest.mark.anyio
async def test_the_app_user_infers_and_reaches_nothing_else(secured: Deployment) -> None:
    """Under the generated config the app is answered (classified, and with a named model), and
    the server refuses its publishes to the arrival and take events, the workers' bucket, the
    JetStream API beyond its own lookups and another tenant's subjects, and its subscriptions to
    the events, other answers and the sidecars' inboxes."""
    conf = (secured.server.store_dir / "nats-server.conf") if secured.server else None
    assert conf is not None and stat.S_IMODE(conf.stat().st_mode) == 0o600  # it holds the passwords
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    x, truth = sample_inputs(2, seed=4)
    async with sdk.Client.connect(secured.url, error_cb=on_error, **secured.connect_options("app")) as client:
        named = await client.infer_result(Tensor.from_torch(x[0]), model=truth[0], timeout=60)
        classified = await client.infer_result(Tensor.from_torch(x[1]), timeout=60)
        assert (named.batch.model, classified.batch.model) == (truth[0], truth[1])
        refused_publish = [
            SUBJECTS.arrived(truth[0]),
            SUBJECTS.taken(truth[0]),
            f"$KV.{SUBJECTS.kv_bucket}.claim.{truth[0]}",
            f"$KV.{SUBJECTS.attempts_bucket}.x",
            f"$JS.API.STREAM.DELETE.{SUBJECTS.models_stream}",
            f"$JS.API.STREAM.INFO.{SUBJECTS.results_stream}",
            "$JS.ACK.JETBATCH_MODELS.x.1.1.1.1.0",
            SUBJECTS.dead_letter("worker"),
            SUBJECTS.tenant_ingress("other"),
            SUBJECTS.cancel("other"),
            SUBJECTS.status_subject,
            f"$JS.API.DIRECT.GET.{SUBJECTS.results_stream}.jetbatch.result.other.k.r1",
            f"$KV.{SUBJECTS.registry_bucket}.forged",  # the registry is read, never written, by a producer
        ]
        for subject in refused_publish:
            await client.nats.publish(subject, b"{}")
        refused_subscribe = ["jetbatch.arrived.>", "jetbatch.taken.>", "jetbatch.result.other.>", "jetbatch.result.>", "_INBOX.>", "_INBOX.worker.>", "jetbatch.model.>"]
        for subject in refused_subscribe:
            await client.nats.subscribe(subject)
        wanted = len(refused_publish) + len(refused_subscribe)
        await wait_until(lambda: sum("permissions violation" in e for e in errors) >= wanted, timeout_s=10, what="the server's refusals")
        # Still served after all that: the refusals cost the app nothing but the refused messages.
        assert (await client.infer_result(Tensor.from_torch(x[0]), model=truth[0], timeout=60)).batch.model == truth[0]
    for subject in refused_publish:
        assert any(f"permissions violation for publish to \"{subject.lower()}\"" in e for e in errors), (subject, errors)
    for subject in refused_subscribe:
        assert any(f"permissions violation for subscription to \"{subject.lower()}\"" in e for e in errors), (subject, errors)


@pytest.mark.anyio
async def test_without_credentials_nobody_connects_and_the_admin_sees_the_sidecars(secured: Deployment) -> None:
    with pytest.raises(sdk.ConnectionFailed):  # nats-py says "no servers available" on an authorization error
        await sdk.Client.connect(secured.url, connect_timeout_s=2)
    wrong = {**secured.connect_options("app"), "password": "not-the-password"}
    with pytest.raises(sdk.ConnectionFailed):  # nats-py says "no servers available" on an authorization error
        await sdk.Client.connect(secured.url, connect_timeout_s=2, **wrong)
    # The operator's tools take the admin's password in the URL (`--nats-url`).
    host = secured.url.removeprefix("nats://")
    admin = await nats.connect(f"nats://admin:{secured.passwords['admin']}@{host}")
    try:
        reports = await collect_status(admin, SUBJECTS, wait_s=0.5)
        assert sorted(r.role for r in reports) == ["classifier", "worker"]
    finally:
        await admin.close()


def test_the_shipped_deployments_name_the_same_users_and_rights() -> None:
    """compose.yaml and examples/k8s/nats.yaml carry the block `jetbatch up` writes, with their
    own way of giving the passwords (compose's variables, the Kubernetes Secret's environment)."""
    import yaml

    root = Path(__file__).resolve().parent.parent
    compose = yaml.safe_load((root / "compose.yaml").read_text())
    text = compose["configs"]["nats-conf"]["content"].replace("$$", "$")  # compose's escape of a literal $
    roles = ("worker", "classifier", "app")
    compose_refs = {r: f"${{JETBATCH_{r.upper()}_PASSWORD:?run the credentials line in docs/deployment.md first}}" for r in roles}
    assert creds.authorization_block(SUBJECTS, compose_refs) in text
    (k8s,) = [d for d in yaml.safe_load_all((root / "examples" / "k8s" / "nats.yaml").read_text()) if d and d["kind"] == "ConfigMap"]
    assert creds.authorization_block(SUBJECTS, {r: f"${r.upper()}_PASSWORD" for r in roles}) in k8s["data"]["nats.conf"]


def test_the_quickstart_runs_with_the_app_credentials_up_wrote(secured: Deployment) -> None:
    """examples/quickstart.py as its docstring runs it against `jetbatch up`: the URL and app.json."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    assert secured.credentials_dir is not None
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "quickstart.py"), secured.url, str(secured.credentials_dir / "app.json")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "sdk"), str(root)])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sum("model=" in line and "batch=" in line for line in proc.stdout.splitlines()) == 8
    assert "typed error, as expected: UnknownModel" in proc.stdout
