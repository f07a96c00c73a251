"""Routers and networks used by tests/test_classifier.py (importable as module:attribute)."""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch

BATCH_SIZES: list[int] = []


class CountingNet(torch.nn.Module):
    """Two classes: class 1 when the first feature is positive. Records every forward batch size."""

    def __init__(self, cfg: Any = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        BATCH_SIZES.append(int(x.shape[0]))
        positive = (x[:, 0] > 0).float() * 10.0
        return torch.stack([10.0 - positive, positive - 0.0], dim=1)


def by_payload_key(payloads: Sequence[Any], headers: Sequence[Mapping[str, str]]) -> list[str | None]:
    """Route {"kind": "a"} to model m1, {"kind": "b"} to m2; anything else to nothing."""
    table = {"a": "m1", "b": "m2"}
    return [table.get(p.get("kind")) if isinstance(p, dict) else None for p in payloads]


def slow_to_m1(payloads: Sequence[Any], headers: Sequence[Mapping[str, str]]) -> list[str]:
    time.sleep(0.005)  # simulated router compute, so two replicas both get work
    return ["m1"] * len(payloads)


class PairNet(torch.nn.Module):
    """Two classes from inputs of exactly two features (a linear layer: other widths raise).
    ``fail`` makes every forward pass raise, as a broken router would."""

    fail = False

    def __init__(self, cfg: Any = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[-10.0, 0.0], [10.0, 0.0]]))
            self.linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if PairNet.fail:
            raise RuntimeError("the router network is broken")
        if bool((x.abs() > 1000).any()):  # a value-dependent failure, as an embedding's out-of-range id
            raise IndexError("index out of range in self")
        return self.linear(x)


class SingleNet(PairNet):
    """PairNet that takes one input at a time (exported or written for a batch of one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1:
            raise RuntimeError(f"expected a batch of 1, got {x.shape[0]}")
        return super().forward(x)


class InfNet(torch.nn.Module):
    """Infinite logits for every input: softmax scores are NaN."""

    def __init__(self, cfg: Any = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], 2), float("inf"))
