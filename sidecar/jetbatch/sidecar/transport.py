"""Connecting a sidecar to NATS with the credentials and TLS settings of its configuration."""

from __future__ import annotations

import secrets
import ssl
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import SIDECAR_INBOX_MARK

from .config import ConfigError, NatsConfig, NatsIdentity

__all__ = ["connect", "connect_beside", "connect_options", "connect_replies"]


def connect_options(cfg: NatsConfig, identity: NatsIdentity | None = None) -> dict[str, Any]:
    """nats-py keyword arguments for ``cfg``'s credentials and TLS (secrets are never logged).
    With ``identity``, its credentials and inbox replace the main ones (TLS stays).

    The connection's inboxes lie under one token of its own below the configured prefix,
    marked as a sidecar's (``_INBOX._jbs<12 hex>.``, within the same server permissions): the
    sidecar's pull requests, PubAcks and watchers are answered there, and no sidecar's reply
    policy lets a caller aim an answer at a subject with that mark (``SIDECAR_INBOX_MARK``),
    while the callers' inboxes under the same ``_INBOX`` stay allowed."""
    options: dict[str, Any] = {}
    creds: Any = identity if identity is not None else cfg
    options["inbox_prefix"] = f"{creds.inbox_prefix}.{SIDECAR_INBOX_MARK}{secrets.token_hex(6)}"
    options.update(_credentials(creds))
    options.update(_tls(cfg))
    return options


def _credentials(cfg: NatsConfig | NatsIdentity) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if cfg.user is not None:
        options["user"] = cfg.user
        options["password"] = cfg.password or ""
    if cfg.token is not None:
        options["token"] = cfg.token
    if cfg.nkeys_seed_file is not None:
        _must_exist(cfg.nkeys_seed_file, "nats.nkeys_seed_file")
        options["nkeys_seed"] = cfg.nkeys_seed_file
    if cfg.creds_file is not None:
        _must_exist(cfg.creds_file, "nats.creds_file")
        options["user_credentials"] = cfg.creds_file
    return options


def _tls(cfg: NatsConfig) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if cfg.tls_ca_file or cfg.tls_cert_file:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        if cfg.tls_ca_file:
            _must_exist(cfg.tls_ca_file, "nats.tls_ca_file")
            ctx.load_verify_locations(cfg.tls_ca_file)
        if cfg.tls_cert_file:
            _must_exist(cfg.tls_cert_file, "nats.tls_cert_file")
            if not cfg.tls_key_file:
                raise ConfigError("nats.tls_key_file: required with nats.tls_cert_file")
            _must_exist(cfg.tls_key_file, "nats.tls_key_file")
            ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
        options["tls"] = ctx
    return options


def _must_exist(path: str, key: str) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"{key}: file {path} not found")


async def connect(cfg: NatsConfig, url: str | None = None, *, name: str = "jetbatch", no_echo: bool = False) -> NATS:
    """Open a connection for a sidecar; raises sdk.ConnectionFailed when no server answers.
    ``no_echo``: the server does not deliver to this connection what it published itself."""
    return await connect_nats(url or cfg.url, connect_timeout_s=cfg.connect_timeout_s, name=name, no_echo=no_echo, **connect_options(cfg))


async def connect_replies(cfg: NatsConfig, url: str | None = None, *, name: str = "jetbatch-replies") -> NATS | None:
    """The connection answers go out on, when the deployment gives the sidecar a reply identity
    (``nats.reply_identity``); None otherwise (answers use the main connection)."""
    if cfg.reply_identity is None:
        return None
    options = connect_options(cfg, cfg.reply_identity)
    return await connect_nats(url or cfg.url, connect_timeout_s=cfg.connect_timeout_s, name=name, **options)


async def connect_beside(cfg: NatsConfig, servers: list[str] | None, *, name: str, **nats_options: Any) -> NATS:
    """A further connection with the main identity of ``cfg``, to ``servers`` (those of a
    connection already open; None: ``cfg.url``): for inputs read apart from the data path."""
    options = {**connect_options(cfg), **nats_options}
    return await connect_nats(servers or cfg.url, connect_timeout_s=cfg.connect_timeout_s, name=name, **options)
