"""The per-role NATS users of the deployments jetbatch ships (``jetbatch up``, compose.yaml,
examples/k8s/): what each role may publish and subscribe to, the server's ``authorization`` block
that says so, and, for ``jetbatch up``, random passwords kept in files only their owner can read.

The roles are docs/security.md's, one connection each (no reply identity): a worker, a
classifier, an app (a single-tenant producer) and an admin for the operator's tools.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from jetbatch.sdk.protocol import Subjects

from ..errors import SidecarError

__all__ = [
    "ROLES",
    "CredentialsError",
    "Permissions",
    "authorization_block",
    "connect_options",
    "inbox_prefix",
    "load_or_create",
    "role_permissions",
    "sidecar_env",
]

ROLES = ("worker", "classifier", "app", "admin")
_FILE_MODE = 0o600
_DIR_MODE = 0o700
# What a password may hold: it is written into the server's config file between quotes.
_PASSWORD_RE = re.compile(r"\A[A-Za-z0-9_.~+/=-]{16,256}\Z")


class CredentialsError(SidecarError):
    """The credentials folder cannot be read or written, or a file in it is not one of ours."""


@dataclass(frozen=True)
class Permissions:
    """Subjects a role may publish and subscribe to; ``None`` for the admin: everything."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(role: str) -> str:
    """The inbox namespace a role's connections use, the only one its subscribe rights cover."""
    return f"_INBOX.{role}"


def role_permissions(subjects: Subjects) -> dict[str, Permissions | None]:
    """Each role's rights under ``subjects``' prefix. Answers go out on the sidecars' main
    connections here, so worker and classifier may publish answers (results, callers' inboxes,
    which the reply policy still checks) as the reply identities of docs/security.md do."""
    p = subjects.prefix
    answers = ("_INBOX.>", f"{p}.result.>")
    listen = (subjects.status_subject, "$SRV.>")
    return {
        "worker": Permissions(
            publish=("$JS.API.>", "$JS.ACK.>", f"{p}.dlq.>", "$KV.>", f"{p}.taken.>", *answers),
            # The adverts too: the worker refuses at arrival what its model's workers cannot reach in time.
            subscribe=(f"{inbox_prefix('worker')}.>", *listen, f"{p}.arrived.>", f"{p}.taken.>", f"{p}.cancel", f"{p}.cancel.*", subjects.rings, subjects.adverts),
        ),
        "classifier": Permissions(
            publish=("$JS.API.>", "$JS.ACK.>", f"{p}.model.>", f"{p}.dlq.>", *answers),
            # The adverts: admission (a queue its workers cannot reach in time) and the tenants'
            # shares (what the workers served, what each tenant has waiting; tenancy.py).
            subscribe=(f"{inbox_prefix('classifier')}.>", *listen, subjects.adverts),
        ),
        # A producer with no tenant: requests (classified or to a model), its cancel notices, the
        # stream-name lookup behind StreamNotFound, a direct get of the answers with no tenant
        # and of the model registry's keys (is a model served: sdk/registry.py); it reads those
        # answers and its own inbox. No arrival or take events, no bucket write, no stream info,
        # nothing under another tenant.
        "app": Permissions(
            publish=(
                f"{p}.in", f"{p}.model.>", f"{p}.cancel", "$JS.API.STREAM.NAMES",
                f"$JS.API.DIRECT.GET.{subjects.results_stream}.{p}.result._.>",
                f"$JS.API.DIRECT.GET.{subjects.registry_stream}.$KV.{subjects.registry_bucket}.>",
            ),
            subscribe=(f"{p}.result._.>", f"{inbox_prefix('app')}.>"),
        ),  # fmt: skip
        # `jetbatch status`, `dlq` and `bench` use the JetStream API and inboxes of their own:
        # the operator's key, kept like the server's own.
        "admin": None,
    }


def _quoted(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f'"{v}"' for v in values) + "]"


def authorization_block(subjects: Subjects, passwords: Mapping[str, str]) -> str:
    """nats-server's ``authorization`` block for every role in ``passwords``. A password is
    written as given inside quotes: a literal, or a reference the file's reader substitutes
    (compose's ``${VAR}``); a bare ``$VAR`` (nats-server reads it from its environment) unquoted."""
    lines = ["authorization {", "  users = ["]
    for role, perms in role_permissions(subjects).items():
        if role not in passwords:
            continue
        password = passwords[role]
        shown = password if password.startswith("$") and not password.startswith("${") else f'"{password}"'
        entry = f'    {{ user: "{role}", password: {shown}'
        if perms is not None:
            entry += (
                f", permissions: {{\n        publish:   {{ allow: {_quoted(perms.publish)} }}\n"
                f"        subscribe: {{ allow: {_quoted(perms.subscribe)} }} }}"
            )
        lines.append(entry + " }")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def sidecar_env(role: str, password: str) -> dict[str, str]:
    """The environment that makes a sidecar connect as ``role`` (its config's ``[nats]`` keys)."""
    return {"JETBATCH_NATS__USER": role, "JETBATCH_NATS__PASSWORD": password, "JETBATCH_NATS__INBOX_PREFIX": inbox_prefix(role)}


def connect_options(role: str, password: str) -> dict[str, str]:
    """Keyword arguments of ``sdk.Client.connect`` (and ``nats.connect``) for ``role``."""
    return {"user": role, "password": password, "inbox_prefix": inbox_prefix(role)}


def load_or_create(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Each role's password, from ``<directory>/<role>.json``; a missing file is made with a
    fresh random password, readable by its owner only. The file holds the role's connect
    options, so ``sdk.Client.connect(url, **json.load(open(path)))`` connects as that role."""
    folder = Path(directory)
    try:
        folder.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        passwords = {}
        for role in ROLES:
            path = folder / f"{role}.json"
            if not path.exists():
                _write_private(path, json.dumps(connect_options(role, secrets.token_urlsafe(24)), indent=2) + "\n")
            passwords[role] = _read_password(path, role)
        return passwords
    except OSError as exc:
        raise CredentialsError(f"credentials in {folder}: {exc.strerror or exc}") from None


def _write_private(path: Path, text: str) -> None:
    # O_EXCL with the mode: the file is never readable by others, not even between create and chmod.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _read_password(path: Path, role: str) -> str:
    if path.stat().st_mode & 0o077:
        path.chmod(_FILE_MODE)  # a copy made readable by others: take it back to its owner
    try:
        data = json.loads(path.read_text(encoding="utf-8")[:4096])
        password = data["password"]
        valid = data.get("user") == role and isinstance(password, str) and bool(_PASSWORD_RE.match(password))
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise CredentialsError(f"{path} is not a {role} credentials file of jetbatch up: remove it to get a new one")
    return str(password)
