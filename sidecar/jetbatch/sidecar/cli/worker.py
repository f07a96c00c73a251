"""``jetbatch worker``: run a GPU worker sidecar."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import CliError, add_record, print_ready, ready_line, add_sidecar_options, check_connection_files, http_port, open_recorder, run_async, setup_telemetry


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a GPU worker sidecar", description="Serve the models of a config from their JetStream queues.")
    add_sidecar_options(p, config_required=True)
    add_record(p, "the worker")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.config import load_config
    from jetbatch.sidecar.handlers import HandlerError, check_model_configs, resolve_device
    from jetbatch.sidecar.runtime import serve_sidecar
    from jetbatch.sidecar.worker import Worker

    config = load_config(args.config)
    if not config.models:
        raise CliError(f"{args.config}: no [models.<name>] section: a worker needs a model to serve")
    check_connection_files(config, args.config)
    try:
        resolve_device(config.worker.device)
    except HandlerError as exc:
        raise CliError(f"{args.config}: worker.device: {exc}") from None
    check_model_configs(config.models, args.config)  # a bad handler or module_class names its file and key now
    url = args.nats_url or config.nats.url
    if not url:
        raise CliError("no NATS server: pass --nats-url, set NATS_URL or nats.url, or use `jetbatch up` for an embedded one")
    port = http_port(args, config.http.worker_port)
    recorder = open_recorder(args)
    shutdown = setup_telemetry("worker", args, config.worker.id, prometheus=port is not None and config.http.metrics)
    try:
        return run_async(
            # no_echo: the worker hears its peers' take and settle events, never its own (two
            # messages a batch it would only drop); nothing else it publishes comes back to it.
            serve_sidecar(
                config, url, name="jetbatch-worker", make=lambda nc, rnc: Worker(config, nc, reply_nc=rnc, record=recorder), http_port=port, no_echo=True,
                on_ready=lambda w, address: print_ready(ready_line("worker", w.worker_id, address, f"serving {', '.join(config.models)}")),
            )
        )
    finally:
        if recorder is not None:
            recorder.close()
        shutdown()
