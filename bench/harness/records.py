"""One output format for the benchmarks: one JSON object per run, printed and, with ``--json``,
appended to a file (one object per line), so runs collect side by side."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["emit"]


def emit(record: dict[str, Any], path: str | None) -> None:
    """Print ``record`` as one JSON line, and append it to ``path`` when given."""
    line = json.dumps(record, default=float)  # numpy scalars and the like print as numbers
    print(line)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
