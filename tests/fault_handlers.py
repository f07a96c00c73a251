"""Handlers that misbehave on purpose, for tests/test_faults.py."""

from __future__ import annotations

import os
from typing import Any

from jetbatch.sidecar.handlers import SleepHandler


class CrashOnPayload(SleepHandler):
    """Kills its own process (as a segfaulting extension would) when a batch holds a payload that
    starts with b"crash"."""

    def predict(self, inputs: list[Any]) -> list[Any]:
        if any(isinstance(x, bytes) and x.startswith(b"crash") for x in inputs):
            os._exit(1)
        return super().predict(inputs)


def run_classifier_that_dies_after_its_first_republish(argv: list[str]) -> None:
    """``python -c`` entry: the classifier CLI, patched to die (like kill -9) right after a
    republish was confirmed and before its ingress message is acked."""
    import sys

    from jetbatch.sidecar import classifier, cli

    async def die(self: object, msg: object) -> None:
        os._exit(137)

    classifier.Classifier._settle_forwarded = die  # type: ignore[method-assign]
    sys.exit(cli.main(argv))


def double_all(batch: list[Any]) -> list[Any]:
    """A ``function`` handler, shaped like a dynamic-batcher processor: a list in, a list out."""
    return [[2 * v for v in item] for item in batch]
