"""A hostile client at full speed, and what the others see meanwhile: :func:`start_flooder`, a
raw client publishing one subject as fast as its socket takes it (a process of its own, so the
scenario's event loop measures, never floods); :func:`open_loop`, calls at a fixed rate with
their latencies and errors (the victim's view, side by side with and without the flood)."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from jetbatch import sdk
from jetbatch.sidecar.percentiles import percentile

__all__ = ["open_loop", "slow_consumer_cuts", "start_flooder"]

# Chunks of 10 000 messages until its time is up; prints the count. ``{i}`` in the payload or a
# header value is the message's number in its chunk (ids, sequences: each message differs).
_FLOODER = r"""
import socket, sys, time
host, port, subject, seconds, data, headers = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5], sys.argv[6:]
s = socket.create_connection((host, port))
s.makefile("rb").readline()
s.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n')
def one(i):
    body = data.replace("{i}", str(i)).encode()
    if not headers:
        return b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(body), body)
    head = ("NATS/1.0\r\n" + "".join(h.replace("{i}", str(i)) + "\r\n" for h in headers) + "\r\n").encode()
    return b"HPUB %s %d %d\r\n%s%s\r\n" % (subject.encode(), len(head), len(head) + len(body), head, body)
chunk = b"".join(one(i) for i in range(10_000))
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(chunk)
    sent += 10_000
print(sent)
"""


async def start_flooder(
    url: str, subject: str, seconds: float, *, data: str = "n{i}", headers: Mapping[str, str] | None = None
) -> asyncio.subprocess.Process:
    """A process publishing ``data`` (``{i}``: the message's number) with ``headers`` to
    ``subject`` for ``seconds``; ``communicate()`` gives the count it sent on stdout."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    lines = [f"{k}: {v}" for k, v in (headers or {}).items()]
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FLOODER, host, port, subject, str(seconds), data, *lines, stdout=asyncio.subprocess.PIPE
    )


async def open_loop(call: Callable[[], Awaitable[Any]], rate: float, seconds: float) -> dict[str, Any]:
    """``call`` ``rate`` times a second for ``seconds`` (open loop): answered, errors by type,
    p50, p99 and max in ms (nearest rank)."""
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def one() -> None:
        started = time.perf_counter()
        try:
            await call()
            latencies.append(time.perf_counter() - started)
        except sdk.JetbatchError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    tasks = []
    started = time.monotonic()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    latencies.sort()

    def ms(q: float) -> float | None:
        return round(1000 * percentile(latencies, q / 100), 1) if latencies else None

    return {"answered": len(latencies), "errors": errors, "p50_ms": ms(50), "p99_ms": ms(99), "max_ms": ms(100)}


def slow_consumer_cuts(log: list[str]) -> dict[str, int]:
    """Slow-consumer lines of the server's log, by the client's connection name."""
    cuts: dict[str, int] = {}
    for line in log:
        if "Slow Consumer" in line:
            name = re.search(r'"[^"]*:([^":]+)"', line)
            key = name.group(1) if name else "?"
            cuts[key] = cuts.get(key, 0) + 1
    return cuts
