"""TLS with client certificates, and per-user permissions on a real nats-server: a producer may
publish only to <prefix>.in and read only its own inbox; the sidecars run with least privilege."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from jetbatch import sdk
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.status import collect_status
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.dev.natsserver import EmbeddedNats
from jetbatch.sidecar.transport import connect_options
from tests.helpers import running_classifier, running_worker, wait_until

pytestmark = pytest.mark.anyio
PREFIX = "sec"
SECRETS = {
    "producer": "p-Secret-1", "other": "o-Secret-2", "worker": "w-Secret-3", "classifier": "c-Secret-4",
    "worker-replies": "wr-Secret-5", "classifier-replies": "cr-Secret-6", "operator": "op-Secret-7",
}  # fmt: skip


def _cert(name: str, issuer_key: Any, issuer_name: x509.Name | None, *, ca: bool, tmp: Path) -> tuple[Any, x509.Name]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    (tmp / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / f"{name}-key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return key, subject


def _server_config(tmp: Path) -> str:
    def user(name: str, publish: list[str], subscribe: list[str]) -> str:
        return (
            f'{{ user: "{name}", password: "{SECRETS[name]}", permissions: {{ '
            f"publish: {{ allow: {publish!r} }}, subscribe: {{ allow: {subscribe!r} }} }} }}"
        ).replace("'", '"')

    js_api = ["$JS.API.>", "$JS.ACK.>"]

    def tenant(name: str) -> str:
        # A tenant: publish only to its own ingress and cancel subject (plus the stream-name
        # lookup behind StreamNotFound and the direct get of its own stored answers), receive only
        # its own answers and its own inbox (JetStream's replies). No stream info: it lists a
        # stream's subjects, other tenants' ids among them.
        return user(
            name,
            [f"{PREFIX}.in.{name}", f"{PREFIX}.cancel.{name}", "$JS.API.STREAM.NAMES", f"$JS.API.DIRECT.GET.SEC_RESULTS.{PREFIX}.result.{name}.>"],
            [f"_INBOX.{name}.>", f"{PREFIX}.result.{name}.>"],
        )

    def replies(name: str) -> str:
        # A reply identity: answers to callers' inboxes and their stored copies, nothing else.
        return user(name, ["_INBOX.>", f"{PREFIX}.result.>"], [f"_INBOX.{name}.>"])

    return (
        "tls {\n"
        f'  cert_file: "{tmp / "server.pem"}"\n  key_file: "{tmp / "server-key.pem"}"\n  ca_file: "{tmp / "ca.pem"}"\n'
        "  verify: true\n  timeout: 3\n}\n"
        "authorization {\n  users = [\n"
        f"    {tenant('producer')}\n"
        f"    {tenant('other')}\n"
        # The sidecars' main identities: JetStream API and acks, queues and dead letters, never a caller's inbox.
        # The classifier reads the workers' adverts (admission: docs/reliability.md, "Backpressure").
        f"    {user('classifier', js_api + [f'{PREFIX}.model.>', f'{PREFIX}.dlq.>'], ['_INBOX.classifier.>', f'{PREFIX}.status', '$SRV.>', '$KV.SEC_WORKERS.>'])}\n"
        # The worker also listens to the models stream's republished arrivals (headers only),
        # tells its peers what it fetched and settled (jetbatch.taken.>), hears cancels, and reads
        # the adverts (its refusals at arrival).
        f"    {user('worker', js_api + [f'{PREFIX}.dlq.>', '$KV.>', f'{PREFIX}.taken.>'], ['_INBOX.worker.>', f'{PREFIX}.status', '$SRV.>', f'{PREFIX}.arrived.>', f'{PREFIX}.taken.>', f'{PREFIX}.cancel', f'{PREFIX}.cancel.*', '$KV.SEC_WORKERS.>'])}\n"
        # An operator: asks `jetbatch status` and `nats micro`, reads only its own inbox.
        f"    {user('operator', [f'{PREFIX}.status', '$SRV.>'], ['_INBOX.operator.>'])}\n"
        f"    {replies('classifier-replies')}\n"
        f"    {replies('worker-replies')}\n"
        "  ]\n}\n"
    )


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("tls")
    ca_key, ca_name = _cert("ca", None, None, ca=True, tmp=tmp)
    _cert("server", ca_key, ca_name, ca=False, tmp=tmp)
    _cert("client", ca_key, ca_name, ca=False, tmp=tmp)
    with EmbeddedNats(store_dir=tmp / "store", extra_config=_server_config(tmp)) as server:
        yield server, tmp


def _sidecar_config(role: str, tmp: Path) -> Config:
    return msgspec.convert(
        {
            "nats": {
                "prefix": PREFIX, "user": role, "password": SECRETS[role], "inbox_prefix": f"_INBOX.{role}",
                "tls_ca_file": str(tmp / "ca.pem"), "tls_cert_file": str(tmp / "client.pem"), "tls_key_file": str(tmp / "client-key.pem"),
                "reply_identity": {"user": f"{role}-replies", "password": SECRETS[f"{role}-replies"], "inbox_prefix": f"_INBOX.{role}-replies"},
            },
            "worker": {"poll_interval_ms": 50, "coordinate": False},
            "models": {"m1": {"handler": "identity", "max_delay_ms": 5}},
            "classifier": {"router": "rules", "default_model": "m1"},
        },
        Config,
    )  # fmt: skip


def _tls(tmp: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
    ctx.load_cert_chain(str(tmp / "client.pem"), str(tmp / "client-key.pem"))
    return ctx


async def test_least_privilege_producer_and_sidecars_over_tls(secure_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    server, tmp = secure_server
    url = f"tls://127.0.0.1:{server.port}"
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async with running_worker(_sidecar_config("worker", tmp), url), running_classifier(_sidecar_config("classifier", tmp), url):
        async with sdk.Client.connect(
            url, prefix=PREFIX, tenant="producer", user="producer", password=SECRETS["producer"], tls=_tls(tmp), error_cb=on_error,
        ) as client:  # fmt: skip
            # Allowed: through its own ingress and the classifier, over TLS, answers in its own inbox.
            assert await client.infer({"x": 1}, timeout=20) == {"x": 1}
            assert await client.infer({"x": 2}, model="m1", timeout=20) == {"x": 2}  # a named model, still routed
            # Its stored answers, by request id (the direct get its permissions allow).
            again = await client.infer_result({"x": 3}, timeout=20, request_id="sec-retry-1")
            assert (await client.infer_result({"x": 3}, timeout=20, request_id="sec-retry-1")).batch.batch_id == again.batch.batch_id
            # Refused: straight to a model queue, to another tenant's ingress, or cancelling another
            # tenant's requests (its own cancel subject is allowed).
            await client.nats.publish(f"{PREFIX}.model.m1", b"direct")
            await client.nats.publish(f"{PREFIX}.in.other", b"impersonation")
            await client.nats.publish(f"{PREFIX}.cancel.other", b"sec-retry-1")
            # Refused: another tenant's request ids, worker ids and queue depths (stream info).
            await client.nats.publish("$JS.API.STREAM.INFO.SEC_RESULTS", b'{"subjects_filter": ">"}')
            await client.nats.publish(f"{PREFIX}.cancel.producer", b"no-such-request")
            # Refused: another tenant's stored answers, by its scope or by a wildcard over scopes
            # (what its own lookups use within its scope: <prefix>.result.producer.*.<id>).
            await client.nats.publish(f"$JS.API.DIRECT.GET.SEC_RESULTS.{PREFIX}.result.other.*.sec-retry-1", b"")
            await client.nats.publish(f"$JS.API.DIRECT.GET.SEC_RESULTS.{PREFIX}.result.*.*.sec-retry-1", b"")
            # Refused: listening on another caller's inbox, another tenant's answers, or the
            # answers of callers with no tenant.
            for subject in ("_INBOX.other.>", f"{PREFIX}.result.other.>", f"{PREFIX}.result._.>", f"{PREFIX}.result.>"):
                await client.nats.subscribe(subject)
            await wait_until(lambda: sum("subscription" in e.lower() for e in errors) >= 4, what="the server's -ERR")
        # An operator sees both sidecars through the status subject and the micro-services
        # protocol: the answers come on the reply identities, the only ones allowed to publish to
        # inboxes here.
        op = await nats.connect(url, user="operator", password=SECRETS["operator"], tls=_tls(tmp), inbox_prefix="_INBOX.operator")
        try:
            reports = await collect_status(op, Subjects(PREFIX), wait_s=1.0)
            assert sorted(r.role for r in reports) == ["classifier", "worker"]
            ping = await op.request("$SRV.PING.jetbatch-worker", b"", timeout=5)
            assert b"io.nats.micro.v1.ping_response" in ping.data
        finally:
            await op.close()
    assert any("permissions violation for publish" in e.lower() and f"{PREFIX}.model.m1" in e for e in errors), errors
    assert any("permissions violation for publish" in e.lower() and f"{PREFIX}.in.other" in e for e in errors), errors
    assert any("permissions violation for publish" in e.lower() and f"{PREFIX}.cancel.other" in e for e in errors), errors
    assert not any(f"{PREFIX}.cancel.producer" in e for e in errors), errors
    assert any("permissions violation for publish" in e.lower() and "$js.api.stream.info.sec_results" in e.lower() for e in errors), errors
    for refused in (f"{PREFIX}.result.other.*.sec-retry-1", f"{PREFIX}.result.*.*.sec-retry-1"):
        assert any("permissions violation for publish" in e.lower() and refused in e for e in errors), errors
    for refused in ("_inbox.other.>", f"{PREFIX}.result.other.>", f"{PREFIX}.result._.>", f'"{PREFIX}.result.>"'):
        assert any("permissions violation for subscription" in e.lower() and refused in e.lower() for e in errors), (refused, errors)
    for secret in SECRETS.values():
        assert secret not in caplog.text  # never logged


async def test_the_reply_identity_cannot_reach_the_jetstream_api_or_the_queues(secure_server: Any) -> None:
    """Defence in depth: even if the reply-subject check were bypassed, answers go out on an
    identity the server lets publish only to inboxes and stored results."""
    import nats

    server, tmp = secure_server
    url = f"tls://127.0.0.1:{server.port}"
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async with running_worker(_sidecar_config("worker", tmp), url):
        nc = await nats.connect(
            url, user="worker-replies", password=SECRETS["worker-replies"], tls=_tls(tmp), inbox_prefix="_INBOX.worker-replies",
            error_cb=on_error,
        )  # fmt: skip
        try:
            targets = ["$JS.API.STREAM.DELETE.SEC_MODELS", "$JS.API.STREAM.PURGE.SEC_MODELS", f"{PREFIX}.model.m1", f"{PREFIX}.in", f"{PREFIX}.dlq.worker", "$KV.SEC_WORKERS.x"]
            for subject in targets:
                await nc.publish(subject, b"forged result")
            await nc.flush()
            await wait_until(lambda: sum("permissions violation for publish" in e.lower() for e in errors) >= len(targets), what="every publish refused")
        finally:
            await nc.close()
        async with sdk.Client.connect(url, prefix=PREFIX, tenant="producer", user="producer", password=SECRETS["producer"], tls=_tls(tmp)) as client:
            # Still there (asked the one way a tenant may: which stream takes a subject).
            assert await client.nats.jetstream().find_stream_name_by_subject(f"{PREFIX}.model.m1") == "SEC_MODELS"


async def test_without_a_client_certificate_or_with_a_wrong_password_connection_fails(secure_server: Any) -> None:
    server, tmp = secure_server
    url = f"tls://127.0.0.1:{server.port}"
    no_client_cert = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
    with pytest.raises(sdk.ConnectionFailed):
        await sdk.Client.connect(url, user="producer", password=SECRETS["producer"], tls=no_client_cert, connect_timeout_s=1)
    with pytest.raises(sdk.ConnectionFailed):
        await sdk.Client.connect(url, user="producer", password="wrong", tls=_tls(tmp), connect_timeout_s=1)


async def test_a_plain_nats_url_against_a_tls_only_server_fails_within_the_connect_timeout(secure_server: Any) -> None:
    import time

    server, tmp = secure_server
    started = time.monotonic()
    with pytest.raises(sdk.ConnectionFailed, match=r"no handshake within 2\.0s"):
        await sdk.Client.connect(f"nats://127.0.0.1:{server.port}", user="producer", password=SECRETS["producer"], connect_timeout_s=2)
    # connect_timeout_s bounds the whole connect (the error says the bound it gave up at); the
    # slack is for closing the half-open connection. It took 9.5 s when each retry had its own.
    assert time.monotonic() - started < 2 + 1.5


def test_transport_options_come_from_config_and_environment(tmp_path: Path) -> None:
    from jetbatch.sidecar.config import ConfigError, parse_config

    (tmp_path / "ca.pem").write_text("x")
    cfg = parse_config("", environ={"JETBATCH_NATS__USER": "w", "JETBATCH_NATS__PASSWORD": "pw", "JETBATCH_NATS__TOKEN": "tk"})
    opts = connect_options(cfg.nats)
    assert (opts["user"], opts["password"], opts["token"]) == ("w", "pw", "tk")
    cfg = parse_config(f'[nats]\ntls_cert_file = "{tmp_path / "ca.pem"}"\n', environ={})
    with pytest.raises(ConfigError, match="tls_key_file"):
        connect_options(cfg.nats)
    cfg = parse_config('[nats]\ncreds_file = "/nonexistent.creds"\n', environ={})
    with pytest.raises(ConfigError, match="creds_file: file /nonexistent.creds not found"):
        connect_options(cfg.nats)


async def test_nkey_seed_authentication(tmp_path: Path) -> None:
    import os as _os

    import nkeys

    seed = nkeys.encode_seed(_os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(seed).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    config = f'authorization {{ users = [ {{ nkey: "{public}" }} ] }}\n'
    with EmbeddedNats(store_dir=tmp_path / "store", extra_config=config) as server:
        cfg = msgspec.convert({"nats": {"prefix": "nk", "nkeys_seed_file": str(seed_file)}, "models": {"m1": {"handler": "identity"}}}, Config)
        async with running_worker(cfg, server.url):
            async with sdk.Client.connect(server.url, prefix="nk", nkeys_seed=str(seed_file)) as client:
                assert await client.infer(b"signed", model="m1", timeout=20) == b"signed"
        with pytest.raises(sdk.ConnectionFailed):
            await sdk.Client.connect(server.url, connect_timeout_s=1)  # no credentials: refused
