"""What the models stream's layout costs as the registered models grow: its create, on one server.

The worker makes one models stream whose subjects list names each registered model's two lines
(``streams.models_stream_config``). For each ``--models`` count this makes that stream on a fresh
embedded nats-server and reports the create's wall time, the server's CPU seconds during it, the
size of the create request against a default server's 1 MiB ``max_payload``, and the server's
resident memory after it. ``--name-chars`` pads the model names to that length (a 40-character
name is a realistic ``team-model-version``).

    python -m bench.scale.models_stream --models 1000,5000,10000
    python -m bench.scale.models_stream --models 10000 --name-chars 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.config import StreamsConfig
from jetbatch.sidecar.streams import models_stream_config

from bench import harness
from bench.harness import cpu_s, rss_kib

DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default, which compose.yaml keeps


def names(count: int, chars: int) -> list[str]:
    """``count`` distinct model names of at least ``chars`` characters."""
    return [f"model-{i:06d}".ljust(chars, "x") for i in range(count)]


async def create(url: str, pid: int, models: list[str]) -> dict[str, Any]:
    config = models_stream_config(Subjects("jetbatch"), StreamsConfig(), models)
    request = json.dumps(config.as_dict()).encode()
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=600)
        cpu0, started = cpu_s(pid), time.monotonic()
        await js.add_stream(config)
        return {
            "create_s": round(time.monotonic() - started, 3),
            "server_cpu_s": round(cpu_s(pid) - cpu0, 3),
            "request_bytes": len(request),
            "fits_default_max_payload": len(request) <= DEFAULT_MAX_PAYLOAD,
            "server_rss_mib": round(rss_kib(pid) / 1024, 1),
        }
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1000,5000,10000", help="comma-separated model counts, each on a fresh server")
    parser.add_argument("--name-chars", type=int, default=12, help="each model name padded to this many characters")
    parser.add_argument("--json", default=None, help="append each count's record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    for count in (int(n) for n in args.models.split(",")):
        with tempfile.TemporaryDirectory() as tmp, harness.server(store_dir=Path(tmp) / "store", max_payload=64 * 1024 * 1024) as server:
            assert server.pid is not None
            record = asyncio.run(create(server.url, server.pid, names(count, args.name_chars)))
        harness.emit({"bench": "models_stream", "models": count, "name_chars": args.name_chars, **record}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
