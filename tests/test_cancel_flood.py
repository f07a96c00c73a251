"""A flood of cancel notices or forged coordination events costs only the flooder
(worker/control.py, docs/security.md): a tenant may publish to its own cancel subject as fast as
it likes, anyone may forge arrival and take events on an open server, and the other requests are
still answered, on a data connection nats-server never cuts."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import anyio
import pytest

from jetbatch import sdk
from jetbatch.sdk import failures
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.dev.natsserver import EmbeddedNats
from jetbatch.sidecar.transport import connect
from jetbatch.sidecar.worker import Worker
from tests.helpers import make_config, sleep_model, wait_until

pytestmark = pytest.mark.anyio

FLOOD_MSGS = 200_000

# A raw client: CONNECT, then the notices as fast as the socket takes them, then a PING whose
# PONG says the server has read them all.
FLOODER = r"""
import socket, sys
host, port, subject, n = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), int(sys.argv[4])
s = socket.create_connection((host, port))
f = s.makefile("rb")
f.readline()
s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
chunk = b"".join(b"PUB %s 8\r\n%08d\r\n" % (subject, i) for i in range(10_000))
for _ in range(n // 10_000):
    s.sendall(chunk)
s.sendall(b"PING\r\n")
while not f.readline().startswith(b"PONG"):
    pass
"""


@pytest.fixture(scope="module")
def small_buffer_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EmbeddedNats]:
    # The server cuts a client as a slow consumer once 64 KiB wait for it (the default is 64 MiB,
    # which took a 15 s flood): the same rule, reached by a bounded flood.
    with EmbeddedNats(
        store_dir=tmp_path_factory.mktemp("store"),
        max_payload=65_536,
        extra_config="max_pending: 65536",
    ) as server:
        yield server


async def test_a_tenant_flooding_its_cancel_subject_never_cuts_the_data_connection(
    small_buffer_server: EmbeddedNats,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = small_buffer_server.url
    config = make_config(prefix, {"m1": sleep_model()})
    errors: list[Exception] = []

    async def record(exc: Exception) -> None:
        errors.append(exc)

    nc = await connect(config.nats, url)
    nc._error_cb = (
        record  # the worker's data connection: every error nats-py reports on it
    )
    worker = Worker(config, nc)
    try:
        async with (
            anyio.create_task_group() as tg,
            sdk.Client.connect(url, prefix=prefix) as client,
        ):
            tg.start_soon(worker.run)
            with anyio.fail_after(20):
                await worker.ready.wait()
            await client.infer(b"warm", model="m1", timeout=10)
            host, port = url.removeprefix("nats://").rsplit(":", 1)
            flood = [
                sys.executable,
                "-c",
                FLOODER,
                host,
                port,
                f"{prefix}.cancel.a",
                str(FLOOD_MSGS),
            ]
            with anyio.fail_after(60):
                flooder = await anyio.open_process(flood, stdout=None, stderr=None)
                # The other tenant's requests, one after another, from the flood's start to well
                # past its end (the worker reads what the server holds for it after the flooder
                # is done).
                for _ in range(40):
                    assert await client.infer(b"b", model="m1", timeout=5) == b"b"
                await flooder.wait()
                await flooder.aclose()
                assert flooder.returncode == 0
            assert not [e for e in errors if isinstance(e, failures.DROPPED)], errors
            assert nc.stats["reconnects"] == 0 and not errors, errors
            assert worker.stats["cancels_dropped"] > 0
            assert worker.stats["cancels_heard"] < FLOOD_MSGS
            # The notices' own connection took the cut, and came back.
            await wait_until(
                lambda: worker.stats["cancels_connection_cuts"] >= 1,
                timeout_s=15,
                what="the control connection cut",
            )

            # Another tenant's notice is heard once the flood is over (republished: one sent
            # while the read budget is still spent may be dropped, as any notice may).
            other = await connect_nats(url)
            try:

                async def heard() -> bool:
                    await other.publish(f"{prefix}.cancel.b", b"rb1")
                    return worker.cancellations.cancelled("b", "rb1")

                await wait_until(heard, timeout_s=15, what="tenant b's notice heard")
            finally:
                await other.close()
            worker.stop()
    finally:
        await nc.close()


async def test_the_control_connection_lets_the_event_loop_turn_every_few_dozen_messages(nats_url: str) -> None:
    """However much budget is left, the read loop yields after ``_SLICE_MSGS`` messages: a full
    budget read at once (1 000 notices at a flood's start, a socket's worth at a higher bound)
    stalled every other task of the worker, the data path's included, for 10-15 ms."""
    from jetbatch.sidecar.config import NatsConfig
    from jetbatch.sidecar.worker.control import _SLICE_MSGS, ControlConnection
    from jetbatch.sidecar.worker.counters import Counters

    main = await connect_nats(nats_url)
    control = ControlConnection(main, NatsConfig(), read_per_s=1e9, counters=Counters(), what="probe", name="probe")
    sender = await connect_nats(nats_url)
    subject = f"probe.{uuid.uuid4().hex[:8]}"
    total = 20_000
    handled = 0
    all_in = anyio.Event()

    async def cb(msg: object) -> None:
        nonlocal handled
        handled += 1
        if handled == total:
            all_in.set()

    try:
        await control.open()
        await control.subscribe(subject, cb, pending_msgs=total)
        await control.nc.flush()
        for i in range(total):
            await sender.publish(subject, b"%d" % i)
        await sender.flush()
        # A probe that takes a turn of the loop each time it runs: what was handled in between.
        most = 0
        with anyio.fail_after(30):
            while not all_in.is_set():
                before = handled
                await anyio.lowlevel.checkpoint()
                most = max(most, handled - before)
        assert most <= 2 * _SLICE_MSGS, most
    finally:
        await control.close()
        await sender.close()
        await main.close()


async def test_forged_arrival_events_at_full_speed_never_cut_the_data_connection(small_buffer_server: EmbeddedNats) -> None:
    """Arrival events (and take events, on the same connection) are read on a connection of their
    own (worker/arrivals.py): read on the data connection, a flood of forged ones had nats-server
    cut it as a slow consumer, and every request waited for the reconnect."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = small_buffer_server.url
    config = make_config(prefix, {"m1": sleep_model(), "ghost": sleep_model()}, worker={"max_resident_models": 1})
    errors: list[Exception] = []

    async def record(exc: Exception) -> None:
        errors.append(exc)

    nc = await connect(config.nats, url)
    nc._error_cb = record  # the worker's data connection: every error nats-py reports on it
    worker = Worker(config, nc)
    subjects = Subjects(prefix)
    subject = subjects.arrived("ghost")
    try:
        async with anyio.create_task_group() as tg, sdk.Client.connect(url, prefix=prefix) as client:
            tg.start_soon(worker.run)
            with anyio.fail_after(20):
                await worker.ready.wait()
            await client.infer(b"warm", model="m1", timeout=10)
            loads = worker.stats["loads"]
            host, port = url.removeprefix("nats://").rsplit(":", 1)
            with anyio.fail_after(60):
                flooder = await anyio.open_process([sys.executable, "-c", FLOODER, host, port, subject, str(FLOOD_MSGS)], stdout=None, stderr=None)
                for i in range(40):
                    assert await client.infer(f"r{i}".encode(), model="m1", timeout=5) == f"r{i}".encode()
                await flooder.wait()
                await flooder.aclose()
                assert flooder.returncode == 0
            assert nc.stats["reconnects"] == 0 and not errors, errors
            # The events' own connection took the cut, and came back.
            await wait_until(lambda: worker.stats["events_connection_cuts"] >= 1, timeout_s=15, what="the events' connection cut")
            assert worker.stats["loads"] == loads and not worker.slots["ghost"].resident
            # Arrivals are heard again once the flood is over: a request is answered without
            # waiting for a periodic count.
            assert await client.infer(b"after", model="m1", timeout=10) == b"after"
            worker.stop()
    finally:
        await nc.close()
