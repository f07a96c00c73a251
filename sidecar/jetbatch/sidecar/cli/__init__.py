"""The ``jetbatch`` command: one module per subcommand, imported plainly.

Nothing here imports torch: ``jetbatch --help``, ``--version``, ``status`` and ``dlq`` start
fast and work where only the SDK's dependencies are installed. Subcommands import what they need
when they run.

Exit codes (the same for every subcommand):

=====  ======================================================================================
code   meaning
=====  ======================================================================================
0      success
1      the command ran and its outcome is negative (``status``: no sidecar answered; ``probe``:
       the sidecar is not ready or does not answer; ``dlq
       replay``: some letters not replayed; ``demo``/``bench``: some requests unanswered;
       ``replay``: the recording's decisions diverged; ``ring``: the worker did not answer or
       its dump came incomplete)
2      a user error, printed as one line: bad arguments, configuration, a missing file or
       binary, no NATS server reachable, a missing extra
130    interrupted (Ctrl-C)
=====  ======================================================================================
"""

from __future__ import annotations

from ..interrupts import EXIT_INTERRUPTED, exits_at_once  # first: main() needs it before anything else

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "CliError", "build_parser", "main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# Imported by main() once Ctrl-C ends the process quietly: the SDK and nats take a quarter of a
# second to import, where an interrupt printed a traceback.
_SUBCOMMANDS = ("worker", "classifier", "up", "demo", "examples", "status", "probe", "dlq", "bench", "simulate", "replay", "ring")


def __getattr__(name: str) -> Any:
    if name == "CliError":
        from ._common import CliError

        return CliError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _version() -> str:
    from jetbatch.sdk import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    import argparse
    import importlib

    parser = argparse.ArgumentParser(
        prog="jetbatch",
        description="Model-affinity batching for many PyTorch models on one GPU, on NATS JetStream.",
        epilog="Exit codes: 0 success, 1 negative outcome, 2 user error (one line), 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"jetbatch {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Until a command starts something it must stop (sidecars handle signals in their event
    # loop, `up`, `demo` and `bench` say so), Ctrl-C exits 130 at once: see interrupts.py.
    with exits_at_once():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    import logging

    _import_from_working_directory()
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", None)
    if level is not None:
        logging.basicConfig(
            level=getattr(logging, str(level).upper(), logging.WARNING),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        return int(args.run(args) or EXIT_OK)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - sorted into user errors and bugs below
        user = _user_error(exc)
        if user is None:
            raise
        print(f"jetbatch {args.command}: {user}", file=sys.stderr)
        return EXIT_USAGE


def _import_from_working_directory() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m jetbatch`` does: a
    ``module_class``, ``function`` or custom handler is documented to import from there, and the
    ``jetbatch`` console script's path starts with its own ``bin`` folder instead."""
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def _user_error(exc: BaseException) -> BaseException | None:
    """A jetbatch error (anything under JetbatchError: config, connection, handler, setup) or a
    missing extra, also inside the exception groups task groups raise."""
    from jetbatch.sdk.errors import JetbatchError

    from ._common import CliError

    if isinstance(exc, (JetbatchError, CliError)):
        return exc
    if isinstance(exc, MemoryError):
        # What the input asked for (a workload, a payload size) does not fit this process.
        return CliError("out of memory: the input asks for more than this process can hold")
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in _EXTRAS:
        return CliError(f"{exc.name} is not installed: {_EXTRAS[exc.name.split('.')[0]]}")
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _user_error(inner)
            if found is not None:
                return found
    return None


# What to install when a subcommand's dependency is missing.
_EXTRAS = {
    "torch": "pip install 'jetbatch[sidecar]'",
    "anyio": "pip install 'jetbatch[sidecar]'",
    "safetensors": "pip install 'jetbatch[sidecar]'",
    "matplotlib": "pip install 'jetbatch[plot]' (plots for bench and simulate)",
}
