"""``jetbatch ring``: ask a running worker for its ring of recent core events over NATS and write
it as a recording (``jetbatch replay`` checks it). No torch needed."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from ._common import EXIT_FAILED, EXIT_OK, CliError, add_nats_url, add_prefix, plain, positive_seconds, writable_file


def register(sub: Any) -> None:
    p = sub.add_parser(
        "ring", help="fetch a worker's ring of recent core events (worker --ring-minutes)",
        description=plain(__doc__) + " Exit status 1 when the worker does not answer or the dump came incomplete.",
    )  # fmt: skip
    add_nats_url(p)
    add_prefix(p)
    p.add_argument("--worker", required=True, metavar="ID", help="the worker's id, as `jetbatch status` shows it")
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the recording (replaced whole)")
    p.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S", help="seconds for the whole transfer (default 30)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sdk.protocol import ProtocolError, Subjects

    writable_file(args.out, "--out")
    subjects = Subjects(args.prefix)
    try:
        subjects.ring(args.worker)
    except ProtocolError as exc:
        raise CliError(f"--worker: {exc}") from None
    from jetbatch.sidecar.ring_dump import RingTransferError

    try:
        data = asyncio.run(_fetch(args, subjects))
    except RingTransferError as exc:
        print(f"jetbatch ring: {exc}")
        return EXIT_FAILED
    tmp = f"{args.out}.part"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, args.out)  # a reader never sees half a dump
    except OSError as exc:
        raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
    events = max(0, data.count(b"\n") - 2)  # the started line and the snapshot are not events
    print(f"wrote {len(data)} bytes ({events} events) of worker {args.worker}'s ring to {args.out}; check it with `jetbatch replay {args.out}`")
    return EXIT_OK


async def _fetch(args: argparse.Namespace, subjects: Any) -> bytes:
    from jetbatch.sdk.connection import connect_nats
    from jetbatch.sidecar.ring_dump import fetch_ring

    nc = await connect_nats(args.nats_url)
    try:
        return await fetch_ring(nc, subjects, args.worker, timeout_s=args.timeout)
    finally:
        await nc.close()
