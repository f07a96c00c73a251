"""Shared fixtures: one real nats-server (JetStream, own store dir, free loopback port) per session;
each test uses its own subject prefix, so its streams and consumers are its own."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterator

import hypothesis  # noqa: F401  - imported early: CPython 3.11 can fail to compile it when first imported deep in a stack (at session end)
import pytest

from jetbatch.sidecar.dev.natsserver import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats-store")) as server:
        yield server


@pytest.fixture(scope="session")
def examples_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example models and configs, built once per session (fixed seeds, no download)."""
    from jetbatch.sidecar.dev.example_models import build_examples

    directory = tmp_path_factory.mktemp("examples")
    build_examples(directory)
    return directory


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py is asyncio-only


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's JETBATCH_* or NATS_URL must not leak into tests.
    for key in list(os.environ):
        if key.startswith("JETBATCH_") or key == "NATS_URL":
            monkeypatch.delenv(key, raising=False)
