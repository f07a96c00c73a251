"""The cluster share: which part of a shared queue is this worker's to chase. Pure."""

from __future__ import annotations

__all__ = ["effective_backlog"]


def effective_backlog(backlog: int, served_drain_rps: float, horizon_s: float, *, resident_here: bool) -> int:
    """Backlog left for this worker to justify a load: what the other replicas would not drain
    within ``horizon_s`` (our load time). A model resident here keeps its full backlog: we share
    its queue with the other replicas and serving it costs us no load."""
    if resident_here or served_drain_rps <= 0:
        return backlog
    return max(0, int(backlog - served_drain_rps * horizon_s))
