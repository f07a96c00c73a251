"""``jetbatch worker``: run a GPU worker sidecar."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._common import CliError, add_record, ring_minutes, writable_file, print_ready, ready_line, add_sidecar_options, check_connection_files, http_port, open_recorder, run_async, setup_telemetry


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a GPU worker sidecar", description="Serve the models of a config from their JetStream queues.")
    add_sidecar_options(p, config_required=True)
    add_record(p, "the worker")
    p.add_argument(
        "--ring-minutes", default=None, type=ring_minutes, metavar="MIN",
        help="keep the core's last MIN to 2xMIN minutes in memory and write them to --ring-path on SIGUSR1, or send them to "
        "`jetbatch ring --worker ID` over NATS (`jetbatch replay` checks either)",
    )  # fmt: skip
    p.add_argument("--ring-path", default=None, metavar="PATH", help="where SIGUSR1 writes the ring (default: worker-ring.jsonl)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.config import load_config
    from jetbatch.sidecar.handlers import HandlerError, check_model_configs, models_use_torch, resolve_device
    from jetbatch.sidecar.runtime import serve_sidecar
    from jetbatch.sidecar.worker import Worker

    config = load_config(args.config)
    if not config.models:
        raise CliError(f"{args.config}: no [models.<name>] section: a worker needs a model to serve")
    check_connection_files(config, args.config)
    check_model_configs(config.models, args.config)  # a bad handler or module_class names its file and key now
    if models_use_torch(config.models, config.worker.device):  # else torch is never imported
        try:
            resolve_device(config.worker.device)
        except HandlerError as exc:
            raise CliError(f"{args.config}: worker.device: {exc}") from None
    url = args.nats_url or config.nats.url
    if not url:
        raise CliError("no NATS server: pass --nats-url, set NATS_URL or nats.url, or use `jetbatch up` for an embedded one")
    port = http_port(args, config.http.worker_port)
    recorder = open_recorder(args)
    ring, ring_path = None, None
    if args.ring_minutes is not None:
        from jetbatch.sidecar.recording import Recorders, RingRecorder

        ring_path = args.ring_path or "worker-ring.jsonl"
        writable_file(ring_path, "--ring-path")
        ring = RingRecorder(args.ring_minutes * 60.0)
    elif args.ring_path is not None:
        raise CliError("--ring-path: give --ring-minutes too (how much to keep)")
    record = Recorders(*(r for r in (recorder, ring) if r is not None)) if ring is not None else recorder
    shutdown = setup_telemetry("worker", args, config.worker.id, prometheus=port is not None and config.http.metrics)
    ready = _Ready()

    def on_ready(w: Any, address: str) -> None:
        ready.set(w)
        print_ready(ready_line("worker", w.worker_id, address, f"serving {', '.join(config.models)}"))
    try:
        return run_async(
            # no_echo: the worker hears its peers' take and settle events, never its own (two
            # messages a batch it would only drop); nothing else it publishes comes back to it.
            _with_ring_dumps(
                serve_sidecar(
                    config, url, name="jetbatch-worker", make=lambda nc, rnc: Worker(config, nc, reply_nc=rnc, record=record), http_port=port,
                    no_echo=True,
                    on_ready=on_ready,
                ),
                ring, ring_path, ready,
            )  # fmt: skip
        )
    finally:
        if recorder is not None:
            recorder.close()
        shutdown()


class _Ready:
    """The worker once ready (its ring is served on its connection from then): set by a plain
    callback, awaited by the ring's server."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.event: Any = None  # an anyio.Event, made on the event loop

    def set(self, worker: Any) -> None:
        self.worker = worker
        if self.event is not None:
            self.event.set()


async def _with_ring_dumps(serving: Any, ring: Any, path: str | None, ready: _Ready) -> int:
    """Run ``serving``; with a ring, write it to ``path`` on each SIGUSR1 and send it to each
    request on the worker's ring subject (``ring_dump.py``) once the worker is ready (``ready``
    gets it). Both on the event loop, so a dump never sees an event half recorded."""
    if ring is None:
        return int(await serving)
    import signal

    import anyio

    from ..errors import TRANSPORT_ERRORS, SidecarError

    ready.event = anyio.Event()

    async def dump_on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGUSR1) as signals:
            async for _ in signals:
                try:
                    n = ring.dump(path)
                    print(f"jetbatch worker: wrote {n} events of the core's ring to {path}", file=sys.stderr, flush=True)
                except (OSError, SidecarError) as exc:
                    print(f"jetbatch worker: could not write the ring to {path}: {exc}", file=sys.stderr, flush=True)

    async def serve_over_nats() -> None:
        from ..ring_dump import serve_ring

        if ready.worker is None:
            await ready.event.wait()
        w = ready.worker
        try:
            await serve_ring(w.nc, w.subjects, w.worker_id, ring, w.config.reply_policy, out=w.replier.out)
        except (SidecarError, ValueError, *TRANSPORT_ERRORS) as exc:  # an id that is no subject, a subscription refused
            print(f"jetbatch worker: the ring is not served over NATS: {exc}", file=sys.stderr, flush=True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(dump_on_signal)
        tg.start_soon(serve_over_nats)
        code = int(await serving)
        tg.cancel_scope.cancel()
    return code
