"""The worker's cost counters: for each control-plane step (a claim, an advert, a consumer
made, the answers of a batch, a fetch of requests already stored, an arrival's event), how often
it ran and the sum and sum of squares of its durations in µs. They travel in the worker's status
(``SidecarReport.stats``) as integers; ``simulator.Control.measured`` turns them into the mean
and spread the simulated worker pays, so the simulator of a deployment knows its round trips."""

from __future__ import annotations

from typing import ItemsView, MutableMapping

__all__ = ["STEPS", "Counters", "add_sample"]

# step -> what it times
STEPS = {
    "claim": "a placement change's key-value claims, before its load",
    "release": "giving a placement change's claims back, after its load (beside its first batch)",
    "advert": "one advert put in the workers' bucket",
    "consumer_create": "making a model's consumer (on demand, at its first load)",
    "answer": "storing and sending one batch's answers",
    "ready_fetch": "a fetch of requests stored before it began (its round trip)",
    "arrival_delay": "from a request's store to its arrival event at the worker",
    "compute_excess": "a forward pass's time beyond its model's configured batch cost (the thread hop, the interpreter lock)",
}


def add_sample(stats: MutableMapping[str, int], step: str, seconds: float) -> None:
    """Count one ``step`` that took ``seconds``."""
    us = max(0, int(seconds * 1e6))
    n, total, squares = _KEYS.get(step) or _keys(step)  # once an arrival: names built once
    stats[n] = stats.get(n, 0) + 1
    stats[total] = stats.get(total, 0) + us
    stats[squares] = stats.get(squares, 0) + us * us


def _keys(step: str) -> tuple[str, str, str]:
    return (f"{step}_n", f"{step}_us", f"{step}_us2")


_KEYS = {step: _keys(step) for step in STEPS}


class Counters:
    """The worker's counters, one object its parts are handed explicitly (the loop, the batcher,
    the runner, residency, the arrival feed): events counted with :meth:`add`, control-plane
    steps timed with :meth:`sample`; :meth:`snapshot` is what the status reports."""

    def __init__(self, *names: str) -> None:
        self._values: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        self._values[name] = self._values.get(name, 0) + n

    def sample(self, step: str, seconds: float) -> None:
        """Count one ``step`` (one of :data:`STEPS`) that took ``seconds``."""
        add_sample(self._values, step, seconds)

    def __getitem__(self, name: str) -> int:
        return self._values.get(name, 0)

    def items(self) -> ItemsView[str, int]:
        return self._values.items()

    def snapshot(self) -> dict[str, int]:
        return dict(self._values)
