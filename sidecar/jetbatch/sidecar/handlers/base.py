"""The handler interface: how a worker loads a model, decodes requests, runs a batch and encodes
results, and how a model moves between the three memory tiers.

Tiers: *cold* (only on disk), *warm* (weights in host memory, pinned when the device is CUDA) and
*resident* (on the device, ready to run). The worker decides the moves; a handler carries them
out. Every method except ``decode``/``encode`` may block (disk, device): the worker calls them in
a worker thread so the event loop keeps acking and fetching; ``predict`` too, unless the handler
declares it cheap and bounded (``inline``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterable

from jetbatch.sdk.protocol import ContentType, ProtocolError, Tensor, decode_payload, encode_payload

from ..config import ModelConfig
from ..errors import SidecarError

if TYPE_CHECKING:
    import torch

__all__ = ["BadInput", "Handler", "HandlerError", "import_object", "resolve_device", "tensor_bytes", "to_torch", "uses_torch"]


class HandlerError(SidecarError):
    """A handler could not be created or loaded (bad path, bad class, load failure). ``key``:
    the model config key at fault when the config is (``handler``, ``module_class``,
    ``function``, ``path``), so the CLI can name the file and the key; None for a problem of the
    model's files or the machine."""

    def __init__(self, message: str, *, key: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        # For the operator's log: the message with what a caller must not see (server paths).
        # ``str(exc)`` may reach callers in a model_failed answer, so it names files by name only.
        self.detail = detail or message

    def reason(self, model: str) -> str:
        """The message without its leading ``model <name>: `` (for places that name the model)."""
        return str(self).removeprefix(f"model {model}: ")


class BadInput(SidecarError, ValueError):
    """One request's payload is not acceptable to this model: it gets a ``bad_request`` reply."""


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when available, else CPU. Imports torch (seconds, and about
    500 MiB of the process): a worker whose handlers do not use it never calls this
    (:func:`uses_torch`)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise HandlerError(f"invalid device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HandlerError(f"device {name!r} requested but CUDA is not available")
    return device


def uses_torch(handlers: Iterable["Handler"], device: str) -> bool:
    """Whether a worker with these handlers needs torch: one of them uses it, or the device is
    named (``cuda:0``: checked as configured, whatever the handlers)."""
    return device not in ("auto", "cpu") or any(h.uses_torch for h in handlers)


def to_torch(value: Any) -> Any:
    """Wire tensors (one, a tuple, a mapping) as torch tensors (zero-copy views); other values as
    they are. Torch is imported by the first wire tensor (``Tensor.to_torch``), not before."""
    if isinstance(value, Tensor):
        return value.to_torch()
    if isinstance(value, tuple) and value and all(isinstance(v, Tensor) for v in value):
        return tuple(v.to_torch() for v in value)
    if isinstance(value, Mapping) and value and all(isinstance(v, Tensor) for v in value.values()):
        return {k: v.to_torch() for k, v in value.items()}
    return value


def tensor_bytes(module: Any) -> int:
    """Bytes held by a module's parameters and buffers (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


class Handler(ABC):
    """Base class of every model handler.

    Lifecycle: ``check()`` at startup → optionally ``read_weights()`` (cold → warm: host memory
    only, so the worker can overlap disk reads with another model's compute) → ``load(device)``
    (→ resident) → many ``predict`` → ``offload()`` (resident → warm) or ``unload()`` (→ cold).
    A custom handler needs only ``load``, ``unload`` and ``predict``; without a warm tier its
    ``offload`` is an ``unload``.
    """

    # Whether ``predict`` is cheap and bounded whatever the batch (no device, no blocking call,
    # little work an item, nothing that needs its own thread): the worker then calls it on the
    # event loop, which a thread's round trip a batch (about 0.11 ms of CPU, ``python -m
    # bench.overhead.thread_hop``) would cost more than. Otherwise in a worker thread, so that a slow
    # batch never stops the loop.
    inline = False
    # Whether the handler needs torch (a device, tensors). A worker whose handlers all say no never
    # imports it: half a gigabyte and seconds of start-up for a worker of functions or sleeps.
    uses_torch = True

    def __init__(self, name: str, config: ModelConfig) -> None:
        self.name = name
        self.config = config
        self.options = dict(config.options)
        self.device: Any = "cpu"
        # The device the worker will load onto; set before any tier move so the host copy can be
        # pinned for fast host-to-device copies when it is CUDA.
        self.target_device: Any = "cpu"
        if self.uses_torch:
            import torch

            self.device = torch.device("cpu")
            self.target_device = torch.device("cpu")

    def check(self) -> None:
        """Raise :class:`HandlerError` if the model cannot possibly load (a missing or unreadable
        file); called once at startup so the problem is reported before the first request."""

    def read_weights(self) -> None:
        """Cold → warm: read weights from disk into host memory. Default: nothing to read ahead."""

    @property
    def warm(self) -> bool:
        """Whether a host copy of the weights is held (a load is then a host-to-device copy)."""
        return False

    @abstractmethod
    def load(self, device: torch.device) -> None:
        """Make the model ready on ``device`` (reading weights first if not warm)."""

    @abstractmethod
    def unload(self) -> None:
        """Release the device memory and any host copy: the model becomes cold."""

    def offload(self) -> None:
        """Resident → warm: release device memory but keep the host copy. Default: ``unload``."""
        self.unload()

    def drop_host_copy(self) -> None:
        """Warm → cold: release the host copy. Default: nothing is held."""

    def memory_bytes(self) -> int:
        """Device bytes the loaded model holds (parameters and buffers by default)."""
        return self.config.memory_bytes or 0

    def host_bytes(self) -> int:
        """Host bytes the warm copy holds (0 without a warm tier)."""
        return 0

    def decode(self, data: bytes, content_type: str | None) -> Any:
        """Decode one request; raise :class:`BadInput` to reject only this request.

        Default: the wire decoding, with tensors (one, a tuple, or a mapping of named ones) turned
        into (zero-copy, read-only) torch tensors of the same structure.
        """
        try:
            return to_torch(decode_payload(data, content_type))
        except ProtocolError as exc:  # undecodable, or a shape torch cannot build
            raise BadInput(str(exc)) from exc

    @abstractmethod
    def predict(self, inputs: list[Any]) -> list[Any]:
        """Run one batch; return one output per input, in order."""

    def encode(self, output: Any) -> tuple[bytes, ContentType]:
        """Encode one output for the reply (tensors use the tensor encoding)."""
        return encode_payload(output)


def import_object(spec: str, *, what: str, builtins: Iterable[str] = (), key: str | None = None) -> Any:
    """Import ``package.module:attribute`` (``builtins``: the names that need no import, listed
    in the error)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        names = sorted(builtins)
        alternative = f"neither a built-in ({', '.join(names)}) nor" if names else "not"
        raise HandlerError(f"{what} {spec!r} is {alternative} 'package.module:Name'", key=key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            # The module itself (not one it imports) is nowhere: say where it was looked for.
            where = f"no module named {missing!r} in the working directory or on PYTHONPATH"
            raise HandlerError(f"{what} {spec!r}: cannot import {module_name}: {where}", key=key) from exc
        raise HandlerError(f"{what} {spec!r}: cannot import {module_name}: {exc}", key=key) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise HandlerError(f"{what} {spec!r}: {module_name} has no attribute {attr!r}", key=key) from None
