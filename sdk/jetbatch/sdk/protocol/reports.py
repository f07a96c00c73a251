"""What a sidecar reports about itself."""

from __future__ import annotations

import msgspec

class SidecarReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a sidecar reports about itself, in one shape for every reader: the answer to a status
    request (``jetbatch status``, readiness checks), and a worker's advert in the cluster's
    key-value bucket (what its peers schedule around). JSON on the wire."""

    role: str  # "worker" or "classifier"
    id: str
    version: str = ""
    # Served models. A status answer names them all; an advert only when a peer may not know
    # them (a new peer, a changed set, every 30 s): the others carry the digest and count alone.
    models: list[str] = []
    models_digest: str = ""  # a digest of the served models' sorted names ("" from older workers)
    models_count: int = 0  # how many models it serves (0 from older workers: len(models))
    resident: list[str] = []  # on the device now
    warm: list[str] = []  # evicted but in host memory: a cheap reload
    loading: str | None = None  # being loaded now (counts as served for peers)
    broken: dict[str, str] = {}  # models that cannot load, and why
    backlog: dict[str, int] = {}  # requests waiting per model, as this sidecar sees them
    tenant_backlog: dict[str, int] = {}  # of those it knows one by one, per tenant ("" for none; the most waiting first, at most 64)
    in_flight: dict[str, int] = {}  # messages held unacked per model
    unfetchable: dict[str, int] = {}  # delivered-but-unacked messages found unfetchable
    drain_rps: dict[str, float] = {}  # requests/s it can drain per resident model
    load_cost_s: dict[str, float] = {}  # estimated cost to (re)load each model from its tier
    memory_bytes: int = 0  # device bytes of the resident models (measured)
    memory_budget_bytes: int | None = None
    max_resident_models: int | None = None  # the device's model slots (None: bounded by bytes only)
    host_memory_bytes: int = 0  # host bytes of the warm tier
    host_memory_budget_bytes: int | None = None
    stats: dict[str, int] = {}
    started_at: float = 0.0  # Unix seconds
    updated_at: float = 0.0  # Unix seconds, when this report was made
    valid_s: float = 0.0  # a report older than this is stale (0: no limit)
    http: str = ""  # host:port of its /healthz, /readyz and /metrics ("" when off)

