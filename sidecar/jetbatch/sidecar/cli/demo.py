"""``jetbatch demo``: embedded NATS, the classifier and a worker with the example models, a mixed
workload, a line per batch and a summary."""

from __future__ import annotations

import argparse
from typing import Any

from ..interrupts import sigterm_as_interrupt
from ._common import add_log_level, add_nats_url, concurrency_count, request_count, usable_dir


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="embedded NATS + classifier + worker + a mixed workload, with a summary")
    add_nats_url(p)
    add_log_level(p)
    p.add_argument("--requests", type=request_count, default=240, metavar="N", help="requests to send (default 240)")
    p.add_argument("--concurrency", type=concurrency_count, default=64, metavar="N", help="requests in flight at once (default 64)")
    p.add_argument("--dir", default=None, metavar="DIR", help="where the example models are built (default: $JETBATCH_HOME/examples)")
    p.add_argument("--quiet", action="store_true", help="no per-batch lines, only the summary")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.dev.demo import run_demo

    from .examples import default_dir

    if args.dir is None:
        args.dir = default_dir()
    usable_dir(args.dir, "--dir")  # before NATS and the sidecars start
    with sigterm_as_interrupt():
        return run_demo(args)
