"""What the subcommands share: exit codes, the user-error type, common options."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Coroutine

from jetbatch.sdk.errors import JetbatchError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(JetbatchError):
    """A user-facing failure: printed as one line, exit status 2."""


def add_nats_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", default=None, metavar="URL", help="NATS server URL(s), comma-separated (default: $NATS_URL)")


def add_prefix(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default="jetbatch", help="subject prefix of the deployment (default: jetbatch)")


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level", default=os.environ.get("JETBATCH_LOG_LEVEL", "WARNING"), metavar="LEVEL",
        help="DEBUG, INFO, WARNING (default, or $JETBATCH_LOG_LEVEL) or ERROR",
    )  # fmt: skip


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout instead of a table")


def add_sidecar_options(p: argparse.ArgumentParser, *, config_required: bool) -> None:
    p.add_argument("--config", "-c", required=config_required, metavar="FILE", help="TOML config file (see the README)")
    add_nats_url(p)
    add_log_level(p)
    p.add_argument("--trace-console", action="store_true", help="print spans to stdout (debugging)")


def setup_telemetry(role: str, args: argparse.Namespace, worker_id: str | None = None) -> Callable[[], None]:
    from jetbatch.sidecar.otel import setup_telemetry as setup

    return setup(role, console=bool(getattr(args, "trace_console", False)), worker_id=worker_id)


def run_async(coro: Coroutine[Any, Any, Any]) -> int:
    import anyio

    async def runner() -> int:
        return int(await coro or 0)

    return anyio.run(runner)
