"""Running a sidecar process: connect (and the reply identity's connection), run until SIGTERM or
SIGINT asks for a graceful stop, drain the connections. Shared by ``jetbatch worker`` and
``jetbatch classifier``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
import time
from typing import Any, Awaitable, Callable, Iterator, Protocol, TypeVar

import anyio
from nats.aio.client import Client as NATS

from jetbatch.sdk import failures
from jetbatch.sdk.connection import stopped_reading

from .config import Config
from .errors import SidecarError
from .streams import StreamSetupError

__all__ = ["READY_LINE_ENV", "EndpointError", "Sidecar", "liveness", "retry_startup", "serve_sidecar"]

# Set to "0" in a sidecar's environment when what started it says it is ready in its own words
# (``jetbatch up``'s deployment): the sidecar then prints no ready line of its own.
READY_LINE_ENV = "JETBATCH_READY_LINE"

log = logging.getLogger("jetbatch.runtime")
T = TypeVar("T")


class Sidecar(Protocol):
    http_address: str  # where its /healthz, /readyz, /metrics listen ("" when off): in its report

    async def run(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def ready(self) -> anyio.Event: ...

    def problems(self) -> list[str]: ...

    def model_ready(self, model: str) -> tuple[int, str]: ...


class EndpointError(SidecarError):
    """The sidecar's HTTP endpoints could not listen where configured (a port taken by another
    process). The sidecar exits rather than run without health checks its supervisor relies on."""


async def serve_sidecar(
    config: Config, url: str, *, name: str, make: Callable[[NATS, NATS | None], Sidecar], http_port: int | None = None,
    no_echo: bool = False, on_ready: Callable[[Any, str], None] | None = None,
) -> int:
    """Listen for /healthz, /readyz and /metrics on ``http_port`` (None: off; 0: any free port),
    then connect, run the sidecar until SIGTERM/SIGINT, drain. The endpoints listen first, so a
    taken port is an :class:`EndpointError` before anything connects. ``no_echo``: the server
    does not send the sidecar's main connection what that connection published itself.
    ``on_ready(sidecar, address)``: called once when the sidecar is first ready, with where its
    endpoints listen as bound (``host:port``; ``""`` when off). Returns 130 when SIGINT (Ctrl-C)
    stopped it, else 0.

    A signal before the sidecar is ready cancels its start (a second one: its drain); once
    ready, the first asks for a graceful stop."""
    state: dict[str, Any] = {"nc": None, "reply_nc": None, "sidecar": None, "stopping": False}
    received: list[int] = []
    with anyio.CancelScope() as whole:

        def on_signal(signum: int) -> None:
            received.append(signum)
            sidecar = state["sidecar"]
            if len(received) == 1 and sidecar is not None and sidecar.ready.is_set():
                state["stopping"] = True
                sidecar.stop()
            else:
                # A cancel scope cancels every await until it is left: a library that swallows
                # one CancelledError (the interrupt asyncio's runner sends) cannot keep it running.
                whole.cancel()

        with _signals_call(on_signal):
            await _serve(state, config, url, name, make, http_port, no_echo, on_ready)
    return 130 if signal.SIGINT in received else 0


async def _serve(
    state: dict[str, Any], config: Config, url: str, name: str, make: Callable[[NATS, NATS | None], Sidecar],
    http_port: int | None, no_echo: bool, on_ready: Callable[[Any, str], None] | None,
) -> None:
    from .transport import connect, connect_replies

    def alive() -> tuple[bool, str]:
        return liveness(state["nc"], state["reply_nc"])

    def ready() -> tuple[bool, str]:
        nc, sidecar = state["nc"], state["sidecar"]
        if state["stopping"]:
            return False, "stopping"
        if nc is None or sidecar is None:
            return False, "connecting to NATS"
        if not nc.is_connected:
            return False, "not connected to NATS (reconnecting)"
        if not sidecar.ready.is_set():
            return False, "setting up streams and consumers"
        problems = sidecar.problems()
        return (not problems or len(problems) < _model_count(config)), "; ".join(problems) or "ready"

    def model_ready(model: str) -> tuple[int, str]:
        sidecar = state["sidecar"]
        return sidecar.model_ready(model) if sidecar is not None else (503, "connecting to NATS")

    async with anyio.create_task_group() as probes:
        address = await _start_probes(probes, config, http_port, alive, ready, model_ready) if http_port is not None else ""
        nc = await connect(config.nats, url, name=name, no_echo=no_echo)
        state["nc"] = nc
        reply_nc: NATS | None = None
        try:
            reply_nc = await connect_replies(config.nats, url, name=f"{name}-replies")
            state["reply_nc"] = reply_nc
            sidecar = make(nc, reply_nc)
            sidecar.http_address = address
            state["sidecar"] = sidecar

            async def announce() -> None:
                await sidecar.ready.wait()
                if on_ready is not None:
                    on_ready(sidecar, address)

            async with anyio.create_task_group() as tg:
                tg.start_soon(announce)
                freeze_start_up_heap()
                await sidecar.run()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for conn in (reply_nc, nc):
                    if conn is not None:
                        await _drain(conn)
            probes.cancel_scope.cancel()


def liveness(nc: NATS | None, reply_nc: NATS | None = None) -> tuple[bool, str]:
    """``/healthz``: (alive, why). Answering at all proves the event loop turns; a stop past its
    drain shows as a closed connection. A connection that says it is connected while its read
    loop has ended reads nothing again (:func:`~jetbatch.sdk.connection.stopped_reading`): only a
    restart brings the sidecar back, so it is not alive."""
    if nc is None:
        return True, "alive"
    if nc.is_closed:
        return False, "NATS connection closed"
    for conn, what in ((nc, "NATS connection"), (reply_nc, "NATS reply connection")):
        if conn is not None and stopped_reading(conn):
            return False, f"{what} stopped reading (its read loop ended)"
    return True, "alive"


def freeze_start_up_heap() -> None:
    """Move every object the process made so far (torch and the other libraries it imported, the
    configuration) out of the cyclic collector's reach (``gc.freeze``). A full collection
    otherwise walks them all: in a worker that was a 65-80 ms stop of the event loop, and of the
    handler thread through the GIL, each time one ran (the p99 of every burst), and CPU besides.

    Called before the sidecar runs, so before any model is loaded: a model's objects stay
    collectable, and an evicted model whose module graph holds reference cycles is still freed
    (frozen, its tensors would never be). Objects freed by reference counting always are."""
    gc.freeze()
    log.debug("%d objects frozen out of the cyclic collector", gc.get_freeze_count())


def _model_count(config: Config) -> int:
    return max(1, len(config.models))


async def _start_probes(tg: Any, config: Config, port: int, alive: Any, ready: Any, model_ready: Any) -> str:
    """Start the endpoints; returns the address they listen on (``host:port``)."""
    from .health import ProbeServer, prometheus_text

    server = ProbeServer(
        config.http.host, port, alive, ready, prometheus_text if config.http.metrics else None, model_ready if config.models else None
    )
    try:
        bound = await tg.start(server.serve)
    except OSError as exc:
        raise EndpointError(
            f"cannot listen on {config.http.host}:{port} for /healthz, /readyz and /metrics: {exc.strerror or exc} "
            "(another process has the port? choose one with --http-port or [http], 0 for any free port, off for none)"
        ) from None
    return f"{config.http.host}:{bound}"


@contextlib.contextmanager
def _signals_call(on_signal: Callable[[int], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``on_signal(signum)`` on the event loop for the whole block,
    from its first line; after it, the handlers from before it come back (asyncio's own removal
    would leave SIGINT raising ``KeyboardInterrupt`` wherever the process then is). Off the main
    thread, where no handler can be set, the block runs without."""
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.getsignal(signum)
            loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for number, handler in previous.items():
            loop.remove_signal_handler(number)
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


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
