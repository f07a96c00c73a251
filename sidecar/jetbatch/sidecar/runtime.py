"""Running a sidecar process: connect (and the reply identity's connection), run until SIGTERM or
SIGINT asks for a graceful stop, drain the connections. Shared by ``jetbatch worker`` and
``jetbatch classifier``."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import anyio
from nats.aio.client import Client as NATS

from jetbatch.sdk import failures

from .config import Config
from .streams import StreamSetupError

__all__ = ["Sidecar", "retry_startup", "serve_sidecar"]

log = logging.getLogger("jetbatch.runtime")
T = TypeVar("T")


class Sidecar(Protocol):
    async def run(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def ready(self) -> anyio.Event: ...

    def problems(self) -> list[str]: ...


async def serve_sidecar(
    config: Config, url: str, *, name: str, make: Callable[[NATS, NATS | None], Sidecar], http_port: int | None = None
) -> int:
    """Connect, run the sidecar until SIGTERM/SIGINT, drain. ``http_port``: where /healthz,
    /readyz and /metrics listen (None: off)."""
    from .transport import connect, connect_replies

    nc = await connect(config.nats, url, name=name)
    reply_nc: NATS | None = None
    try:
        reply_nc = await connect_replies(config.nats, url, name=f"{name}-replies")
        sidecar = make(nc, reply_nc)
        stopping = anyio.Event()

        def stop() -> None:
            stopping.set()
            sidecar.stop()

        def alive() -> tuple[bool, str]:
            # Answering at all proves the event loop turns; a stop past its drain shows here too.
            return (True, "alive") if not nc.is_closed else (False, "NATS connection closed")

        def ready() -> tuple[bool, str]:
            if stopping.is_set():
                return False, "stopping"
            if not nc.is_connected:
                return False, "not connected to NATS (reconnecting)"
            if not sidecar.ready.is_set():
                return False, "setting up streams and consumers"
            problems = sidecar.problems()
            return (not problems or len(problems) < _model_count(config)), "; ".join(problems) or "ready"

        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signals, stop)
            if http_port is not None:
                await _start_probes(tg, config, http_port, alive, ready)
            await sidecar.run()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for conn in (reply_nc, nc):
                if conn is not None:
                    await _drain(conn)
    return 0


def _model_count(config: Config) -> int:
    return max(1, len(config.models))


async def _start_probes(tg: Any, config: Config, port: int, alive: Any, ready: Any) -> None:
    from .health import ProbeServer, prometheus_text

    server = ProbeServer(config.http.host, port, alive, ready, prometheus_text if config.http.metrics else None)
    try:
        await tg.start(server.serve)
    except OSError as exc:
        # Serving goes on: a probe that cannot connect tells the operator more than a dead sidecar.
        log.error("health endpoints not served: cannot listen on %s:%d: %s", config.http.host, port, exc.strerror or exc)


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


_TRANSIENT = failures.TIMEOUTS + failures.UNAVAILABLE


async def retry_startup(setup: Callable[[], Awaitable[T]], *, timeout_s: float, what: str) -> T:
    """Run ``setup`` until it succeeds, retrying transient JetStream failures (a slow or electing
    cluster) with a logged, bounded backoff; give up after ``timeout_s``. Configuration conflicts
    are not retried."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.2
    while True:
        try:
            return await setup()
        except StreamSetupError as exc:
            if not exc.transient or time.monotonic() + delay_s > deadline:
                raise
            error: BaseException = exc
        except _TRANSIENT as exc:
            if time.monotonic() + delay_s > deadline:
                raise StreamSetupError(f"{what}: JetStream did not answer within {timeout_s:.0f}s ({exc!r})", transient=True) from exc
            error = exc
        except failures.API_ERRORS as exc:
            if exc.code not in (500, 503) or time.monotonic() + delay_s > deadline:
                raise
            error = exc
        log.warning("%s: JetStream not ready (%s); retrying in %.1fs", what, error, delay_s)
        await anyio.sleep(delay_s)
        delay_s = min(delay_s * 2, 5.0)
