"""One percentile rule for every figure jetbatch prints (the demo, `jetbatch bench`, the
simulator's reports and the benchmarks), so two of them never disagree on the same data."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (``q`` in [0, 1]): the smallest value with at least a
    ``q`` share of the values at or below it. NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
