"""What the models stream's layout costs as the registered models grow, on one server.

For each ``--models`` count, two layouts side by side, each on a fresh embedded nats-server:

- ``listed``: the layout before the wildcards, one stream whose subjects name each model's two
  lines (on a server with a 64 MiB ``max_payload``, or the create would not fit);
- ``wildcards``: today's (``streams.ensure_streams``), two wildcard subjects and a key a model in
  the model registry, on a server with the default configuration (1 MiB ``max_payload``); timed
  at a first start (every name written) and at a second (the names are read back, none written).

Each reports the wall time, the server's CPU seconds during it, the largest request it sent
against a default server's 1 MiB ``max_payload``, and the server's resident memory after it.
``--name-chars`` pads the model names to that length (a 40-character name is a realistic
``team-model-version``).

    python -m bench.scale.models_stream --models 1000,5000,10000
    python -m bench.scale.models_stream --models 10000,100000 --name-chars 40 --layouts wildcards
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

from nats.js.api import StreamConfig

from jetbatch.sdk.protocol import Priority, Subjects
from jetbatch.sidecar.config import StreamsConfig
from jetbatch.sidecar.streams import ensure_streams, models_stream_config

from bench import harness
from bench.harness import cpu_s, rss_kib

DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default, which compose.yaml keeps


def names(count: int, chars: int) -> list[str]:
    """``count`` distinct model names of at least ``chars`` characters."""
    return [f"model-{i:06d}".ljust(chars, "x") for i in range(count)]


def listed_config(subjects: Subjects, models: list[str]) -> StreamConfig:
    """The models stream as releases before the wildcards made it: every model's lines by name."""
    config = models_stream_config(subjects, StreamsConfig())
    config.subjects = sorted(subjects.model(m, p) for m in models for p in Priority)
    return config


async def create(url: str, pid: int, models: list[str], layout: str) -> dict[str, Any]:
    subjects = Subjects("jetbatch")
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=600)
        if layout == "listed":
            config = listed_config(subjects, models)
            cpu0, started = cpu_s(pid), time.monotonic()
            await js.add_stream(config)
            timed = {"create_s": round(time.monotonic() - started, 3), "server_cpu_s": round(cpu_s(pid) - cpu0, 3)}
        else:
            config = models_stream_config(subjects, StreamsConfig())
            cpu0, started = cpu_s(pid), time.monotonic()
            await ensure_streams(js, subjects, StreamsConfig(), models)
            timed = {"create_s": round(time.monotonic() - started, 3), "server_cpu_s": round(cpu_s(pid) - cpu0, 3)}
            cpu0, started = cpu_s(pid), time.monotonic()
            await ensure_streams(js, subjects, StreamsConfig(), models)  # a restart: the names are there
            timed |= {"again_s": round(time.monotonic() - started, 3), "again_server_cpu_s": round(cpu_s(pid) - cpu0, 3)}
        request = len(json.dumps(config.as_dict()).encode())
        return {
            **timed,
            "request_bytes": request,
            "fits_default_max_payload": request <= DEFAULT_MAX_PAYLOAD,
            "server_rss_mib": round(rss_kib(pid) / 1024, 1),
        }
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1000,5000,10000", help="comma-separated model counts, each on a fresh server")
    parser.add_argument("--name-chars", type=int, default=12, help="each model name padded to this many characters")
    parser.add_argument("--layouts", default="listed,wildcards", help="comma-separated: listed (before the wildcards), wildcards")
    parser.add_argument("--json", default=None, help="append each count's record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    for count in (int(n) for n in args.models.split(",")):
        for layout in args.layouts.split(","):
            max_payload = 64 * 1024 * 1024 if layout == "listed" else None  # None: the server's default
            with tempfile.TemporaryDirectory() as tmp, harness.server(store_dir=Path(tmp) / "store", max_payload=max_payload) as server:
                assert server.pid is not None
                record = asyncio.run(create(server.url, server.pid, names(count, args.name_chars), layout))
            harness.emit({"bench": "models_stream", "layout": layout, "models": count, "name_chars": args.name_chars, **record}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
