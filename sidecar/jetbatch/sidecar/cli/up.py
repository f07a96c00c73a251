"""``jetbatch up``: the sidecars of a config in one process tree, with an embedded nats-server
on the standard port unless told otherwise."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ._common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, add_sidecar_options, port_number


def register(sub: Any) -> None:
    p = sub.add_parser(
        "up", help="run the sidecars of a config in one process tree (embedded NATS if no URL)",
        description="Run a worker (and the classifier, if the config has one). Without --nats-url, start an embedded "
        "nats-server on 127.0.0.1:4222 with JetStream, its store under $JETBATCH_HOME/nats, that admits only the "
        "worker, classifier, app and admin users whose passwords it keeps in $JETBATCH_HOME/credentials.",
    )  # fmt: skip
    add_sidecar_options(p, config_required=False)
    p.add_argument("--no-classifier", action="store_true", help="run only the worker")
    p.add_argument("--port", type=port_number, default=4222, help="port of the embedded nats-server (default 4222; 0: any free port)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.dev.deployment import Deployment, DeploymentError

    home = Path(os.environ.get("JETBATCH_HOME", ".jetbatch"))
    config_path = args.config
    if config_path is None:
        from jetbatch.sidecar.dev.example_models import build_examples

        config_path = str(build_examples(home / "examples").up_toml)
    dep = Deployment(
        config_path,
        nats_url=args.nats_url,
        classifier=not args.no_classifier,
        store_dir=home / "nats",
        log_level=args.log_level,
        capture_output=False,
        port=-1 if args.port == 0 else args.port,
        configured_http=True,
        http_port=args.http_port,
        credentials_dir=home / "credentials",
    )
    stop = {"signal": 0, "failed": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        dep.start()
    except DeploymentError as exc:
        if stop["signal"]:
            return EXIT_INTERRUPTED  # Ctrl-C while starting: the sidecars stopped because of it, not failed
        if exc.shown:
            return EXIT_USAGE  # the sidecar's own one-line error is the message
        raise
    if stop["signal"]:
        dep.stop()
        return EXIT_INTERRUPTED
    names = ", ".join(f"{dep.ids.get(name, name)} ({name.rstrip('0123456789')})" for name in dep.procs)
    print(f"jetbatch up: NATS at {dep.url}; sidecars: {names}. Ctrl-C to stop.", flush=True)
    for name, report in dep.reports.items():
        if report.http:
            # The address each sidecar reports it listens on (a free port with --http-port 0).
            host, _, port = report.http.rpartition(":")
            shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            print(f"jetbatch up: {report.id} health and metrics at http://{shown}:{port}/readyz and /metrics", flush=True)
    if dep.passwords:
        _print_credentials(dep.credentials_dir, dep.url)
    try:
        while not stop["signal"]:
            for name, proc in list(dep.procs.items()):
                if proc.poll() is not None:
                    print(f"jetbatch up: {dep.ids.get(name, name)} exited with status {proc.returncode}; stopping", file=sys.stderr)
                    stop["failed"] = True
            if stop["failed"]:
                break
            time.sleep(0.2)
    finally:
        dep.stop()
    if stop["signal"]:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if stop["failed"] else 0


def _print_credentials(folder: Path | None, url: str) -> None:
    """Where the app's and the admin's passwords are, and how to connect with them."""
    assert folder is not None
    app, admin = folder / "app.json", folder / "admin.json"
    print(f"jetbatch up: NATS admits only its users (docs/security.md); the app's credentials are in {app} (owner only):", flush=True)
    print(f"jetbatch up:   sdk.Client.connect({url!r}, **json.load(open({str(app)!r})))", flush=True)
    host = url.removeprefix("nats://")
    print(f"jetbatch up: status, dlq, bench: --nats-url nats://admin:PASSWORD@{host}, the admin's PASSWORD in {admin}", flush=True)
