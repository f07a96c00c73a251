"""Handlers that misbehave on purpose, for tests/test_faults.py."""

from __future__ import annotations

import os
from typing import Any

from sidecar.handlers import SleepHandler


class CrashOnPayload(SleepHandler):
    """Kills its own process (as a segfaulting extension would) when a batch holds b"crash"."""

    def predict(self, inputs: list[Any]) -> list[Any]:
        if any(x == b"crash" for x in inputs):
            os._exit(1)
        return super().predict(inputs)
