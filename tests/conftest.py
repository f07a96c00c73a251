"""Shared fixtures: one real nats-server (JetStream, own store dir, free loopback port) per session;
each test uses its own subject prefix, so its streams and consumers are its own.

The suite is hermetic: it binds no fixed port (the default ports are held for the session, so a
test that relies on one fails on every host, not only where another process has it), and a
socket, transport or file a test leaves open fails that test (see ``_leaks_fail_their_test``)."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import uuid
from pathlib import Path
from typing import Iterator

import hypothesis  # noqa: F401  - imported early: CPython 3.11 can fail to compile it when first imported deep in a stack (at session end)
import pytest

from jetbatch.sidecar.dev.natsserver import EmbeddedNats
from tests.ports import DEFAULT_PORTS


@pytest.fixture(scope="session", autouse=True)
def _default_ports_taken() -> Iterator[None]:
    """Bind (without listening) jetbatch's default ports for the session, as another exporter or
    a developer's `jetbatch up` would: a sidecar started on a default port fails its test here
    too, and a client that dials a default address is refused at once. A port already taken (by
    another xdist worker, or another process) is taken either way."""
    with contextlib.ExitStack() as stack:
        for port in DEFAULT_PORTS:
            sock = stack.enter_context(socket.socket())
            with contextlib.suppress(OSError):
                sock.bind(("127.0.0.1", port))
        yield


def pytest_collection_finish(session: pytest.Session) -> None:
    # What the imports made lives for the session: frozen out of the collector's walk, so the
    # collection after each test (below) costs what that test made, not 0.2 s of torch's objects.
    gc.collect()
    gc.freeze()


_frozen_after: list[str] = [""]  # the test file whose objects were last frozen


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # At each test file's first test (the files before it torn down, its own fixtures not yet
    # made): collect, then freeze what survived. That is what lives for the session (a session
    # fixture such as examples_dir, and the 170,000 objects of the modules it imported); left
    # unfrozen, the collection after every later test walked them again, 0.1-0.3 s a test.
    path = str(item.path)
    if path != _frozen_after[0]:
        _frozen_after[0] = path
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _leaks_fail_their_test() -> Iterator[None]:
    """Collect the test's garbage in its own teardown: a socket or transport it left open warns
    (ResourceWarning, an error under pytest's filterwarnings) there and fails this test, not
    whichever later test the collector happened to run in (once inside ``ast.parse``, where the
    warning became a SystemError)."""
    yield
    gc.collect()


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
