"""``jetbatch examples build``: the example models and configs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ._common import CliError, add_log_level, usable_dir, writable_dir

DEFAULT_DIR = ".jetbatch/examples"


def register(sub: Any) -> None:
    p = sub.add_parser("examples", help="build the example models and configs")
    p.add_argument("action", choices=["build"], help="build: write the models and configs")
    p.add_argument("--dir", default=None, metavar="DIR", help="where to write them (default: $JETBATCH_HOME/examples, else .jetbatch/examples)")
    p.add_argument("--force", action="store_true", help="rebuild even if the directory holds a current build")
    add_log_level(p)
    p.set_defaults(run=run)


def default_dir() -> str:
    import os

    return str(Path(os.environ.get("JETBATCH_HOME", ".jetbatch")) / "examples")


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.dev.example_models import build_examples

    directory = args.dir or default_dir()
    usable_dir(directory, "--dir")
    writable_dir(directory, "--dir")
    try:
        ex = build_examples(Path(directory), force=args.force)
    except OSError as exc:
        raise CliError(f"--dir {directory}: cannot write {exc.filename or 'a file'}: {exc.strerror or exc}") from None
    print(f"built example models in {ex.directory}")
    print(f"  worker:     jetbatch worker --config {ex.models_toml} --nats-url nats://...")
    print(f"  classifier: jetbatch classifier --config {ex.classifier_toml} --nats-url nats://...")
    print(f"  both, with an embedded server: jetbatch up --config {ex.up_toml}")
    return 0
