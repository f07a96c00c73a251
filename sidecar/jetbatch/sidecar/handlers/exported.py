"""The ``export`` format: a ``torch.export`` program (``.pt2``, written by ``torch.export.save``),
batched on its dynamic first dimension, and its inputs read from the program itself.

An exported module is called exactly as it was traced: the same number of positional tensors,
and keyword tensors under the same names (``program.module()`` refuses a positional input passed
by name, and the reverse). :class:`ProgramSignature` knows that layout, so a request of several
tensors (a tuple, or a mapping by name) is checked against each input's dtype and per-request
shape, a batch of them is arranged into the program's own call, and the load-time example is one
zero tensor per input, not only the first.

Dimensions: the batch dimension is left out; a fixed dimension is an int; a dynamic one is named
by its symbol (one symbol shared by two inputs means equal lengths) and bounded by the program's
range constraints; a derived one (``2 * seq``) is ``None`` and is left to torch's own guards.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from .base import BadInput, Handler, HandlerError
from .modules import InputSpec, ModuleHandler
from .structure import call, describe

__all__ = ["ExportHandler", "ProgramInput", "ProgramSignature", "export_input_spec", "read_signature"]

_EXAMPLE_LENGTH = 8  # a dynamic dimension's length in the load-time example, when its range allows


@dataclass(frozen=True)
class ProgramInput:
    """One tensor the program takes: its name, per-request dims and dtype."""

    name: str
    dims: tuple[int | str | None, ...]
    dtype: torch.dtype
    keyword: bool

    @property
    def shape(self) -> list[int]:
        """The per-request shape, -1 for a dynamic dimension (as ``options.inputs`` writes it)."""
        return [d if isinstance(d, int) else -1 for d in self.dims]

    def describe(self) -> str:
        return f"{self.name}: {str(self.dtype).removeprefix('torch.')} {self.shape}"


@dataclass(frozen=True)
class ProgramSignature:
    """How an exported program is called, and what each of its inputs must look like."""

    inputs: tuple[ProgramInput, ...]
    ranges: Mapping[str, tuple[int, int | None]]  # a dynamic dimension's symbol -> (min, max or None)

    @property
    def positional(self) -> list[ProgramInput]:
        return [i for i in self.inputs if not i.keyword]

    @property
    def single(self) -> bool:
        """Whether the program takes exactly one tensor, positionally."""
        return len(self.inputs) == 1 and not self.inputs[0].keyword

    def describe(self) -> str:
        how = "by name" if any(i.keyword for i in self.inputs) else "as a tuple in this order, or by name"
        return f"the tensors ({', '.join(i.describe() for i in self.inputs)}) {how}"

    def check(self, model: str, value: Any) -> Any:
        """One request of several tensors, checked against the program (structure, dtype, each
        dimension) and with each tensor cast to its input's dtype when only the width differs
        (float64 for float32); raises :class:`BadInput` naming what is wrong."""
        names = [i.name for i in self.inputs]
        if isinstance(value, tuple) and not any(i.keyword for i in self.inputs) and len(value) == len(names):
            named = dict(zip(names, value))
        elif isinstance(value, Mapping) and set(value) == set(names):
            named = dict(value)
        else:
            raise BadInput(f"model {model} takes {self.describe()}, got {describe(value)}")
        lengths: dict[str, tuple[str, int]] = {}
        for spec in self.inputs:
            t = named[spec.name]
            if not isinstance(t, torch.Tensor):
                raise BadInput(f"model {model}: {spec.name} must be a tensor, got {describe(t)}")
            if t.dtype != spec.dtype:
                if t.is_floating_point() != spec.dtype.is_floating_point or t.dtype == torch.bool or spec.dtype == torch.bool:
                    raise BadInput(f"model {model}: tensor {spec.name} must be {str(spec.dtype).removeprefix('torch.')}, got {str(t.dtype).removeprefix('torch.')}")
                t = named[spec.name] = t.to(spec.dtype)
            if t.dim() != len(spec.dims):
                raise BadInput(f"model {model}: tensor {spec.name} must have {len(spec.dims)} dimensions ({spec.describe()}), got shape {list(t.shape)}")
            for axis, (want, got) in enumerate(zip(spec.dims, t.shape)):
                if isinstance(want, int) and want != got:
                    raise BadInput(f"model {model}: tensor {spec.name} must have shape {spec.shape}, got {list(t.shape)}")
                if isinstance(want, str):
                    low, high = self.ranges.get(want, (0, None))
                    if got < low or (high is not None and got > high):
                        bound = f"{low} to {high}" if high is not None else f"at least {low}"
                        raise BadInput(f"model {model}: tensor {spec.name}'s dimension {axis} must be {bound}, got {got}")
                    seen = lengths.setdefault(want, (f"{spec.name}'s dimension {axis}", int(got)))
                    if seen[1] != got:
                        raise BadInput(f"model {model}: tensor {spec.name}'s dimension {axis} ({got}) must equal {seen[0]} ({seen[1]})")
        if isinstance(value, tuple):
            return tuple(named[n] for n in names)
        return {n: named[n] for n in value}

    def example(self) -> Any:
        """Zeros for one request (a tensor, a tuple, or a mapping as the program is called), a
        dynamic dimension at a length its range allows; None when a dimension is derived."""
        tensors = {}
        for spec in self.inputs:
            shape = []
            for d in spec.dims:
                if d is None:
                    return None
                if isinstance(d, str):
                    low, high = self.ranges.get(d, (0, None))
                    d = max(low, _EXAMPLE_LENGTH) if high is None else min(max(low, _EXAMPLE_LENGTH), high)
                shape.append(d)
            tensors[spec.name] = torch.zeros(shape, dtype=spec.dtype)
        if self.single:
            return tensors[self.inputs[0].name]
        if any(i.keyword for i in self.inputs):
            return tensors
        return tuple(tensors.values())

    def call(self, module: Any, batch: Any) -> Any:
        """The forward pass with the batch arranged as the program was traced: the positional
        inputs in order, the keyword ones by name. A mapping's keys the program does not take
        (the padding's own ``attention_mask``) are left out."""
        if isinstance(batch, Mapping):
            missing = [i.name for i in self.inputs if i.name not in batch]
            if missing:
                raise TypeError(f"the program takes {self.describe()}; {', '.join(missing)} not given (given: {', '.join(map(str, batch))})")
            args = [batch[i.name] for i in self.positional]
            kwargs = {i.name: batch[i.name] for i in self.inputs if i.keyword}
            return module(*args, **kwargs)
        if isinstance(batch, tuple):
            return module(*batch)
        return module(batch)


def read_signature(program: Any, module: Any) -> ProgramSignature | None:
    """The signature of ``program`` (an ``ExportedProgram``) as ``module`` (its
    ``program.module()``) is called; None when an input is not a plain tensor (a nested
    structure, a number), and then requests are passed as they come."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    from torch.utils import _pytree

    try:
        args, kwargs = _pytree.tree_unflatten(list(range(len(placeholders))), program.call_spec.in_spec)
    except (ValueError, TypeError, RuntimeError):
        return None  # the placeholders are not the user's inputs one for one
    if not all(isinstance(i, int) for i in (*args, *kwargs.values())):
        return None
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()]
    except (TypeError, ValueError):
        params = []
    inputs = []
    for index, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            return None
        keyword = index >= len(args)
        if keyword:
            name = next(k for k, i in kwargs.items() if i == index)
        else:
            name = params[index] if index < len(params) else node.name
        inputs.append(ProgramInput(name, tuple(_dim(d) for d in val.shape[1:]), val.dtype, keyword))
    ranges = {}
    for symbol, bounds in program.range_constraints.items():
        ranges[str(symbol)] = (_bound(bounds.lower) or 0, _bound(bounds.upper))
    return ProgramSignature(tuple(inputs), ranges)


def _dim(d: Any) -> int | str | None:
    if isinstance(d, int):
        return d
    expr = d.node.expr
    return str(expr) if expr.is_Symbol else None


def _bound(value: Any) -> int | None:
    """A range's bound as an int; None for infinity (sympy's has no int value)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


class ExportHandler(ModuleHandler):
    """A ``torch.export`` program (``.pt2``) with a dynamic batch dimension."""

    format = "export"

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        self.signature: ProgramSignature | None = None  # read with the program

    def _read(self) -> Any:
        import zipfile

        # A .pt2 is a zip archive. torch.export.load logs a multi-line traceback to stderr before
        # it raises on anything else; say it in one line instead.
        if not zipfile.is_zipfile(self.path):
            raise HandlerError(
                f"model {self.name}: cannot load {Path(self.path).name}: not a torch.export archive (.pt2 is a zip file)",
                detail=f"model {self.name}: cannot load {self.path}: not a torch.export archive (.pt2 is a zip file)",
            )
        program = torch.export.load(self.path)
        module = program.module()
        self.signature = read_signature(program, module)
        return module

    def _several(self) -> bool:
        """Whether the program takes several tensors (or one by keyword) and its signature is known."""
        return self.signature is not None and not self.signature.single

    def _input_spec(self, module: Any) -> InputSpec | None:
        declared = super()._input_spec(module)
        if declared is not None or self._several():
            return declared  # several inputs: each is checked against the signature instead
        return export_input_spec(module)

    def _inputs_taken(self, module: Any) -> int | None:
        if isinstance(self.options.get("inputs"), Mapping):
            return None
        # An exported program's placeholders are its inputs (its forward's signature is generic).
        graph = getattr(module, "graph", None)
        if graph is None:
            return None
        return 1 if sum(1 for node in graph.nodes if node.op == "placeholder") == 1 else None

    def decode(self, data: bytes, content_type: str | None) -> Any:
        if not self._several():
            return super().decode(data, content_type)
        assert self.signature is not None
        value = Handler.decode(self, data, content_type)  # the wire decoding; the one-tensor checks do not apply
        if isinstance(self.options.get("inputs"), Mapping):
            value = self._check_structured(value)  # the declaration first, as for any module
        return self.signature.check(self.name, value)

    def _batch_dtype(self) -> torch.dtype | None:
        return None if self._several() else super()._batch_dtype()  # several: cast per input in decode

    def _forward(self, module: Any, batch: Any) -> Any:
        return self.signature.call(module, batch) if self.signature is not None else call(module, batch)

    def _example(self) -> Any:
        if isinstance(self.options.get("inputs"), Mapping) or self.signature is None:
            return super()._example()
        return self.signature.example()


def export_input_spec(module: Any) -> InputSpec | None:
    """The per-request input of an exported module: its first input without the batch dimension."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return None
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if val is None or not hasattr(val, "shape"):
            return None
        dims = list(val.shape)[1:]
        if not all(isinstance(d, int) for d in dims):
            return InputSpec(None, val.dtype)
        return InputSpec(tuple(int(d) for d in dims), val.dtype)
    return None
