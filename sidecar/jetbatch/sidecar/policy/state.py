"""What a policy and the cost estimator have learnt, as plain JSON data and back. Pure.

A worker core's snapshot (``WorkerCore.export_state``, the second line of a ring's dump) is
built of these: dicts, lists, strings, numbers, booleans and null, nothing a reader could
mistake for code. A float is a JSON number (written in its shortest exact form, so it reads back
bit for bit), except a non-finite one, which JSON has no number for: it is the string ``"inf"``,
``"-inf"`` or ``"nan"``. Each ``import_state`` reads its part against a schema
(:func:`read_state`): a wrong type, a missing field or a field it does not know is a
``ValueError``, and nothing is changed.
"""

from __future__ import annotations

import math
from typing import Mapping, TypeVar

import msgspec

__all__ = ["CostsState", "PolicyState", "read_state", "real", "reals"]

T = TypeVar("T")


def real(x: float) -> float | str:
    """``x`` as JSON data: itself when finite, else ``"inf"``, ``"-inf"`` or ``"nan"``."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def reals(values: Mapping[str, float]) -> dict[str, float | str]:
    """A mapping of floats as JSON data (its order kept: it is the order of first use)."""
    return {k: real(v) for k, v in values.items()}


def read_state(data: object, schema: type[T], what: str) -> T:
    """``data`` (from JSON) as ``schema``; a float field also takes ``"inf"``, ``"-inf"`` and
    ``"nan"`` (msgspec's lax mode parses them). A ValueError names the field."""
    try:
        return msgspec.convert(data, schema, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not {what}'s state: {exc}") from None


class _State(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class PolicyState(_State):
    """Every policy's state (``PolicyBase``); the fields a policy does not keep stay empty.

    ``last_used``: when each model last served or loaded; ``demand``: each model's decayed count
    and when it was taken. Cost-aware only: ``burst_s``, device seconds since each model's load;
    ``gate``, requests still owed from a load's backlog; ``busy``/``busy_at``, decayed device
    seconds and when, ``excess`` of them for a tenant's excess; ``since``, its first event. Round-robin only: ``last``, the model served last."""

    name: str
    last_used: dict[str, float] = {}
    demand: dict[str, tuple[float, float]] = {}
    burst_s: dict[str, float] = {}
    gate: dict[str, int] = {}
    busy: float = 0.0
    excess: float = 0.0
    busy_at: float | None = None
    since: float | None = None
    last: str | None = None


class CostsState(_State):
    """The cost estimator's state: load seconds as ``[model, tier, seconds]`` in the order they
    were learnt, the ``[model, tier]`` loads measured (not only configured), each model's batch
    cost ``[fixed s, per-item s]``, device and host bytes, and its fastest batch."""

    load: list[tuple[str, str, float]] = []
    measured: list[tuple[str, str]] = []
    batch: dict[str, tuple[float, float]] = {}
    memory: dict[str, int] = {}
    host_memory: dict[str, int] = {}
    fastest: dict[str, float] = {}
