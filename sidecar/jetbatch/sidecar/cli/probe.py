"""``jetbatch probe``: ask a local sidecar's /readyz (or /healthz): for container health checks.

Standard library only and no torch import, so a probe every few seconds costs milliseconds.
"""

from __future__ import annotations

import argparse
import http.client
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ._common import EXIT_FAILED, EXIT_OK, CliError, port_number, positive_seconds


def register(sub: Any) -> None:
    p = sub.add_parser(
        "probe", help="check a local sidecar's /readyz (exit 0 when ready): for HEALTHCHECK",
        description="GET /readyz (or /healthz with --live) on the first port that answers; exit 0 when it says 200.",
    )  # fmt: skip
    p.add_argument("--port", type=port_number, action="append", metavar="PORT", help="port(s) to try, in order (default: 9464, then 9465)")
    p.add_argument("--host", default="127.0.0.1", help="host of the sidecar (default: 127.0.0.1)")
    p.add_argument("--live", action="store_true", help="ask /healthz (alive) instead of /readyz (ready to serve)")
    p.add_argument("--model", default=None, help="ask whether this one model can be served now (/readyz?model=M)")
    p.add_argument("--timeout", type=positive_seconds, default=2.0, metavar="S", help="seconds per port (default: 2)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path = "/healthz" if args.live else "/readyz"
    if args.model is not None:
        if args.live:
            raise CliError("--model asks /readyz: it does not go with --live")
        path += "?model=" + urllib.parse.quote(args.model, safe="")
    last = "no port answered"
    # Straight to the local sidecar: an HTTP_PROXY in the container's environment must not apply.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    host = args.host.strip()
    if not host or any(c in host for c in " /?#@\\") or not host.isprintable():
        raise CliError(f"--host {args.host!r}: expected a host name or address")
    for port in args.port or [9464, 9465]:
        url = f"http://{host}:{port}{path}"
        try:
            with opener.open(url, timeout=args.timeout) as r:
                print(f"{url}: {r.status} {r.read().decode(errors='replace').strip()}")
                return EXIT_OK
        except urllib.error.HTTPError as e:
            print(f"{url}: {e.code} {e.read().decode(errors='replace').strip()}")
            return EXIT_FAILED
        except (urllib.error.URLError, OSError) as e:
            last = f"{url}: {getattr(e, 'reason', e)}"
        except http.client.HTTPException as e:
            # Something that is not an HTTP server answered (the NATS port given by mistake).
            last = f"{url}: not an HTTP answer ({type(e).__name__}: {str(e)[:80]!r})"
    print(last)
    return EXIT_FAILED
