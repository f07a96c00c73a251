"""``jetbatch status``: every sidecar on the bus, and who holds which model. No torch needed."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ._common import EXIT_FAILED, EXIT_OK, add_json, add_nats_url, add_prefix, positive_seconds, shown


def register(sub: Any) -> None:
    p = sub.add_parser(
        "status", help="show every sidecar on the bus",
        description="Ask every sidecar on <prefix>.status, and show the cluster view (holders and backlog per model). "
        "Exit status 1 when no sidecar answers.",
    )  # fmt: skip
    add_nats_url(p)
    add_prefix(p)
    p.add_argument("--wait", type=positive_seconds, default=0.5, metavar="S", help="seconds to collect answers (default 0.5)")
    add_json(p, "one report per line")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import msgspec

    from jetbatch.sdk.connection import connect_nats
    from jetbatch.sdk.protocol import Subjects
    from jetbatch.sidecar.status import cluster_view, collect_status

    subjects = Subjects(args.prefix)
    nc = await connect_nats(args.nats_url)
    try:
        reports = await collect_status(nc, subjects, wait_s=args.wait)
        cluster = None if args.json else await cluster_view(nc, subjects)
    finally:
        await nc.close()
    if args.json:
        for r in reports:
            print(msgspec.json.encode(r).decode())
        return EXIT_OK if reports else EXIT_FAILED
    if not reports:
        print("no jetbatch sidecar answered")
        return EXIT_FAILED
    print(f"{'role':<11}{'id':<28}{'resident':<18}{'warm':<18}{'loads':>6}{'batches':>9}{'requests':>10}")
    for r in reports:
        print(
            f"{shown(r.role)[:10]:<11}{shown(r.id)[:27]:<28}{shown(', '.join(r.resident) or '-')[:17]:<18}"
            f"{shown(', '.join(r.warm) or '-')[:17]:<18}"
            f"{shown(r.stats.get('loads', 0))[:6]:>6}{shown(r.stats.get('batches', 0))[:9]:>9}{shown(r.stats.get('requests', 0))[:10]:>10}"
        )
        for model, why in r.broken.items():
            print(f"  {shown(model)}: cannot load: {shown(why)}")
    if cluster is not None:
        holders, backlog = cluster
        print(f"\n{'model':<24}{'backlog':>8}  held by")
        for model in sorted(set(holders) | set(backlog)):
            print(f"{shown(model):<24}{shown(backlog.get(model, 0)):>8}  {shown(', '.join(sorted(holders.get(model, []))) or '-')}")
    return EXIT_OK
