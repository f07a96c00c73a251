"""``jetbatch classifier``: run the classifier sidecar."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import CliError, add_sidecar_options, check_connection_files, http_port, print_ready, ready_line, run_async, setup_telemetry


def register(sub: Any) -> None:
    p = sub.add_parser(
        "classifier", help="run the classifier sidecar (routes jetbatch.in to model queues)",
        description="Route requests from <prefix>.in to per-model queues with a torch network, rules or a callable.",
    )  # fmt: skip
    add_sidecar_options(p, config_required=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.classifier import Classifier
    from jetbatch.sidecar.config import ConfigError, load_config
    from jetbatch.sidecar.runtime import serve_sidecar

    config = load_config(args.config)
    if config.classifier is None:
        raise ConfigError(f"{args.config}: no [classifier] section")
    from jetbatch.sidecar.classifier.routers import check_router_config

    check_router_config(config.classifier, args.config)
    router = config.classifier.router
    check_connection_files(config, args.config)
    url = args.nats_url or config.nats.url
    if not url:
        raise CliError("no NATS server: pass --nats-url or set NATS_URL or nats.url")
    port = http_port(args, config.http.classifier_port)
    shutdown = setup_telemetry("classifier", args, prometheus=port is not None and config.http.metrics)
    try:
        return run_async(
            serve_sidecar(
                config, url, name="jetbatch-classifier", make=lambda nc, rnc: Classifier(config, nc, reply_nc=rnc), http_port=port,
                on_ready=lambda c, address: print_ready(ready_line("classifier", c.id, address, f"router {router}")),
            )
        )
    finally:
        shutdown()
