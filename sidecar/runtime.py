"""Running a sidecar process: connect (and the reply identity's connection), run until SIGTERM or
SIGINT asks for a graceful stop, drain the connections. Shared by ``jetbatch worker`` and
``jetbatch classifier``."""

from __future__ import annotations

import signal
from typing import Any, Callable, Protocol

import anyio
from nats.aio.client import Client as NATS

from .config import Config

__all__ = ["Sidecar", "serve_sidecar"]


class Sidecar(Protocol):
    async def run(self) -> None: ...

    def stop(self) -> None: ...


async def serve_sidecar(config: Config, url: str, *, name: str, make: Callable[[NATS, NATS | None], Sidecar]) -> int:
    from .transport import connect, connect_replies

    nc = await connect(config.nats, url, name=name)
    reply_nc: NATS | None = None
    try:
        reply_nc = await connect_replies(config.nats, url, name=f"{name}-replies")
        sidecar = make(nc, reply_nc)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signals, sidecar.stop)
            await sidecar.run()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for conn in (reply_nc, nc):
                if conn is not None:
                    await _drain(conn)
    return 0


async def _stop_on_signals(stop: Callable[[], None]) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop()
            return


async def _drain(nc: Any) -> None:
    try:
        with anyio.fail_after(10):
            await nc.drain()
    except Exception:  # noqa: BLE001 - the server may be gone: closing is all that is left
        try:
            await nc.close()
        except Exception:  # noqa: BLE001
            pass
