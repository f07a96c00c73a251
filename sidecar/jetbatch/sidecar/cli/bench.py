"""``jetbatch bench``: load-test a deployment (or an embedded one) through the SDK."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import sys
from pathlib import Path
from typing import Any

from ..interrupts import run_interruptible, sigterm_as_interrupt
from ._common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CliError,
    add_json,
    add_log_level,
    add_nats_url,
    add_prefix,
    concurrency_count,
    positive_seconds,
    request_rate,
    writable_file,
)


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="load-test a deployment (or an embedded one) with the SDK")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=request_rate, metavar="RPS", help="open loop: requests per second (Poisson arrivals)")
    load.add_argument("--concurrency", type=concurrency_count, metavar="N", help="closed loop: N callers in parallel")
    p.add_argument("--duration", type=positive_seconds, default=10.0, metavar="S", help="seconds of load (default 10)")
    p.add_argument("--mix", default="m1=0.5,m2=0.5", help="model mix, e.g. m1=0.5,m2=0.3,auto=0.2 (auto: the classifier decides)")
    p.add_argument("--payload", default="bytes:256", help="bytes:N | tensor:DIM | examples (default bytes:256)")
    p.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S", help="per-request timeout in seconds (default 30)")
    add_nats_url(p)
    p.add_argument("--config", default=None, metavar="FILE", help="config for the embedded deployment (default: sleep models for the mix)")
    add_prefix(p)
    add_json(p, "the summary")
    p.add_argument("--out", default=None, metavar="FILE", help="write the summary and the per-request timeline here (JSON)")
    p.add_argument("--plot", default=None, metavar="PNG", help="latency over time and a residency timeline (needs jetbatch[plot])")
    add_log_level(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.dev.loadtest import BenchError, BenchResult, check_payload, parse_mix, plot_timeline, print_table, run_bench, sleep_config

    try:
        mix = parse_mix(args.mix)
        check_payload(args.payload)
        if args.out:
            writable_file(args.out, "--out")
        if args.plot:
            writable_file(args.plot, "--plot")
            import matplotlib  # noqa: F401  - before the run, not after it
        url = args.nats_url or os.environ.get("NATS_URL")
        config = args.config
        if url is None and config is None:
            config = str(sleep_config(mix, Path(tempfile.mkdtemp(prefix="jetbatch-bench-"))))
    except BenchError as exc:
        raise CliError(str(exc)) from None
    deployment = None
    result = BenchResult()
    interrupted = False
    with sigterm_as_interrupt():
        try:
            if url is None:
                from jetbatch.sidecar.dev.deployment import Deployment

                deployment = Deployment(config, log_level=args.log_level).start()
                url = deployment.url
            run_interruptible(
                run_bench(
                    url, mix=mix, duration_s=args.duration, concurrency=args.concurrency, rate=args.rate,
                    payload=args.payload, timeout_s=args.timeout, prefix=args.prefix, progress=not args.json, result=result,
                )
            )  # fmt: skip
        except KeyboardInterrupt:
            # Like wrk and locust: what was measured until the interrupt is still reported.
            interrupted = True
            if result.sent == 0:
                raise
        finally:
            if deployment is not None:
                deployment.stop()
    summary = result.summary()
    summary["interrupted"] = interrupted
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "timeline": result.timeline}, indent=1))
    if args.plot:
        plot_timeline(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    if interrupted:
        return EXIT_INTERRUPTED
    if not summary["sent"]:
        # Nothing measured is no success (a loaded machine left a 0.5 s run no time to send).
        print("jetbatch bench: no request was sent within the duration", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK if summary["answered"] == summary["sent"] else EXIT_FAILED
