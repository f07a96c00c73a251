"""What a newcomer deploys, checked as written: compose.yaml against the Dockerfile, the Kubernetes
manifests against the Kubernetes schemas and each other, the NATS settings everywhere, and the
README's producer code in an environment without torch or numpy."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from jetbatch.sidecar.config import HttpConfig, StreamsConfig, load_config
from jetbatch.sidecar.dev.deployment import Deployment
from jetbatch.sidecar.dev.natsserver import MAX_PAYLOAD_BYTES, EmbeddedNats, find_nats_server

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "k8s"
SHARED_CHECKER = ROOT.parent / "shared" / "tools" / "check_compose.py"


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last one silently, so
    a second ``build:`` would replace the first unseen)."""


def _no_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
    for key in keys:
        if keys.count(key) > 1:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def _yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_UniqueKeyLoader) if doc]


def _compose() -> dict[str, Any]:
    (doc,) = _yaml(ROOT / "compose.yaml")
    return doc


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _image_user() -> tuple[str, int, int]:
    """The Dockerfile's runtime user: name, uid and gid (what compose and the manifests must match)."""
    text = _dockerfile()
    (user,) = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    uid = re.search(rf"useradd\b[^\n]*--uid (\d+)[^\n]* {user}\b", text)
    gid = re.search(rf"groupadd\b[^\n]*--gid (\d+) {user}\b", text)
    assert uid and gid, "the Dockerfile creates its user with a fixed uid and gid"
    return user, int(uid.group(1)), int(gid.group(1))


def _dirs_owned_by_image_user() -> set[str]:
    user, _, _ = _image_user()
    return set(re.findall(rf"install -d -o {user} -g {user}(?: -m \d+)? (/\S+)", _dockerfile()))


def _max_payload(conf: str) -> int:
    (value,) = re.findall(r"^\s*max_payload:\s*(\S+)\s*$", conf, re.MULTILINE)
    assert value.isdigit(), f"max_payload {value!r}: write it in bytes, so every file can be compared"
    return int(value)


# --- compose.yaml ---------------------------------------------------------------------------------


def _built_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in _compose()["services"].items() if "build" in s}


def _flavor(service: dict[str, Any]) -> str:
    build = service["build"]
    args = build.get("args", {}) if isinstance(build, dict) else {}
    return str(args.get("FLAVOR", re.search(r"^ARG FLAVOR=(\S+)", _dockerfile(), re.MULTILINE).group(1)))  # type: ignore[union-attr]


def _named_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Mount target -> (named volume, read-only) for a service's named-volume mounts."""
    named = set(_compose().get("volumes", {}))
    mounts = {}
    for entry in service.get("volumes", []):
        source, target, *mode = entry.split(":")
        if source in named:
            mounts[target] = (source, mode == ["ro"])
    return mounts


def test_compose_file_has_no_key_given_twice() -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match="given twice"):
        yaml.load("a:\n  build: .\n  build: {context: .}\n", Loader=_UniqueKeyLoader)
    merged = yaml.load("x: &x {a: 1}\ny:\n  <<: *x\n  b: 2\n", Loader=_UniqueKeyLoader)
    assert merged["y"] == {"a": 1, "b": 2}
    assert _compose()["services"]


def test_compose_models_service_writes_where_the_image_user_owns_the_mount() -> None:
    """A fresh named volume takes the owner of the image's directory it is mounted on: every
    writable named mount of a service running the image is a directory the Dockerfile creates
    owned by its user, and no service overrides that user (else `examples build` cannot write)."""
    _, uid, _ = _image_user()
    owned = _dirs_owned_by_image_user()
    assert owned, "the Dockerfile creates no directory owned by its user"
    for name, service in _built_services().items():
        assert str(service.get("user", uid)).split(":")[0] in (str(uid), _image_user()[0]), name
        for target, (_, read_only) in _named_mounts(service).items():
            if not read_only:
                assert target in owned, f"{name} writes into {target}, which the image does not create for uid {uid}"
    models = _compose()["services"]["models"]
    assert models["command"][:2] == ["examples", "build"]
    out_dir = models["command"][models["command"].index("--dir") + 1]
    assert out_dir in _named_mounts(models) and not _named_mounts(models)[out_dir][1]


def test_compose_sidecars_read_configs_the_models_service_builds(examples_dir: Path) -> None:
    """The classifier's and worker's --config files lie on the volume the models service fills,
    under the names `jetbatch examples build` writes, and they wait for it to finish."""
    services = _compose()["services"]
    models = services["models"]
    out_dir = models["command"][models["command"].index("--dir") + 1]
    volume = _named_mounts(models)[out_dir][0]
    for name in ("classifier", "worker"):
        service = services[name]
        config = Path(service["command"][service["command"].index("--config") + 1])
        (target,) = [t for t, (v, _) in _named_mounts(service).items() if v == volume]
        assert config.parent == Path(target), f"{name} reads {config}, outside the models volume at {target}"
        assert (examples_dir / config.name).is_file(), f"{name} reads {config.name}, which examples build does not write"
        assert service["depends_on"]["models"]["condition"] == "service_completed_successfully"


def test_compose_gpu_worker_runs_the_cuda_image_and_no_tag_names_two_flavors() -> None:
    stages = set(re.findall(r"^FROM \S+ AS (\S+)-base$", _dockerfile(), re.MULTILINE))
    flavors_by_image: dict[str, set[str]] = {}
    gpu_services = []
    for name, service in _built_services().items():
        flavor = _flavor(service)
        assert flavor in stages, f"{name} builds FLAVOR={flavor}, which the Dockerfile has no stage for"
        flavors_by_image.setdefault(service.get("image", name), set()).add(flavor)
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if any(d.get("driver") == "nvidia" for d in devices):
            gpu_services.append(name)
            assert flavor == "cuda", f"{name} reserves an NVIDIA GPU but builds the {flavor} image"
        else:
            assert flavor == "cpu", f"{name} builds the CUDA image without a GPU reserved"
    assert gpu_services == ["worker"]
    assert all(len(f) == 1 for f in flavors_by_image.values()), flavors_by_image


def test_compose_wires_the_sidecars() -> None:
    services = _compose()["services"]
    assert {"nats", "models", "classifier", "worker", "app", "jaeger"} <= set(services)
    for name in ("classifier", "worker", "app"):
        assert services[name]["environment"]["NATS_URL"] == "nats://nats:4222"
    # Each connects as its own user of the server's authorization block, in its own inboxes.
    for name in ("classifier", "worker"):
        env = services[name]["environment"]
        assert (env["JETBATCH_NATS__USER"], env["JETBATCH_NATS__INBOX_PREFIX"]) == (name, f"_INBOX.{name}")
        assert f"JETBATCH_{name.upper()}_PASSWORD:?" in env["JETBATCH_NATS__PASSWORD"]
    app = services["app"]["environment"]
    assert (app["NATS_USER"], app["NATS_INBOX_PREFIX"]) == ("app", "_INBOX.app") and "JETBATCH_APP_PASSWORD:?" in app["NATS_PASSWORD"]
    assert services["classifier"]["healthcheck"]["test"][-1] == str(HttpConfig().classifier_port)
    assert services["worker"]["healthcheck"]["test"][-1] == str(HttpConfig().worker_port)


@pytest.mark.skipif(not SHARED_CHECKER.exists(), reason="../shared/tools/check_compose.py is not beside this checkout")
def test_compose_file_validates_against_the_compose_schema() -> None:
    proc = subprocess.run([sys.executable, str(SHARED_CHECKER), str(ROOT / "compose.yaml")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _examples_build(directory: Path, *, run_as: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "jetbatch", "examples", "build", "--dir", str(directory)]
    return subprocess.run([*(run_as or []), *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_examples_build_into_a_directory_this_user_cannot_write_is_one_line(tmp_path: Path) -> None:
    """compose's models service met a root-owned volume: a one-line error and exit status 2
    (it was a 25-line traceback from torch's file writer)."""
    if os.geteuid() == 0:
        # Root writes anywhere: run as the image's user on a root-owned directory, as compose did
        # (util-linux's setpriv: subprocess's own user= cannot reach an interpreter under /root).
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to become another user")
        directory = Path(tempfile.mkdtemp(prefix="jetbatch-root-owned-"))
        directory.chmod(0o755)
        _, uid, gid = _image_user()
        run_as = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        try:
            proc = _examples_build(directory, run_as=run_as, env={**os.environ, "HOME": str(directory)})
        finally:
            shutil.rmtree(directory)
    else:
        directory = tmp_path / "read-only"
        directory.mkdir(mode=0o555)
        proc = _examples_build(directory)
        uid = os.geteuid()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"jetbatch examples: --dir {directory}: not writable by uid {uid}: Permission denied"]


def test_examples_build_that_cannot_write_a_file_is_one_line(examples_dir: Path, tmp_path: Path) -> None:
    """A current build is reused and its configs rewritten: a config's name taken by a directory
    is a one-line error naming it."""
    directory = tmp_path / "examples"
    shutil.copytree(examples_dir, directory)
    (directory / "models.toml").unlink()
    (directory / "models.toml").mkdir()
    proc = _examples_build(directory)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"jetbatch examples: --dir {directory}: cannot write {directory / 'models.toml'}: Is a directory"]


# --- the NATS server's settings -------------------------------------------------------------------


# The users' passwords, as the environment (compose) or the Secret (Kubernetes) gives them.
_PASSWORDS = {"WORKER_PASSWORD": "worker-secret-0001", "CLASSIFIER_PASSWORD": "classifier-secret-0001", "APP_PASSWORD": "app-secret-0001"}


def _interpolated(text: str) -> str:
    """``text`` as docker compose reads it, with the passwords of _PASSWORDS set: ``${VAR:?..}``
    replaced, ``$$`` a literal ``$``; a variable not set fails, as compose does."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1).removeprefix("JETBATCH_")
        assert name in _PASSWORDS, f"compose reads ${{{match.group(1)}}}, which no step of docs/deployment.md sets"
        return _PASSWORDS[name]

    return re.sub(r"\$\{([A-Z_]+)(?::\?[^}]*)?\}", value, text).replace("$$", "$")


def _compose_nats_conf() -> str:
    compose = _compose()
    nats = compose["services"]["nats"]
    (mount,) = nats["configs"]
    assert nats["command"] == ["--config", mount["target"]]
    return _interpolated(str(compose["configs"][mount["source"]]["content"]))


def _k8s_nats_conf() -> str:
    (config_map,) = [d for d in _yaml(K8S / "nats.yaml") if d["kind"] == "ConfigMap"]
    return str(config_map["data"]["nats.conf"])


def test_max_payload_is_the_same_for_compose_kubernetes_and_jetbatch_up() -> None:
    """One value everywhere: a request `jetbatch up` accepts is not PayloadTooLarge under compose
    or on Kubernetes. It fits the models stream's largest message (1 KiB over max_msg_size)."""
    up = EmbeddedNats()._config_text()
    assert _max_payload(up) == MAX_PAYLOAD_BYTES
    assert _max_payload(_compose_nats_conf()) == MAX_PAYLOAD_BYTES
    assert _max_payload(_k8s_nats_conf()) == MAX_PAYLOAD_BYTES
    assert MAX_PAYLOAD_BYTES >= StreamsConfig().max_msg_size + 1024
    assert "8 MiB + 64 KiB" in (ROOT / "docs" / "deployment.md").read_text()


@pytest.mark.parametrize("which", ["compose", "k8s"])
def test_nats_configs_are_valid_for_nats_server_with_jetstream_and_monitoring(which: str, tmp_path: Path) -> None:
    conf = _compose_nats_conf() if which == "compose" else _k8s_nats_conf()
    assert re.search(r"^jetstream \{", conf, re.MULTILINE) and "http_port: 8222" in conf and "port: 4222" in conf
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    env = {**os.environ, **_PASSWORDS}  # the Secret's keys, in the nats container's environment
    proc = subprocess.run([find_nats_server(), "-t", "-c", str(path)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("which", ["compose", "k8s"])
def test_the_shipped_nats_servers_admit_their_users_only(which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the config compose.yaml or examples/k8s/nats.yaml gives nats-server (passwords as
    they would be set), the app is served with its password and refused without one, and may
    not publish an arrival event, a take event or into the workers' bucket."""
    import asyncio

    from jetbatch.sdk import ConnectionFailed
    from jetbatch.sdk.connection import connect_nats

    conf = _compose_nats_conf() if which == "compose" else _k8s_nats_conf()
    conf = conf[conf.index("authorization {") :]  # the rest (ports, store) is checked above
    errors: list[str] = []

    async def check(url: str) -> None:
        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        with pytest.raises(ConnectionFailed):
            await connect_nats(url)
        app = await connect_nats(url, user="app", password=_PASSWORDS["APP_PASSWORD"], inbox_prefix="_INBOX.app", error_cb=on_error)
        try:
            for subject in ("jetbatch.arrived.sentiment", "jetbatch.taken.sentiment", "$KV.JETBATCH_WORKERS.claim.sentiment", "jetbatch.in.other"):
                await app.publish(subject, b"1")
            await app.flush()
            for _ in range(200):
                if len(errors) >= 4:
                    break
                await asyncio.sleep(0.01)
        finally:
            await app.close()

    for key, value in _PASSWORDS.items():
        monkeypatch.setenv(key, value)  # nats-server reads $ROLE_PASSWORD from the environment it starts with
    with EmbeddedNats(store_dir=tmp_path / "store", extra_config=conf) as server:
        asyncio.run(check(server.url))
    assert sum("permissions violation for publish" in e for e in errors) == 4, errors


# --- Kubernetes manifests -------------------------------------------------------------------------

# Custom resources: the Kubernetes schemas do not cover them (KEDA's is checked structurally below).
_CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject")}


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) for doc in _yaml(path)]


def _by_kind_name() -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in _manifests()}


def _pods() -> dict[str, dict[str, Any]]:
    """Each workload's pod spec, by workload name."""
    return {doc["metadata"]["name"]: doc["spec"]["template"]["spec"] for _, doc in _manifests() if doc["kind"] in ("Deployment", "StatefulSet")}


def _jetbatch_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec, container) for every container running the jetbatch image."""
    return [
        (name, pod, c)
        for name, pod in _pods().items()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
        if "/jetbatch:" in c["image"]
    ]


def test_kubernetes_validator_refuses_a_misspelled_field() -> None:
    from kubernetes_validate import utils as kv

    (statefulset,) = [d for d in _yaml(K8S / "nats.yaml") if d["kind"] == "StatefulSet"]
    statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError, match="volumeMount"):
        kv.validate(statefulset, kv.latest_version(), strict=True)


def test_kubernetes_manifests_validate_against_the_kubernetes_schemas() -> None:
    from kubernetes_validate import utils as kv

    version = kv.latest_version()
    checked = 0
    for filename, doc in _manifests():
        if (doc["apiVersion"], doc["kind"]) in _CUSTOM_KINDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{filename}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.absolute_path)}")
        checked += 1
    assert checked >= 6


def test_kubernetes_example_is_complete() -> None:
    """NATS, the classifier and a worker, each jetbatch container pointed at the NATS Service."""
    objects = _by_kind_name()
    assert {("StatefulSet", "nats"), ("Service", "nats"), ("ConfigMap", "nats-config"), ("Namespace", "jetbatch")} <= set(objects)
    assert {("Deployment", "jetbatch-classifier"), ("Deployment", "jetbatch-worker"), ("ConfigMap", "jetbatch-config")} <= set(objects)
    service = objects[("Service", "nats")]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    statefulset = objects[("StatefulSet", "nats")]
    assert statefulset["spec"]["serviceName"] == "nats"
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    for name, _, container in _jetbatch_containers():
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if container["args"][0] in ("worker", "classifier"):
            assert env["NATS_URL"] == f"nats://{host}:{ports['client']}", name
    for _, doc in _manifests():
        assert doc["metadata"].get("namespace", "jetbatch") == "jetbatch" or doc["kind"] == "Namespace"
        if doc["kind"] == "ScaledObject":
            for trigger in doc["spec"]["triggers"]:
                assert trigger["metadata"]["natsServerMonitoringEndpoint"] == f"{host}:{ports['monitor']}"


def test_every_configmap_is_read_and_every_config_comes_from_a_mounted_configmap() -> None:
    objects = _by_kind_name()
    config_maps = {name for kind, name in objects if kind == "ConfigMap"}
    mounted: set[str] = set()
    for name, pod in _pods().items():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = [v for v in volumes.values() if "persistentVolumeClaim" in v]
        assert not claims, f"{name} mounts a claim nothing in examples/k8s creates"
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            # A StatefulSet's claim templates are not pod volumes: {} for those.
            mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in container.get("volumeMounts", [])}
            mounted |= {v["configMap"]["name"] for v in mounts.values() if "configMap" in v}
            args = [*container.get("args", [])]
            if "--config" not in args:
                continue
            config = Path(args[args.index("--config") + 1])
            volume = mounts.get(str(config.parent))
            assert volume is not None and "configMap" in volume, f"{name}: {config} is not in a mounted ConfigMap"
            data = objects[("ConfigMap", volume["configMap"]["name"])]["data"]
            assert config.name in data, f"{name} reads {config.name}, which ConfigMap {volume['configMap']['name']} lacks"
    assert mounted == config_maps, f"ConfigMaps nothing mounts: {config_maps - mounted}"


def test_kubernetes_pods_run_as_the_image_user_with_the_right_flavor_ports_and_probes() -> None:
    """The probes docs/deployment.md describes: startup and liveness on /healthz, readiness on
    /readyz, on the port the sidecar listens on; the image's uid; the CUDA image where a GPU is."""
    _, uid, gid = _image_user()
    ports = {"worker": HttpConfig().worker_port, "classifier": HttpConfig().classifier_port}
    seen = set()
    for name, pod, container in _jetbatch_containers():
        security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        assert security.get("runAsUser") == uid and security.get("runAsGroup") == gid and security.get("runAsNonRoot"), name
        role = container["args"][0]
        if role not in ports:
            continue
        seen.add(role)
        gpu = "nvidia.com/gpu" in container.get("resources", {}).get("limits", {})
        assert container["image"].endswith(":cuda" if gpu else ":cpu"), f"{name}: {container['image']} with gpu={gpu}"
        (port,) = container["ports"]
        assert port["containerPort"] == ports[role], name
        probes = {kind: container[f"{kind}Probe"]["httpGet"] for kind in ("startup", "liveness", "readiness")}
        assert {k: p["path"] for k, p in probes.items()} == {"startup": "/healthz", "liveness": "/healthz", "readiness": "/readyz"}, name
        assert {p["port"] for p in probes.values()} == {port["name"]}, name
    assert seen == {"worker", "classifier"}
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert "`startupProbe` and `livenessProbe` on `/healthz`" in docs and "`readinessProbe` on `/readyz`" in docs


def test_keda_scales_the_worker_deployment_on_the_model_consumers_lag() -> None:
    """Structural (no KEDA schema offline): the ScaledObject targets the worker Deployment, and
    each trigger names jetbatch's real stream and the consumer of one of the example models,
    which the worker keeps (consumers = "eager" in the config it reads)."""
    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.dev.example_models import EXAMPLE_MODELS
    from jetbatch.sidecar.streams import model_consumer_name

    objects = _by_kind_name()
    (scaled,) = [d for (kind, _), d in objects.items() if kind == "ScaledObject"]
    deployment = objects[("Deployment", scaled["spec"]["scaleTargetRef"]["name"])]
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"nats-jetstream"}
    assert {t["metadata"]["stream"] for t in triggers} == {Subjects("jetbatch").models_stream}
    assert {t["metadata"]["consumer"] for t in triggers} == {model_consumer_name(m, p) for m in EXAMPLE_MODELS for p in ("interactive", "batch")}
    assert all(int(t["metadata"]["lagThreshold"]) > 0 for t in triggers)
    (worker,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["args"][0] == "worker"]
    config = tomllib.loads(objects[("ConfigMap", "jetbatch-config")]["data"][Path(worker["args"][2]).name])
    assert config["streams"]["consumers"] == "eager"


# --- the ConfigMap's configs, served --------------------------------------------------------------


def _configmap_configs(models_dir: Path) -> dict[str, str]:
    """jetbatch-config's files with /models/ (the init container's build) at ``models_dir``."""
    data = _by_kind_name()[("ConfigMap", "jetbatch-config")]["data"]
    return {key: text.replace('"/models/', f'"{models_dir}/') for key, text in data.items()}


def test_configmap_configs_are_what_examples_build_writes(examples_dir: Path) -> None:
    """Same models, options and router as `jetbatch examples build` (what the init container
    runs), each path the built file under /models."""
    data = _by_kind_name()[("ConfigMap", "jetbatch-config")]["data"]
    for key in ("models.toml", "classifier.toml"):
        ours, built = tomllib.loads(data[key]), tomllib.loads((examples_dir / key).read_text())
        ours.pop("streams", None)  # the KEDA triggers' one addition
        sections = ours.get("models", {}).values() if key == "models.toml" else [ours["classifier"]]
        for section in sections:
            assert section["path"].startswith("/models/")
            section["path"] = section["path"].removeprefix("/models/")
        assert ours == built, key


@pytest.fixture(scope="module")
def configmap_deployment(examples_dir: Path, nats_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The classifier and a worker run with the ConfigMap's configs (their own subject prefix)."""
    configs = _configmap_configs(examples_dir)
    path = tmp_path_factory.mktemp("k8s-config") / "both.toml"
    path.write_text('[nats]\nprefix = "dpl"\n\n' + configs["models.toml"] + "\n" + configs["classifier.toml"])
    loaded = load_config(path)
    assert loaded.classifier is not None and Path(loaded.classifier.path or "").is_file()
    assert all(Path(m.path or "").is_file() for m in loaded.models.values())
    with Deployment(path, nats_url=nats_server.url) as dep:
        yield dep


# The producer's environment: the SDK's dependencies only. A module set to None in sys.modules
# cannot be imported (nor anything under it).
_PRODUCER_ONLY = "import sys\nfor name in ('torch', 'numpy'):\n    sys.modules[name] = None\n"


def _readme_producer_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    (source,) = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    return source


def test_readme_producer_snippet_runs_without_torch_or_numpy(configmap_deployment: Deployment) -> None:
    """The README's "Using it" code, unchanged but for the server's address and the subject
    prefix, with torch and numpy unimportable, against the sidecars the ConfigMap configures."""
    source = _readme_producer_snippet()
    assert 'URL = "nats://127.0.0.1:4222"' in source and source.count("connect(URL, **APP)") == 2
    # jetbatch up's app credentials (tests/test_credentials.py connects with them); this server admits anyone.
    assert 'APP = json.load(open(".jetbatch/credentials/app.json"))' in source
    source = source.replace('APP = json.load(open(".jetbatch/credentials/app.json"))', "APP = {}")
    assert not re.search(r"^\s*(import|from)\s+(torch|numpy)\b", source, re.MULTILINE)
    source = source.replace('URL = "nats://127.0.0.1:4222"', f"URL = {configmap_deployment.url!r}").replace("connect(URL, **APP)", 'connect(URL, prefix="dpl", **APP)')
    proc = subprocess.run([sys.executable, "-c", _PRODUCER_ONLY + source], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    first, last = proc.stdout.strip().splitlines()
    from jetbatch.sidecar.dev.example_models import EXAMPLE_MODELS

    topic = re.match(r"(\[.*?\]) (\d+) (True|False) ", first)
    assert topic, first
    assert len(yaml.safe_load(topic.group(1))) == EXAMPLE_MODELS["topic"][1]  # one score per class
    assert len(yaml.safe_load(last)) == EXAMPLE_MODELS["spam"][1]


def test_producer_blocker_does_block_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", _PRODUCER_ONLY + "import torch"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_the_producer_install_is_the_sdk_without_torch_and_says_where_it_comes_from() -> None:
    """jetbatch is not on an index: the README installs the SDK from the checkout, and the base
    install (what `pip install .` gives) has neither torch nor numpy."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"(torch|numpy)\b", d)]
    readme = (ROOT / "README.md").read_text()
    assert "`pip install .`" in readme and "not on PyPI" in readme
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert not re.search(r"pip install jetbatch\b(?!\[)", doc.read_text()), f"{doc.name} installs jetbatch from an index"
