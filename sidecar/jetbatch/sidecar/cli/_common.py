"""What the subcommands share: exit codes, the user-error type, common options."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Callable, Coroutine

from jetbatch.sdk.errors import JetbatchError

from ..interrupts import EXIT_INTERRUPTED  # noqa: F401 - the subcommands read every exit code here

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class CliError(JetbatchError):
    """A user-facing failure: printed as one line, exit status 2."""


def shown(value: object) -> str:
    """``value`` as text safe to print in a table: characters that are not printable (terminal
    escape sequences, newlines) written as escapes. What the bus says (a sidecar's id, a dead
    letter's reason) is written by whoever could publish there, and must not drive the
    operator's terminal or forge a row."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def add_nats_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", default=None, metavar="URL", help="NATS server URL(s), comma-separated (default: $NATS_URL)")


def add_prefix(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default="jetbatch", help="subject prefix of the deployment (default: jetbatch)")


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """An argparse type: a logging level name, any case (WARN is WARNING, as logging has it)."""
    level = text.strip().upper()
    level = "WARNING" if level == "WARN" else level
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_LOG_LEVELS)} (here or in $JETBATCH_LOG_LEVEL), got {text!r}")
    return level


def add_log_level(p: argparse.ArgumentParser) -> None:
    # The environment's value goes through the same check when argparse applies the default.
    p.add_argument(
        "--log-level", default=os.environ.get("JETBATCH_LOG_LEVEL", "WARNING"), type=log_level, metavar="LEVEL",
        help="DEBUG, INFO, WARNING (default, or $JETBATCH_LOG_LEVEL) or ERROR",
    )  # fmt: skip


def _number(kind: type, minimum: float, inclusive: bool, maximum: float | None = None) -> Callable[[str], Any]:
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    if maximum is not None:
        bound += f" and <= {maximum:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        in_range = (value >= minimum if inclusive else value > minimum) and (maximum is None or value <= maximum)
        if value != value or value in (float("inf"), float("-inf")) or not in_range:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__} {bound}"
    return parse


# argparse types for counts and durations: a bad value is argparse's one-line usage error.
positive_int = _number(int, 1, True)
non_negative_int = _number(int, 0, True)
positive_float = _number(float, 0.0, False)
# Durations, timeouts and waits: a week at most (beyond about 1e9 s, socket and event-loop
# timeouts overflow with a traceback).
MAX_SECONDS = 7 * 24 * 3600.0
positive_seconds = _number(float, 0.0, False, MAX_SECONDS)
# Callers in flight and requests sent: each is a coroutine or a row in memory (a concurrency of
# 1e11 took the machine's memory and left the embedded server behind when it was killed).
MAX_CONCURRENCY = 100_000
MAX_REQUESTS = 10_000_000
concurrency_count = _number(int, 1, True, MAX_CONCURRENCY)
request_count = _number(int, 0, True, MAX_REQUESTS)
non_negative_float = _number(float, 0.0, True)
# An open loop's arrivals a second: far above what one event loop can send (at 1e308 the next
# arrival's time stopped advancing, and the run never ended).
MAX_RATE = 1_000_000.0
request_rate = _number(float, 0.0, False, MAX_RATE)


def writable_file(path: str, what: str) -> None:
    """Fail now, before a long run, if ``path`` cannot be written (a missing folder, a directory)."""
    from pathlib import Path

    target = Path(path)
    if target.is_dir():
        raise CliError(f"{what} {path}: is a directory")
    parent = target.parent
    if not parent.is_dir():
        raise CliError(f"{what} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise CliError(f"{what} {path}: folder {parent} is not writable")


def usable_dir(path: str, what: str) -> None:
    """Create ``path`` (with its parents) or fail with one line: a file in the way, no permission."""
    from pathlib import Path

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CliError(f"{what} {path}: exists and is not a directory") from None
    except OSError as exc:
        raise CliError(f"{what} {path}: cannot create it: {exc.strerror or exc}") from None


def writable_dir(path: str, what: str) -> None:
    """Fail with one line, naming this process's user, if no file can be created in ``path`` (a
    volume owned by another user, a read-only mount): found here, before a build writes half its
    files and torch reports the first refusal as a traceback."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        who = f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "this user"
        raise CliError(f"{what} {path}: not writable by {who}: {exc.strerror or exc}") from None


def check_connection_files(config: Any, source: str) -> None:
    """The credential and TLS files ``config.nats`` names (its reply identity's too) exist: a
    missing one is named with ``source``, the config file, before anything connects (it was
    found at connect, without the file)."""
    from ..config import ConfigError
    from ..transport import connect_options

    try:
        connect_options(config.nats)
        if config.nats.reply_identity is not None:
            connect_options(config.nats, config.nats.reply_identity)
    except ConfigError as exc:
        raise CliError(f"{source}: {exc}") from None


# A flight recording's size bound, in MiB (the recorder stops there; recording.py).
record_mib = _number(int, 1, True, 1024 * 1024)
# How many minutes a ring of the core's events keeps (at least; recording.RingRecorder): a day at most.
ring_minutes = _number(float, 0.0, False, 24 * 60.0)


def add_record(p: argparse.ArgumentParser, what: str) -> None:
    """``--record PATH`` and ``--record-max-mib``: the flight recorder of a worker core."""
    p.add_argument("--record", default=None, metavar="PATH", help=f"record {what}'s core, its events and actions, as JSON lines (`jetbatch replay PATH` checks it)")
    p.add_argument("--record-max-mib", default=256, type=record_mib, metavar="MIB", help="stop recording past this size (default 256)")


def open_recorder(args: argparse.Namespace) -> Any:
    """The ``FlightRecorder`` that ``--record`` asks for (None without it), or a one-line error."""
    if args.record is None:
        return None
    from ..recording import FlightRecorder

    writable_file(args.record, "--record")
    try:
        return FlightRecorder(args.record, max_bytes=args.record_max_mib * 1024 * 1024)
    except OSError as exc:
        raise CliError(f"--record {args.record}: {exc.strerror or exc}") from None


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout instead of a table")


def add_sidecar_options(p: argparse.ArgumentParser, *, config_required: bool) -> None:
    p.add_argument("--config", "-c", required=config_required, metavar="FILE", help="TOML config file (see the README)")
    add_nats_url(p)
    add_log_level(p)
    p.add_argument("--trace-console", action="store_true", help="print spans to stdout (debugging)")
    p.add_argument(
        "--http-port", default=None, type=_port, metavar="PORT",
        help="port of /healthz, /readyz and /metrics (0: any free port, 'off': none; default: [http] in the config, 9464 worker, 9465 classifier)",
    )  # fmt: skip


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range 0-65535")
    return port


def _port(text: str) -> int:
    """A port number, or 'off' (-1): no HTTP endpoints."""
    if text.strip().lower() == "off":
        return -1
    return port_number(text)


def http_port(args: argparse.Namespace, configured: int | None) -> int | None:
    """The HTTP port to serve on: --http-port over the config; None when off."""
    chosen = getattr(args, "http_port", None)
    if chosen is None:
        return configured
    return None if chosen < 0 else int(chosen)


def setup_telemetry(role: str, args: argparse.Namespace, worker_id: str | None = None, *, prometheus: bool = False) -> Callable[[], None]:
    from jetbatch.sidecar.otel import setup_telemetry as setup

    return setup(role, console=bool(getattr(args, "trace_console", False)), worker_id=worker_id, prometheus=prometheus)


def run_async(coro: Coroutine[Any, Any, Any]) -> int:
    """Run a sidecar's coroutine on asyncio, with uvloop's event loop when it is installed
    (``pip install 'jetbatch[fast]'``; ``JETBATCH_UVLOOP=0`` turns it off)."""
    import importlib.util

    import anyio

    async def runner() -> int:
        return int(await coro or 0)

    use_uvloop = os.environ.get("JETBATCH_UVLOOP", "1") != "0" and importlib.util.find_spec("uvloop") is not None
    return anyio.run(runner, backend="asyncio", backend_options={"use_uvloop": use_uvloop})


def print_ready(line: str) -> None:
    """Print a sidecar's ready line, unless what started it says so itself (``READY_LINE_ENV``)."""
    from ..runtime import READY_LINE_ENV

    if os.environ.get(READY_LINE_ENV, "1") != "0":
        print(line, flush=True)


def ready_line(role: str, sidecar_id: str, address: str, serves: str = "") -> str:
    """The one line a sidecar prints when it is ready: who it is, what it serves, and where its
    /readyz and /metrics listen as bound (``--http-port 0`` picks the port: this says which)."""
    where = f"/readyz and /metrics on http://{address}" if address else "HTTP endpoints off"
    return f"{role} {sidecar_id} ready{f', {serves}' if serves else ''}; {where}"


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # :class:`Name`, :func:`~mod.name` (shown as name)


def plain(doc: str) -> str:
    """A docstring as ``--help`` shows it: reStructuredText's ``literals`` and :role:`refs`
    become plain text (argparse prints a description as given)."""
    return _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc).replace("``", "`")
