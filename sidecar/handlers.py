"""Model handlers: how a worker loads a model, decodes requests, runs a batch and encodes results.

Every method except ``decode``/``encode`` may block (disk, device): the worker calls them in a
worker thread so the event loop keeps acking and fetching. Built in:

- ``torchscript``: a scripted module saved with ``torch.jit.save`` (``path``).
- ``identity``: returns each input unchanged (for protocol and overhead benchmarks).
- ``sleep``: sleeps ``load_s`` to load and ``batch_s + item_s * n`` per batch, returns its inputs;
  for controlled scheduling benchmarks.
- ``package.module:Class``: any :class:`Handler` subclass of yours.
"""

from __future__ import annotations

import importlib
import io
import threading
import time
import warnings
from abc import ABC, abstractmethod
from typing import Any

import torch

from sdk.protocol import ContentType, ProtocolError, Tensor, decode_payload, encode_payload

from .config import ModelConfig

__all__ = [
    "BadInput",
    "Handler",
    "HandlerError",
    "IdentityHandler",
    "SleepHandler",
    "TorchScriptHandler",
    "create_handler",
    "resolve_device",
    "tensor_bytes",
]


class HandlerError(Exception):
    """A handler could not be created or loaded (bad path, bad class, load failure)."""


class BadInput(ValueError):
    """One request's payload is not acceptable to this model: it gets a ``bad_request`` reply."""


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise HandlerError(f"invalid device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HandlerError(f"device {name!r} requested but CUDA is not available")
    return device


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes held by a module's parameters and buffers."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        total += t.numel() * t.element_size()
    return total


class Handler(ABC):
    """Base class of every model handler.

    Lifecycle: ``read_weights()`` (optional, host memory only; the worker may call it early to
    overlap disk reads with another model's compute) → ``load(device)`` → many ``predict`` →
    ``unload()``.
    """

    def __init__(self, name: str, config: ModelConfig) -> None:
        self.name = name
        self.config = config
        self.options = dict(config.options)
        self.device = torch.device("cpu")

    def read_weights(self) -> None:
        """Read weights from disk into host memory. Default: nothing to prefetch."""

    @abstractmethod
    def load(self, device: torch.device) -> None:
        """Make the model ready on ``device`` (reading weights first if not prefetched)."""

    @abstractmethod
    def unload(self) -> None:
        """Release device memory held by the model."""

    def memory_bytes(self) -> int:
        """Device bytes the loaded model holds (parameters and buffers by default)."""
        return self.config.memory_bytes or 0

    def decode(self, data: bytes, content_type: str | None) -> Any:
        """Decode one request; raise :class:`BadInput` to reject only this request.

        Default: the wire decoding, with tensors turned into (zero-copy, read-only) torch tensors.
        """
        try:
            value = decode_payload(data, content_type)
        except ProtocolError as exc:
            raise BadInput(str(exc)) from exc
        if isinstance(value, Tensor):
            return value.to_torch()
        return value

    @abstractmethod
    def predict(self, inputs: list[Any]) -> list[Any]:
        """Run one batch; return one output per input, in order."""

    def encode(self, output: Any) -> tuple[bytes, ContentType]:
        """Encode one output for the reply (tensors use the tensor encoding)."""
        return encode_payload(output)


class IdentityHandler(Handler):
    """Returns each input as its output."""

    def load(self, device: torch.device) -> None:
        self.device = device

    def unload(self) -> None:
        pass

    def predict(self, inputs: list[Any]) -> list[Any]:
        return list(inputs)


class SleepHandler(Handler):
    """Simulated model with controlled costs (options ``load_s``, ``batch_s``, ``item_s``, ``fail_on``).

    ``fail_on``: a payload value (bytes or str) that makes the batch raise, to exercise poison
    handling.
    """

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        self.load_s = float(self.options.get("load_s", config.load_cost_s))
        self.batch_s = float(self.options.get("batch_s", config.batch_cost_s))
        self.item_s = float(self.options.get("item_s", config.item_cost_s))
        fail_on = self.options.get("fail_on")
        self.fail_on = fail_on.encode() if isinstance(fail_on, str) else fail_on
        self.loaded = False

    def load(self, device: torch.device) -> None:
        time.sleep(self.load_s)
        self.device = device
        self.loaded = True

    def unload(self) -> None:
        self.loaded = False

    def predict(self, inputs: list[Any]) -> list[Any]:
        if self.fail_on is not None and any(
            (x.encode() if isinstance(x, str) else x) == self.fail_on for x in inputs if isinstance(x, (bytes, str))
        ):
            raise RuntimeError(f"poison input {self.fail_on!r}")
        time.sleep(self.batch_s + self.item_s * len(inputs))
        return list(inputs)


class TorchScriptHandler(Handler):
    """A TorchScript module on disk. Inputs are tensors of one shape; they are stacked into one
    batch, run in one forward pass under ``torch.inference_mode``, and split back per request.

    TorchScript is deprecated upstream in favour of ``torch.export``; jetbatch still loads it
    because that is what most deployed model stores hold (the warning is silenced here).
    """

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        if not config.path:
            raise HandlerError(f"model {name}: the torchscript handler needs `path`")
        self._host_bytes: bytes | None = None
        self._module: torch.jit.ScriptModule | None = None
        self._lock = threading.Lock()

    def read_weights(self) -> None:
        with self._lock:
            if self._host_bytes is None and self._module is None:
                try:
                    with open(self.config.path or "", "rb") as f:
                        self._host_bytes = f.read()
                except OSError as exc:
                    raise HandlerError(f"model {self.name}: cannot read {self.config.path}: {exc}") from exc

    def load(self, device: torch.device) -> None:
        self.read_weights()
        with self._lock:
            assert self._host_bytes is not None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    module = torch.jit.load(io.BytesIO(self._host_bytes), map_location=device)
            except Exception as exc:  # torch raises RuntimeError subclasses of many kinds here
                raise HandlerError(f"model {self.name}: cannot load {self.config.path}: {exc}") from exc
            module.eval()
            self._module = module
            self._host_bytes = None  # the device copy is what we keep
            self.device = device

    def unload(self) -> None:
        with self._lock:
            self._module = None
            self._host_bytes = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_bytes(self) -> int:
        if self._module is None:
            return self.config.memory_bytes or 0
        return tensor_bytes(self._module)

    def decode(self, data: bytes, content_type: str | None) -> Any:
        value = super().decode(data, content_type)
        if not isinstance(value, torch.Tensor):
            raise BadInput(f"model {self.name} expects a tensor ({ContentType.TENSOR.value}), got {type(value).__name__}")
        if not value.is_floating_point():
            raise BadInput(f"model {self.name} expects a floating-point tensor, got {value.dtype}")
        return value

    def predict(self, inputs: list[Any]) -> list[Any]:
        module = self._module
        if module is None:
            raise RuntimeError(f"model {self.name} is not loaded")
        with torch.inference_mode():
            try:
                batch = torch.stack(inputs).to(self.device, dtype=torch.float32)
            except RuntimeError:
                # Shapes differ: run one by one rather than fail the batch.
                return [module(x.unsqueeze(0).to(self.device, dtype=torch.float32))[0].cpu() for x in inputs]
            out = module(batch)
        return list(out.cpu().unbind(0))


_BUILTIN: dict[str, type[Handler]] = {
    "torchscript": TorchScriptHandler,
    "identity": IdentityHandler,
    "sleep": SleepHandler,
}


def create_handler(name: str, config: ModelConfig) -> Handler:
    """Instantiate the handler a model's config names; :class:`HandlerError` explains failures."""
    spec = config.handler
    cls: Any = _BUILTIN.get(spec)
    if cls is None:
        cls = import_object(spec, what=f"model {name}: handler")
        if not (isinstance(cls, type) and issubclass(cls, Handler)):
            raise HandlerError(f"model {name}: handler {spec!r} is not a subclass of sidecar.handlers.Handler")
    try:
        return cls(name, config)
    except HandlerError:
        raise
    except Exception as exc:
        raise HandlerError(f"model {name}: handler {spec!r} failed to initialise: {exc}") from exc


def import_object(spec: str, *, what: str) -> Any:
    """Import ``package.module:attribute``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerError(
            f"{what} {spec!r} is neither a built-in ({', '.join(sorted(_BUILTIN))}) nor 'package.module:Name'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(f"{what} {spec!r}: cannot import {module_name}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise HandlerError(f"{what} {spec!r}: {module_name} has no attribute {attr!r}") from None
