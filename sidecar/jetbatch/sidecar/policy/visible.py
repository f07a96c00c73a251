"""Which models a decision looks at. Pure.

With a few dozen models every one is shown to the policy. Beyond, only the models that can
change a decision: those with requests waiting, those on the device (eviction candidates), the
current one, and those served recently whose decayed demand is still at least one request (it
counts in the cost-aware policy's cycle estimate; less does not). An idle model among a thousand changes no decision, and showing it would make each
decision cost O(registered models). The live worker and the simulator both ask this function,
so they show their policies the same models.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Mapping

__all__ = ["MIN_DEMAND", "RECENT_S", "SHOW_ALL_UP_TO", "visible_models"]

SHOW_ALL_UP_TO = 64
# Five demand half-lives of the default policy (30 s): older use weighs under 1/32.
RECENT_S = 150.0
MIN_DEMAND = 1.0  # what the cost-aware cycle estimate counts as a model in use


def visible_models(
    registered: Collection[str],
    now: float,
    *,
    waiting: Iterable[str],
    on_device: Iterable[str],
    current: str | None,
    last_used: Mapping[str, float],
    demand: Callable[[str, float], float] | None = None,
) -> Collection[str]:
    """The models to put in the policy's :class:`SchedulerState` (all of ``registered`` up to
    :data:`SHOW_ALL_UP_TO`, else the ones that can matter, sorted)."""
    if len(registered) <= SHOW_ALL_UP_TO:
        return registered
    names = set(waiting)
    names.update(on_device)
    recent = now - RECENT_S
    names.update(n for n, at in last_used.items() if at >= recent and (demand is None or demand(n, now) >= MIN_DEMAND))
    if current:
        names.add(current)
    return sorted(n for n in names if n in registered)
