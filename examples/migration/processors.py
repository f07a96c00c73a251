"""A dynamic-batcher processor, unchanged: ``jetbatch`` serves it with ``handler = "function"``.

In dynamic-batcher this module is what ``python -m dynamic_batcher examples.migration.processors.add_1``
runs; here the worker imports ``examples.migration.processors:add_1`` and calls it once per batch.
"""

from __future__ import annotations

from typing import Any


def add_1(bodies: list[Any]) -> list[Any]:
    """Add 1 to every number in ``nested.values`` of each request body (the package's e2e example)."""
    out = []
    for body in bodies:
        nested = dict(body.get("nested", {}))
        nested["values"] = [v + 1 for v in nested.get("values", [])]
        out.append({**body, "nested": nested})
    return out
