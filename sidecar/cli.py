"""The ``jetbatch`` command line.

Errors a user can fix (bad config, no server, missing binary) print one line to stderr and exit
with status 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

__all__ = ["main"]

EXIT_USAGE = 2
DEFAULT_HOME = Path(os.environ.get("JETBATCH_HOME", ".jetbatch"))


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def _fail(message: str) -> NoReturn:
    raise CliError(message)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "fix your input or environment", not "jetbatch has a bug"."""
    from sdk.errors import JetbatchError

    from .config import ConfigError
    from .handlers import HandlerError
    from .natsserver import NatsServerNotFound
    from .streams import StreamSetupError
    from .up import DeploymentError

    return (CliError, ConfigError, HandlerError, NatsServerNotFound, StreamSetupError, JetbatchError, DeploymentError)


# --- subcommands ------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, *, config_required: bool = False) -> None:
    p.add_argument("--config", "-c", required=config_required, help="TOML config file")
    p.add_argument("--nats-url", default=None, help="NATS server URL(s), comma-separated (default: $NATS_URL)")
    p.add_argument("--log-level", default=os.environ.get("JETBATCH_LOG_LEVEL", "WARNING"))
    p.add_argument("--trace-console", action="store_true", help="print spans to stdout (debugging)")


def _setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _setup_telemetry(role: str, args: argparse.Namespace, worker_id: str | None = None) -> Callable[[], None]:
    try:
        from .otel import setup_telemetry
    except ImportError:  # telemetry setup module not present: API no-ops
        return lambda: None
    return setup_telemetry(role, console=bool(getattr(args, "trace_console", False)), worker_id=worker_id)


def cmd_worker(args: argparse.Namespace) -> int:
    from .config import load_config

    config = load_config(args.config)
    url = args.nats_url or config.nats.url
    if not url:
        _fail("no NATS server: pass --nats-url, set NATS_URL or nats.url, or use `jetbatch up` for an embedded one")
    shutdown = _setup_telemetry("worker", args, config.worker.id)
    try:
        return _run_async(_run_worker(config, url))
    finally:
        shutdown()


async def _run_worker(config: Any, url: str) -> int:
    from .runtime import serve_sidecar
    from .worker import Worker

    return await serve_sidecar(config, url, name="jetbatch-worker", make=lambda nc, rnc: Worker(config, nc, reply_nc=rnc))


def _run_async(coro: Any) -> int:
    import anyio

    async def runner() -> int:
        return int(await coro or 0)

    return anyio.run(runner)


def cmd_up(args: argparse.Namespace) -> int:
    from .up import run_up

    return run_up(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def cmd_examples(args: argparse.Namespace) -> int:
    from .example_models import build_examples

    ex = build_examples(Path(args.dir), force=args.force)
    print(f"built example models in {ex.directory}")
    print(f"  worker:     jetbatch worker --config {ex.models_toml} --nats-url nats://...")
    print(f"  classifier: jetbatch classifier --config {ex.classifier_toml} --nats-url nats://...")
    print(f"  both, with an embedded server: jetbatch up --config {ex.up_toml}")
    return 0


def _delegate(module: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]] | None:
    """Subcommands implemented in their own module expose add_arguments(parser) and run(args)."""
    try:
        mod = importlib.import_module(f"sidecar.{module}")
    except ImportError as exc:
        if exc.name and exc.name.startswith("sidecar"):
            return None
        raise
    add = getattr(mod, "add_arguments", None)
    run = getattr(mod, "run", None)
    if add is None or run is None:
        return None
    return add, run


_DELEGATED = {
    "classifier": ("classifier", "run the classifier sidecar (routes jetbatch.in to model queues)"),
    "simulate": ("simulator", "simulate scheduling policies on a workload"),
    "bench": ("bench", "load-test a deployment (or an embedded one) with the SDK"),
    "status": ("status", "show every sidecar on the bus"),
    "dlq": ("dlq", "inspect, replay or purge dead letters"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetbatch", description="Model-affinity batching sidecar on NATS JetStream")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("worker", help="run a GPU worker sidecar")
    _add_common(p, config_required=True)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("up", help="run the sidecars of a config in one process tree (embedded NATS if no URL)")
    _add_common(p)
    p.add_argument("--no-classifier", action="store_true", help="run only the worker")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("demo", help="embedded NATS + classifier + worker + a mixed workload, with a summary")
    _add_common(p)
    p.add_argument("--requests", type=int, default=240, help="requests to send (default 240)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--dir", default=str(DEFAULT_HOME / "examples"), help="where example models are built")
    p.add_argument("--quiet", action="store_true", help="no per-batch lines")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("examples", help="build the example models and configs")
    p.add_argument("action", choices=["build"])
    p.add_argument("--dir", default=str(DEFAULT_HOME / "examples"))
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_examples)

    for name, (module, help_text) in _DELEGATED.items():
        found = _delegate(module)
        if found is None:
            continue
        add, run = found
        p = sub.add_parser(name, help=help_text)
        add(p)
        p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        import anyio  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        print(
            f"jetbatch: the sidecar needs its extras ({exc.name} is missing): pip install 'jetbatch[sidecar]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "log_level"):
        _setup_logging(args)
    user_errors = _user_errors()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # noqa: BLE001 - sorted into user errors and bugs below
        user = _unwrap(exc, user_errors)
        if user is None:
            raise
        print(f"jetbatch {args.command}: {user}", file=sys.stderr)
        return EXIT_USAGE


def _unwrap(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """Find a user error, also inside the exception groups that task groups raise."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _unwrap(inner, kinds)
            if found is not None:
                return found
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
