"""What a run reads off its processes: CPU and memory from ``/proc``, and the workers' own
counters from their status reports (``jetbatch status``)."""

from __future__ import annotations

import os
from typing import Any

from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.status import collect_status

__all__ = ["cpu_s", "cpu_split", "rss_kib", "worker_stats"]


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    return sum(cpu_split(pid))


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of process ``pid`` now, in KiB (``field="VmHWM"``: its peak so far; 0 when
    ``/proc`` does not say)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


async def worker_stats(nats: str | Any, prefix: str, wait_s: float = 1.0) -> dict[str, int]:
    """The counters of every worker under ``prefix`` (their status reports, summed); ``nats``: a
    URL, or a connection already open (the producer's: no new connection in a timed part)."""
    nc = await connect_nats(nats) if isinstance(nats, str) else nats
    try:
        reports = await collect_status(nc, Subjects(prefix), wait_s=wait_s)
    finally:
        if isinstance(nats, str):
            await nc.close()
    total: dict[str, int] = {}
    for report in reports:
        if report.role == "worker":
            for key, value in report.stats.items():
                total[key] = total.get(key, 0) + value
    return total
