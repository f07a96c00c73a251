"""Handlers for real PyTorch models on disk, in the formats teams ship:

- ``export``: a ``torch.export`` program (``.pt2``), in :mod:`.exported`: its inputs are read
  from the program, so a request of the wrong shape gets ``bad_request`` naming the expected one.
- ``state_dict``: weights in a safetensors or ``torch.save`` state-dict file plus a
  ``package.module:Class`` (``module_class``, constructor kwargs in ``module_kwargs``). The module is
  built on the meta device and the weights assigned, so a load allocates the weights once.
- ``torchscript``: a scripted module (``torch.jit.save``), for legacy model stores; quiet about its
  upstream deprecation.

All three share the tiering in :class:`ModuleHandler`: the warm copy is the module on the host
(its tensors pinned when the device is CUDA); a load moves each parameter and buffer to the device
and keeps the host tensors, so offloading back to warm is a pointer swap, not a copy.
"""

from __future__ import annotations

import os
import threading
import warnings
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch

from jetbatch.sdk.protocol import ContentType

from ..config import ModelConfig
from .base import BadInput, Handler, HandlerError, import_object, tensor_bytes
from .structure import batch_inputs, call, describe, split_output, tensor_from_list

__all__ = ["InputSpec", "ModuleHandler", "StateDictHandler", "TorchScriptHandler", "warm_start"]


@dataclass(frozen=True)
class InputSpec:
    """What one request's tensor must look like (the batch dimension excluded)."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype

    def describe(self) -> str:
        shape = "any shape" if self.shape is None else f"shape {list(self.shape)}"
        return f"a {str(self.dtype).removeprefix('torch.')} tensor of {shape}"


class ModuleHandler(Handler):
    """A ``torch.nn.Module`` read from ``config.path``, tiered cold / warm / resident."""

    format = "module"

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        if not config.path:
            raise HandlerError(f"model {name}: the {self.format} handler needs `path`", key="path")
        self.path = config.path
        self._lock = threading.Lock()
        self._host: Any = None  # the module object; its tensors live on the host unless resident
        self._host_tensors: dict[int, torch.Tensor] = {}  # id(param or buffer) -> host tensor
        self._resident = False
        self._device_bytes = 0
        self.input_spec: InputSpec | None = None
        # 1 when the module is known to take exactly one tensor (None: unknown, or several).
        self.inputs_taken: int | None = None
        self._warmed = False  # the example input ran once (warm_up), on the first load

    # --- tiers --------------------------------------------------------------------------------

    def check(self) -> None:
        p = Path(self.path)
        if not p.is_file():
            raise HandlerError(f"model {self.name}: file {p.name} not found", detail=f"model {self.name}: file {self.path} not found")
        if not os.access(p, os.R_OK):
            raise HandlerError(f"model {self.name}: file {p.name} is not readable", detail=f"model {self.name}: file {self.path} is not readable")

    @abstractmethod
    def _read(self) -> Any:
        """Read the module from disk onto the CPU, ready for inference."""

    def read_weights(self) -> None:
        with self._lock:
            self._read_locked()

    def _read_locked(self) -> None:
        if self._host is not None:
            return
        try:
            module = self._read()
        except HandlerError:
            raise
        except Exception as exc:  # torch raises many kinds here: name the file, keep one line
            why = _first_line(exc).replace(self.path, Path(self.path).name)
            raise HandlerError(
                f"model {self.name}: cannot load {Path(self.path).name}: {why}", detail=f"model {self.name}: cannot load {self.path}: {_first_line(exc)}"
            ) from exc
        pin = self.target_device.type == "cuda" and torch.cuda.is_available()
        for t in _tensors(module):
            if pin and not t.data.is_pinned():
                t.data = t.data.pin_memory()
            self._host_tensors[id(t)] = t.data
        self._host = module
        if self.input_spec is None:
            self.input_spec = self._input_spec(module)
            self.inputs_taken = self._inputs_taken(module)

    @property
    def warm(self) -> bool:
        return self._host is not None

    @property
    def module(self) -> Any:
        """The module read (on the device when resident, else on the host); None before a read."""
        return self._host

    def load(self, device: torch.device) -> None:
        with self._lock:
            self._read_locked()
            if self._resident:
                return
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                for t in _tensors(self._host):
                    t.data = t.data.to(device, non_blocking=True)
                torch.cuda.synchronize(device)
                self._device_bytes = max(0, torch.cuda.memory_allocated(device) - before)
            else:
                # The host is the device: resident and warm are the same tensors.
                self._device_bytes = tensor_bytes(self._host)
            self.device = device
            self._resident = True
            if not self._warmed:
                try:
                    self.warm_up()
                except HandlerError:
                    self._resident = False  # refused: not served, and the next load tries again
                    raise
                self._warmed = True

    def offload(self) -> None:
        with self._lock:
            if not self._resident:
                return
            for t in _tensors(self._host):
                host = self._host_tensors.get(id(t))
                if host is not None:
                    t.data = host  # the device tensor is freed when its last reference goes
            self._resident = False
            self._device_bytes = 0
            self.device = torch.device("cpu")
        _release_cuda_cache(self.target_device)

    def unload(self) -> None:
        with self._lock:
            self._host = None
            self._host_tensors = {}
            self._resident = False
            self._device_bytes = 0
            self.device = torch.device("cpu")
        _release_cuda_cache(self.target_device)

    def drop_host_copy(self) -> None:
        with self._lock:
            if self._resident:
                return  # a resident model keeps its host tensors: offloading must stay a swap
            self._host = None
            self._host_tensors = {}

    def memory_bytes(self) -> int:
        if self._resident:
            return self._device_bytes
        return self.config.memory_bytes or 0

    def host_bytes(self) -> int:
        if self._host is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._host_tensors.values())

    # --- requests -----------------------------------------------------------------------------

    def _input_spec(self, module: Any) -> InputSpec | None:
        shape = self.options.get("input_shape")
        if shape is None:
            return None
        return InputSpec(tuple(int(d) for d in shape), getattr(torch, str(self.options.get("input_dtype", "float32"))))

    def decode(self, data: bytes, content_type: str | None) -> Any:
        value = super().decode(data, content_type)
        if isinstance(value, (tuple, Mapping)) and value and all(isinstance(v, torch.Tensor) for v in (value.values() if isinstance(value, Mapping) else value)):
            return self._check_structured(value)
        if isinstance(value, list):
            try:
                value = tensor_from_list(value)
            except ValueError:
                raise BadInput(f"model {self.name} expects a tensor or a list of numbers") from None
        spec = self.input_spec
        if not isinstance(value, torch.Tensor):
            expected = spec.describe() if spec else "a tensor"
            raise BadInput(f"model {self.name} expects {expected} ({ContentType.TENSOR.value}), got {type(value).__name__}")
        if spec is not None:
            if spec.shape is not None and tuple(value.shape) != spec.shape:
                raise BadInput(f"model {self.name} expects {spec.describe()}, got shape {list(value.shape)}")
            if spec.dtype.is_floating_point and not value.is_floating_point():
                raise BadInput(f"model {self.name} expects {spec.describe()}, got {str(value.dtype).removeprefix('torch.')}")
        elif not value.is_floating_point():
            raise BadInput(f"model {self.name} expects a floating-point tensor, got {str(value.dtype).removeprefix('torch.')}")
        return value

    def _inputs_taken(self, module: Any) -> int | None:
        """1 when the module takes exactly one tensor (its ``forward`` has one parameter and
        nothing variadic); None when unknown, or it may take more (a ``forward(x, mask=None)``
        takes a tuple, whatever ``options.input_shape`` says of its first input)."""
        if isinstance(self.options.get("inputs"), Mapping):
            return None  # several, named: checked against the declaration
        import inspect

        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError, AttributeError):
            return None
        if len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            return 1
        return None

    def _check_structured(self, value: Any) -> Any:
        """Several tensors in one request (a tuple, or named): checked against the declared
        ``options.inputs`` when there is one (names, dtypes, shapes; -1 for any length); refused
        for a module known to take one tensor (the producer's mistake, not the model's failure)."""
        declared = self.options.get("inputs")
        if not isinstance(declared, Mapping):
            if self.inputs_taken == 1 and len(value) > 1:
                expected = self.input_spec.describe() if self.input_spec else "one tensor"
                raise BadInput(f"model {self.name} takes one tensor ({expected}), got {describe(value)}")
            return value
        if not isinstance(value, Mapping) or set(value) != set(declared):
            raise BadInput(f"model {self.name} expects the tensors {sorted(declared)}, got {describe(value)}")
        for name, spec in declared.items():
            t = value[name]
            shape = spec.get("shape") if isinstance(spec, Mapping) else None
            dtype = spec.get("dtype") if isinstance(spec, Mapping) else None
            if dtype is not None and str(t.dtype).removeprefix("torch.") != dtype:
                raise BadInput(f"model {self.name}: tensor {name} must be {dtype}, got {str(t.dtype).removeprefix('torch.')}")
            if shape is not None and (len(shape) != t.dim() or any(d not in (-1, s) for d, s in zip(shape, t.shape))):
                raise BadInput(f"model {self.name}: tensor {name} must have shape {list(shape)}, got {list(t.shape)}")
        return value

    def predict(self, inputs: list[Any]) -> list[Any]:
        module = self._host if self._resident else None
        if module is None:
            raise RuntimeError(f"model {self.name} is not loaded")
        dtype = self._batch_dtype()
        # Off unless asked (options.pad = true): padding changes what a model that is not a
        # sequence model computes; without it, different shapes run one pass each.
        pad = bool(self.options.get("pad", False))
        pad_value = float(self.options.get("pad_value", 0))
        mask = self.options.get("attention_mask", "attention_mask")
        with torch.inference_mode():
            batch = batch_inputs(inputs, dtype=dtype, device=self.device, pad=pad, pad_value=pad_value, mask_name=mask)
            if batch is None:
                # Structures or shapes that cannot share a pass: one forward pass each.
                outs = []
                for x in inputs:
                    one = batch_inputs([x], dtype=dtype, device=self.device, pad=False, pad_value=pad_value, mask_name=None)
                    assert one is not None
                    outs.extend(split_output(self._forward(module, one.value), 1))
                return outs
            return split_output(self._forward(module, batch.value), len(inputs), batch.lengths)

    def _batch_dtype(self) -> torch.dtype | None:
        """The dtype floating-point inputs are cast to when batched (None: as decoded)."""
        return self.input_spec.dtype if self.input_spec else torch.float32

    def _forward(self, module: Any, batch: Any) -> Any:
        return call(module, batch)

    def warm_up(self) -> None:
        """One pass on zeros shaped as the declared input (``options.input_shape`` or
        ``options.inputs``, or the exported program's signature): a model whose output cannot be
        split into one answer per request is refused now, in one line, not at every request."""
        example = self._example()
        if example is None:
            return
        try:
            self.predict([example])
        except Exception as exc:  # noqa: BLE001 - any failure of the example is the model's
            # Torch puts the useful part of many errors after the first line: keep it all, bounded.
            raise HandlerError(f"model {self.name}: cannot be served: {_whole_message(exc)}") from exc

    def _example(self) -> Any:
        declared = self.options.get("inputs")
        if isinstance(declared, Mapping):
            out = {}
            for name, spec in declared.items():
                shape = [8 if d == -1 else int(d) for d in (spec.get("shape") or [])] if isinstance(spec, Mapping) else []
                dtype = getattr(torch, str(spec.get("dtype", "float32"))) if isinstance(spec, Mapping) else torch.float32
                out[name] = torch.zeros(shape, dtype=dtype)
            return out
        spec = self.input_spec
        if spec is None or spec.shape is None:
            return None
        return torch.zeros(spec.shape, dtype=spec.dtype)


class StateDictHandler(ModuleHandler):
    """Weights (safetensors or ``torch.save``) assigned into ``module_class(**module_kwargs)``."""

    format = "state_dict"

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        if not config.module_class:
            raise HandlerError(f"model {name}: the state_dict handler needs `module_class` (package.module:Class)", key="module_class")

        self.module_class = import_object(config.module_class, what=f"model {name}: module_class", key="module_class")
        if not isinstance(self.module_class, type) or not issubclass(self.module_class, torch.nn.Module):
            raise HandlerError(f"model {name}: module_class {config.module_class!r} is not a torch.nn.Module subclass", key="module_class")

    def _read(self) -> Any:
        return read_state_dict_module(self.module_class, dict(self.config.module_kwargs), self.path, what=f"model {self.name}")


class TorchScriptHandler(ModuleHandler):
    """A TorchScript module on disk (deprecated upstream; kept for legacy model stores)."""

    format = "torchscript"

    def _read(self) -> Any:
        with warnings.catch_warnings():
            # torch.jit.* is deprecated in favour of torch.export; loading legacy files is the point.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            module = torch.jit.load(self.path, map_location="cpu")
        module.eval()
        return module


def read_state_dict_module(cls: type, kwargs: dict[str, Any], path: str, *, what: str) -> Any:
    """Build ``cls(**kwargs)`` on the meta device and assign the weights from ``path``, so the
    weights are allocated once (safetensors are read into memory, ``torch.save`` files mapped)."""
    with torch.device("meta"):
        module = cls(**kwargs)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
    else:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    try:
        module.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as exc:
        raise HandlerError(f"{what}: {Path(path).name} does not match {cls.__name__}: {_first_line(exc)}", detail=f"{what}: {path} does not match {cls.__name__}: {_first_line(exc)}") from exc
    missing = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if missing:
        raise HandlerError(f"{what}: {Path(path).name} leaves {', '.join(missing[:5])} unset (not in the state dict)", detail=f"{what}: {path} leaves {', '.join(missing[:5])} unset")
    module.eval()
    return module


def _tensors(module: Any) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` once (tied weights are one object)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _release_cuda_cache(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _whole_message(exc: BaseException, limit: int = 1000) -> str:
    """An exception's whole text on one line, at most ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def warm_start(formats: set[str]) -> set[str]:
    """Pay torch's one-time set-up for the given model formats now (at a worker's start, before
    it reports ready), so that no model's first load carries it and is measured as that model's
    load cost. The first ``torch.export.load`` in a process costs about 1.4 s on top of the
    program's own read (docs/benchmarks.md); a second costs what the program does. Returns the
    formats warmed."""
    import io

    warmed: set[str] = set()
    tiny = torch.nn.Linear(1, 1)
    example = (torch.zeros(1, 1),)
    if "export" in formats:
        buf = io.BytesIO()
        torch.export.save(torch.export.export(tiny, example), buf)
        buf.seek(0)
        torch.export.load(buf).module()(*example)
        warmed.add("export")
    if "torchscript" in formats:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit is deprecated upstream; the format is served as legacy
            buf = io.BytesIO()
            torch.jit.save(torch.jit.trace(tiny, example), buf)
            buf.seek(0)
            torch.jit.load(buf)(*example)
        warmed.add("torchscript")
    return warmed
