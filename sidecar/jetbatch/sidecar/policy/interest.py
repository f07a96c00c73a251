"""Whether a worker listens to the arrival events of a line of the model it drains. Pure.

The models stream republishes every stored request's headers to its model's arrival subject,
and every worker that listens receives them: one message per request, on top of the request
itself and its answer's PubAck, a third of what a worker received per request. A worker that
serves a model's batches needs none of them for the line its batches fill from:

- **The interactive line of the model it serves** is not listened to while the worker serves
  that model's batches (``filled``): from a batch of at least ``SERVING_FROM`` requests (more are
  coming; a lone request's batch changes nothing; right after a hold came back empty, a batch of
  ``SERVING_AGAIN_FROM``) until a decision that is not another batch of it. A batch takes what
  is stored in one fetch, and its window fills from a pull request held open on the line to the
  close (``Puller.fill``), which the server answers with each request as it is stored. The
  worker's count of that line is then a lower bound (what its last fetch said was left); before
  it acts on any decision other than another batch of that model (an idle, a load, another
  model's batch), it listens again, counts the line by its consumer, and decides again on that
  count (``core/turns.py``: the core asks a ``Recount``; ``sidecar/worker/lines.py`` carries it out).
- **The batch line of the model it drains** is not listened to while at least
  ``QUIET_FROM_BATCHES`` batches wait there, and listened to again once fewer than
  ``LISTEN_BELOW_BATCHES`` batches do (or the worker serves another model, or the model leaves
  the device): each fetch of a deep line says what its consumer still holds (``num_pending``).
  The gap between the two keeps a line that hovers around one threshold from costing a
  subscription change per batch.

**A hold instead of an idle.** A worker whose next decision is to idle while it serves a model's
batches (nothing counted waiting anywhere) first holds that model's next batch open for up to
``HOLD_S``, on a pull held on its interactive line (:func:`hold_s`): the first request stored
there opens the next batch's window with no arrival event, and no decision in between. The
hold's pull request asks for the whole batch and stays open for the hold, so the window it opens
fills from it without a request of its own while it lasts (``Puller.fetch(hold_open_s=)``). The
first arrival event the worker hears during a hold (another model's request, or one on the
served model's batch line) ends it at once, as one counted since the decision does; so does
its end with nothing come. Then the worker listens again, counts the served line, and decides
(an event, a count and a decision: what the request would have waited without the hold). At 64
requests in flight the callers' next requests come within a few milliseconds of a batch's
answers, and through the classifier its batches come about 5 ms apart: holds of 2 ms missed
often enough for 0.2 arrival events a request to remain, 5 ms left 0.01-0.06 direct and 0.06-0.3
through the classifier; 20 ms, which no other model waits out, leave next to none
(docs/benchmarks.md). A hold that ends empty costs its pull request's end (a 408).

While it does not listen, the worker's count of a line is a lower bound: what its last fetch or
count said, less what peers took since; requests stored since are counted by the next fetch.
Its own fetches never take a deep line to zero unseen: a fetch takes at most one batch, so the
count falls below ``LISTEN_BELOW_BATCHES`` batches, and the worker listens again, while requests
still wait. Peers' takes can (they drained the queue meanwhile), and requests stored since the
last fetch are in no count: so whenever the worker listens again it counts that line at once,
after subscribing: the larger of its consumer's undelivered count and the stream's count of it
less what is delivered unacked, plus what its own puller holds (``QueueView.line_counted``). The
simulator applies the same rules to what its worker sees (``sidecar/simulator/engine.py``).
"""

from __future__ import annotations

from .types import SchedulerState

__all__ = [
    "HOLD_S",
    "LISTEN_BELOW_BATCHES",
    "MIN_HOLD_S",
    "QUIET_FROM_BATCHES",
    "SERVING_AGAIN_FROM",
    "SERVING_FROM",
    "hold_s",
    "listens",
    "serves_on",
]

# A batch of at least this many requests has the worker serve its model from held pulls...
SERVING_FROM = 2
# ...and right after a hold came back empty, a batch of this many (or a full one): requests in
# twos with pauses just past the hold paid a hold, a count and a subscription change a pair
# (an attack measured 1.2-2.1 ms of worker CPU a request against 0.85-1.5 ms with the events).
SERVING_AGAIN_FROM = 8

# How long a worker about to idle holds the next batch of the model it serves open (hold_s; the
# first arrival event it hears meanwhile ends it sooner)...
HOLD_S = 0.02
# ...and the shortest hold worth its pull request (a shorter one idles at once).
MIN_HOLD_S = 0.001

# Stop listening to a line of the drained model from this many batches waiting on it...
QUIET_FROM_BATCHES = 3
# ...and listen again below this many.
LISTEN_BELOW_BATCHES = 2


def listens(*, listening: bool, draining: bool, waiting: int, max_batch_size: int, filled: bool = False) -> bool:
    """Whether a worker should listen to the arrivals of a line of a model: always, unless it is
    ``draining`` that model (resident here and the one it serves) and either its batches fill
    from that line by a held pull (``filled``: the interactive line of the model whose batches
    it serves now) or the ``waiting`` count of that line is deep enough (``listening``: whether
    it listens now)."""
    if not draining:
        return True
    if filled:
        return False
    batches = QUIET_FROM_BATCHES if listening else LISTEN_BELOW_BATCHES
    return waiting < batches * max(1, max_batch_size)


def serves_on(batch_size: int, max_batch_size: int, *, missed: bool = False) -> bool:
    """Whether a batch of ``batch_size`` requests has the worker serve its model's next batches
    from held pulls, not listening to its interactive line (until a decision away from it).
    ``missed``: the worker's last hold came back empty; then it takes a batch of
    ``SERVING_AGAIN_FROM`` (or a full one) to say that more are coming."""
    if missed:
        return batch_size >= max(SERVING_FROM, min(SERVING_AGAIN_FROM, max_batch_size))
    return batch_size >= SERVING_FROM


def hold_s(state: SchedulerState, serving: str | None, *, until: float, now: float) -> float:
    """How long a worker that decided to idle (until ``until``) first holds the next batch of the
    model whose batches it serves (``serving``) open, on a pull held on that model's interactive
    line (0: it idles at once, as for a hold shorter than ``MIN_HOLD_S``). Only while that model
    is on the device and nothing else is counted waiting; the first arrival event the worker
    hears ends it sooner. A hold that comes back empty (or cut short) ends the serving: the
    worker listens again, counts the line, and decides."""
    if serving is None:
        return 0.0
    served = state.models.get(serving)
    if served is None or not served.resident:
        return 0.0
    if any(m.backlog > 0 for name, m in state.models.items() if name != serving):
        return 0.0
    held = min(until - now, HOLD_S)
    return held if held >= MIN_HOLD_S else 0.0
