"""Whether a worker listens to the arrival events of a line of the model it drains. Pure.

The models stream republishes every stored request's headers to its model's arrival subject,
and every worker that listens receives them: one message per request, on top of the request
itself and its answer's PubAck, a third of what a worker received per request. A worker draining
a deep queue needs none of them: each fetch tells it what its consumer still holds
(``num_pending``), and it comes back for more anyway. So while a line (interactive, or batch) of
the model it serves has at least ``QUIET_FROM_BATCHES`` batches waiting, the worker stops
listening to that line's arrivals, and listens again once fewer than ``LISTEN_BELOW_BATCHES``
batches wait there (or it serves another model, or the model leaves the device). The gap between
the two keeps a line that hovers around one threshold from costing a subscription change per
batch.

While it does not listen, the worker's count of that line is a lower bound: what its last fetch
or count said, less what peers took since; requests stored since are counted by the next fetch.
Its own fetches never take it to zero unseen: a fetch takes at most one batch, so the count falls
below ``LISTEN_BELOW_BATCHES`` batches, and the worker listens again, while requests still wait.
Peers' takes can (they drained the queue meanwhile), and requests stored since the last fetch
are in no count: so whenever the worker listens again it counts that line at once, by its
consumer's undelivered count asked after subscribing (``sidecar/worker/loop.py``). The simulator applies
the same rule to what its worker sees (``sidecar/simulator/engine.py``).
"""

from __future__ import annotations

__all__ = ["LISTEN_BELOW_BATCHES", "QUIET_FROM_BATCHES", "listens"]

# Stop listening to a line of the drained model from this many batches waiting on it...
QUIET_FROM_BATCHES = 3
# ...and listen again below this many.
LISTEN_BELOW_BATCHES = 2


def listens(*, listening: bool, draining: bool, waiting: int, max_batch_size: int) -> bool:
    """Whether a worker should listen to the arrivals of a line of a model: always, unless it is
    ``draining`` that model (resident here and the one it serves) and the ``waiting`` count of
    that line is deep enough (``listening``: whether it listens now)."""
    if not draining:
        return True
    batches = QUIET_FROM_BATCHES if listening else LISTEN_BELOW_BATCHES
    return waiting < batches * max(1, max_batch_size)
