"""Models with structured inputs and outputs, built locally with fixed seeds (importable as
``module_class`` by the state_dict handler in tests)."""

from __future__ import annotations

import torch
from torch import nn


class DictOut(nn.Module):
    """16 floats in; a mapping out, as Hugging Face models return: logits and probabilities."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "probs": logits.softmax(-1)}


class TwoInputs(nn.Module):
    """Token ids and an attention mask in (a text model's inputs); a tuple out: the masked mean of
    the token embeddings (one vector a request) and every token's embedding."""

    def __init__(self, vocab: int = 50, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    passes = 0  # forward passes, all instances (a test counts what one batch cost)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        TwoInputs.passes += 1
        h = self.emb(input_ids)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1), h


class NotTensors(nn.Module):
    """An output no answer can carry: a list of strings."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> list[str]:
        return ["a"] * x.shape[0]


class VectorAndFeatures(nn.Module):
    """Two fixed-shape float inputs (16 and 8 wide) and an optional scale: one (batch, 3) output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, features: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        out = self.a(x) + self.b(features)
        return out if scale is None else out * scale


class FailsInTwoLines(nn.Module):
    """Fails on every input with a torch-like error whose useful part is past its first line."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Trying to run with exported input tree spec:\nthe useful part " + "x" * 5000)


def build(cls: type[nn.Module], seed: int = 0, **kwargs: int) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kwargs).eval()


def pooled_and_tokens(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The function handler's form of TwoInputs: a list of (ids, mask) in, one tuple per request out."""
    module = build(TwoInputs)
    out = []
    with torch.inference_mode():
        for ids, mask in batch:
            pooled, tokens = module(ids.unsqueeze(0), mask.unsqueeze(0))
            out.append((pooled[0], tokens[0]))
    return out
