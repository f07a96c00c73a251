"""Structured inputs and outputs: what a request may carry (one tensor, a tuple of tensors, or a
mapping of named tensors), how a batch of them becomes one forward pass (stacked, or padded to
the batch's longest along the first dimension), and how the model's output (a tensor, a tuple or
a mapping of tensors, such as a Hugging Face ``ModelOutput``) is split back into one answer per
request with the same structure.

Padding: requests whose tensors differ only in their first dimension (token sequences of
different lengths) are padded to the batch's longest with ``pad_value``; a mask of which
positions are real is built under ``mask_name`` when the requests did not send one (a
request's own ``attention_mask`` is padded with zeros, which means the same). An output whose
second dimension is the padded length and that has a third (per-token outputs: batch, sequence,
features) is cut back to each request's length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


__all__ = ["Batch", "batch_inputs", "call", "describe", "split_output", "tensor_from_list"]


def tensor_from_list(value: list[Any]) -> torch.Tensor:
    """A JSON or msgpack list of numbers (nested, rectangular) as a float32 tensor; ValueError
    naming what is wrong when it is not one (ragged, strings, maps)."""
    try:
        return torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"not a rectangular list of numbers: {str(exc)[:100]}") from None


def describe(value: Any) -> str:
    """A value's structure in a few words, for errors."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, Mapping):
        return "a mapping of " + ", ".join(f"{k}: {describe(v)}" for k, v in list(value.items())[:8])
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of " + ", ".join(describe(v) for v in value[:8])
    return type(value).__name__


def _key(value: Any) -> Any:
    """What must agree between requests batched together: the structure's names (or arity)."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, Mapping):
        return ("mapping", tuple(value))
    if isinstance(value, tuple):
        return ("tuple", len(value))
    return None


@dataclass(frozen=True)
class Batch:
    """One forward pass's input and, when it was padded, each request's length."""

    value: Any
    lengths: list[int] | None


def batch_inputs(items: list[Any], *, dtype: torch.dtype | None, device: torch.device, pad: bool, pad_value: float, mask_name: str | None) -> Batch | None:
    """The requests as one batch, or None when they cannot share a forward pass (different
    structures, or shapes that padding cannot reconcile): the caller then runs them one by one.
    ``dtype`` applies to floating-point tensors only (integer ids stay integers)."""
    kinds = {_key(x) for x in items}
    if len(kinds) != 1 or None in kinds:
        return None
    first = items[0]
    if isinstance(first, torch.Tensor):
        stacked = _stack([x for x in items], dtype=dtype, device=device, pad=pad, pad_value=pad_value)
        return None if stacked is None else Batch(stacked[0], stacked[1])
    names = list(first) if isinstance(first, Mapping) else list(range(len(first)))
    fields: dict[Any, Any] = {}
    lengths: list[int] | None = None
    for name in names:
        value = (0.0 if name == mask_name else pad_value)  # a padded mask reads "not real"
        stacked = _stack([x[name] for x in items], dtype=dtype, device=device, pad=pad, pad_value=value)
        if stacked is None:
            return None
        fields[name] = stacked[0]
        if stacked[1] is not None:
            if lengths is not None and lengths != stacked[1]:
                return None  # fields padded to different lengths: not one sequence per request
            lengths = stacked[1]
    if isinstance(first, Mapping):
        if lengths is not None and mask_name and mask_name not in fields:
            longest = max(lengths)
            fields[mask_name] = torch.tensor([[1] * n + [0] * (longest - n) for n in lengths], dtype=torch.int64, device=device)
        return Batch(fields, lengths)
    return Batch(tuple(fields[i] for i in names), lengths)


def _stack(tensors: list[torch.Tensor], *, dtype: torch.dtype | None, device: torch.device, pad: bool, pad_value: float) -> tuple[torch.Tensor, list[int] | None] | None:
    if dtype is not None:
        tensors = [t.to(dtype) if t.is_floating_point() else t for t in tensors]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) == 1:
        return torch.stack(tensors).to(device), None
    if not pad or len({t.dim() for t in tensors}) != 1 or tensors[0].dim() == 0 or len({tuple(t.shape[1:]) for t in tensors}) != 1:
        return None
    lengths = [int(t.shape[0]) for t in tensors]
    longest = max(lengths)
    out = torch.full((len(tensors), longest, *tensors[0].shape[1:]), pad_value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out.to(device), lengths


def call(module: Any, batch: Any) -> Any:
    """The forward pass: a mapping as keyword arguments, a tuple as positional ones."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, tuple):
        return module(*batch)
    return module(batch)


def split_output(out: Any, n: int, lengths: list[int] | None = None) -> list[Any]:
    """One output per request from a batch's output: a tensor's rows, or the same tuple or
    mapping built from each field's rows (fields that are None are left out). Raises TypeError
    naming what cannot be split."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0 or out.shape[0] != n:
            raise TypeError(f"the model's output is {describe(out)}, not one row per request (batch of {n})")
        rows = list(out.detach().cpu().unbind(0))
        if lengths is not None and out.dim() >= 3 and out.shape[1] == max(lengths):
            # Per-position outputs (batch, sequence, features...): each request gets its own
            # positions back. A (batch, classes) output is never cut, whatever its width.
            rows = [r[:k] for r, k in zip(rows, lengths)]
        return rows
    if isinstance(out, Mapping):
        fields = {k: split_output(v, n, lengths) for k, v in out.items() if v is not None}
        if not fields:
            raise TypeError("the model's output is an empty mapping")
        return [{k: rows[i] for k, rows in fields.items()} for i in range(n)]
    if isinstance(out, (tuple, list)):
        if not all(v is None or isinstance(v, (torch.Tensor, Mapping, tuple, list)) for v in out):
            raise TypeError(f"the model's output is {describe(out)}: expected a tensor, a tuple or a mapping of tensors")
        parts = [split_output(v, n, lengths) for v in out if v is not None]
        if not parts:
            raise TypeError("the model's output is an empty tuple")
        return [tuple(rows[i] for rows in parts) for i in range(n)]
    raise TypeError(f"the model's output is {describe(out)}: expected a tensor, a tuple or a mapping of tensors")
