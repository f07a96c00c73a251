"""The nats-servers a benchmark runs against: one embedded server, or a 3-node cluster, each on
free ports with a temporary store, stopped on exit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jetbatch.sidecar.dev.natsserver import EmbeddedNats, NatsCluster

__all__ = ["cluster", "server"]


@contextlib.contextmanager
def server(**kwargs: Any) -> Iterator[EmbeddedNats]:
    """One embedded nats-server with JetStream (a free port, a temporary store unless
    ``store_dir``); the object yielded can be killed and restarted (``kill``, ``restart``)."""
    with EmbeddedNats(**kwargs) as s:
        yield s


@contextlib.contextmanager
def cluster(size: int = 3, **kwargs: Any) -> Iterator[NatsCluster]:
    """A JetStream cluster of ``size`` nodes (``.url`` lists every node, ``.nodes`` each server)."""
    with NatsCluster(size, **kwargs) as c:
        yield c
