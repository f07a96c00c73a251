"""Model handlers: how a worker loads a model, decodes requests, runs a batch and encodes results.

Built in (the ``handler`` key of ``[models.<name>]``):

- ``export``: a ``torch.export`` program (``path`` to a ``.pt2``).
- ``state_dict``: a safetensors or ``torch.save`` state dict (``path``) plus ``module_class`` and
  ``module_kwargs``.
- ``function``: ``function = "package.module:function"``, called with a list of inputs.
- ``torchscript``: a scripted module (legacy).
- ``transformers``: a local Hugging Face ``save_pretrained`` directory (``pip install 'jetbatch[hf]'``).
- ``identity`` and ``sleep``: for protocol tests and controlled benchmarks.
- ``package.module:Class``: any :class:`Handler` subclass of yours.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, ModelConfig
from .base import BadInput, Handler, HandlerError, import_object, resolve_device, tensor_bytes, uses_torch
from .simple import FunctionHandler, IdentityHandler, SleepHandler

if TYPE_CHECKING:
    from .exported import ExportHandler
    from .huggingface import TransformersHandler
    from .modules import InputSpec, ModuleHandler, StateDictHandler, TorchScriptHandler

__all__ = [
    "BUILTIN_HANDLERS",
    "BadInput",
    "ExportHandler",
    "FunctionHandler",
    "Handler",
    "HandlerError",
    "IdentityHandler",
    "InputSpec",
    "ModuleHandler",
    "SleepHandler",
    "StateDictHandler",
    "TorchScriptHandler",
    "TransformersHandler",
    "builtin_handler",
    "check_model_configs",
    "create_handler",
    "import_object",
    "models_use_torch",
    "read_module",
    "resolve_device",
    "tensor_bytes",
    "uses_torch",
]

# The handlers built on torch, imported when first named (``import torch`` costs seconds and about
# 500 MiB: a worker of sleeps or identities never pays it).
_TORCH_HANDLERS = {
    "ExportHandler": ".exported",
    "InputSpec": ".modules",
    "ModuleHandler": ".modules",
    "StateDictHandler": ".modules",
    "TorchScriptHandler": ".modules",
    "TransformersHandler": ".huggingface",
}


def __getattr__(name: str) -> Any:
    module = _TORCH_HANDLERS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


class _BuiltinHandlers(Mapping[str, "type[Handler]"]):
    """``handler`` name -> the class of a built-in handler, a torch-based one imported when it is
    first looked up (iterating gives the names and imports nothing)."""

    _WHERE = {
        "export": (".exported", "ExportHandler"),
        "state_dict": (".modules", "StateDictHandler"),
        "function": (".simple", "FunctionHandler"),
        "torchscript": (".modules", "TorchScriptHandler"),
        "identity": (".simple", "IdentityHandler"),
        "sleep": (".simple", "SleepHandler"),
        "transformers": (".huggingface", "TransformersHandler"),
    }

    def __getitem__(self, name: str) -> type[Handler]:
        module, cls = self._WHERE[name]
        return getattr(importlib.import_module(module, __name__), cls)  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return iter(self._WHERE)

    def __len__(self) -> int:
        return len(self._WHERE)


BUILTIN_HANDLERS: Mapping[str, type[Handler]] = _BuiltinHandlers()


def builtin_handler(name: str) -> type[Handler] | None:
    """The class of the built-in handler ``name`` (None: not a built-in one)."""
    return BUILTIN_HANDLERS.get(name)


def create_handler(name: str, config: ModelConfig) -> Handler:
    """Instantiate the handler a model's config names; :class:`HandlerError` explains failures."""
    spec = config.handler
    cls: Any = builtin_handler(spec)
    if cls is None:
        cls = import_object(spec, what=f"model {name}: handler", builtins=BUILTIN_HANDLERS, key="handler")
        if not (isinstance(cls, type) and issubclass(cls, Handler)):
            raise HandlerError(f"model {name}: handler {spec!r} is not a subclass of jetbatch.sidecar.handlers.Handler", key="handler")
    try:
        return cls(name, config)  # type: ignore[no-any-return]
    except HandlerError:
        raise
    except Exception as exc:
        raise HandlerError(f"model {name}: handler {spec!r} failed to initialise: {exc}", key="handler") from exc


def models_use_torch(models: Mapping[str, ModelConfig], device: str) -> bool:
    """Whether a worker serving ``models`` on ``device`` needs torch (:func:`uses_torch`), read from
    the handlers' classes (a custom one is imported; none is made)."""
    if device not in ("auto", "cpu"):
        return True
    for name, mcfg in models.items():
        cls = builtin_handler(mcfg.handler)
        if cls is None:
            try:
                cls = import_object(mcfg.handler, what=f"model {name}: handler", key="handler")
            except HandlerError:
                return True  # reported by check_model_configs
        if getattr(cls, "uses_torch", True):
            return True
    return False


def check_model_configs(models: Mapping[str, ModelConfig], source: str) -> None:
    """Make each model's handler (importing the classes and functions it names; no weights are
    read) and raise :class:`ConfigError` naming ``source`` and the key when the config is at
    fault: a handler, ``module_class`` or ``function`` that cannot be imported or is the wrong
    kind, a missing ``path``. A model file that is missing or unreadable is not a config error:
    the worker starts, reports the model broken and answers its requests ``model_failed``."""
    for name, mcfg in models.items():
        try:
            create_handler(name, mcfg).check()
        except HandlerError as exc:
            if exc.key is None:
                continue
            detail = str(exc).removeprefix(f"model {name}: ")
            raise ConfigError(f"{source}: models.{name}.{exc.key}: {detail}") from None


def read_module(fmt: str, path: str, *, module_class: str | None = None, module_kwargs: dict[str, Any] | None = None) -> Any:
    """Read a module in one of the built-in formats onto the CPU (the classifier's router uses it)."""
    config = ModelConfig(handler=fmt, path=path, module_class=module_class, module_kwargs=module_kwargs or {})
    import torch

    cls = builtin_handler(fmt)
    assert cls is not None and issubclass(cls, Handler), fmt
    handler = cls("router", config)
    handler.check()
    handler.read_weights()
    handler.load(torch.device("cpu"))
    return handler.module
