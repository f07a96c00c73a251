"""Which models a decision looks at. Pure.

With a few dozen models every one is shown to the policy. Beyond, only the models that can
change a decision: those with requests waiting, on the device or in the warm tier, the current
one, and those served recently (their decayed demand still counts in the policy's cycle
estimate). An idle model among a thousand changes no decision, and showing it would make each
decision cost O(registered models). The live worker and the simulator both ask this function,
so they show their policies the same models.
"""

from __future__ import annotations

from typing import Collection, Iterable, Mapping

__all__ = ["SHOW_ALL_UP_TO", "RECENT_S", "visible_models"]

SHOW_ALL_UP_TO = 64
# Five demand half-lives of the default policy (30 s): older use weighs under 1/32.
RECENT_S = 150.0


def visible_models(
    registered: Collection[str],
    now: float,
    *,
    waiting: Iterable[str],
    on_device: Iterable[str],
    warm: Iterable[str],
    current: str | None,
    last_used: Mapping[str, float],
) -> Collection[str]:
    """The models to put in the policy's :class:`SchedulerState` (all of ``registered`` up to
    :data:`SHOW_ALL_UP_TO`, else the ones that can matter, sorted)."""
    if len(registered) <= SHOW_ALL_UP_TO:
        return registered
    names = set(waiting)
    names.update(on_device)
    names.update(warm)
    recent = now - RECENT_S
    names.update(n for n, at in last_used.items() if at >= recent)
    if current:
        names.add(current)
    return sorted(n for n in names if n in registered)
