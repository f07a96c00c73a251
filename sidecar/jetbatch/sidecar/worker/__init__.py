"""The GPU worker sidecar, as parts a newcomer can find by name:

- :mod:`.loop`: the I/O loop around the pure policy core (:class:`Worker`).
- :mod:`.batching`: batch assembly (fetch until the batch window closes).
- :mod:`.execution`: running a batch: checks, compute, answers, settling.
- :mod:`.quarantine`: poison requests: evidence before a verdict.
- :mod:`.residency`: load, evict, prefetch; the cold / warm / resident tiers.
- :mod:`.queues`: what waits in each model's queue (arrival events, bulk reconciles).
- :mod:`.slots`: one served model's state; one request in a batch.
- :mod:`.state`: the loop's own state (current model, recent use, messages held unacked).
- :mod:`.coordination`: the peers: adverts, each queue's share, first takers, load claims.
- :mod:`.counters`: one Counters object: events, and what each control-plane step cost.
"""

from ..runtime import retry_startup
from .loop import Worker
from .slots import BatchReport

__all__ = ["BatchReport", "Worker", "retry_startup"]
