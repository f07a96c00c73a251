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

from typing import Any, Mapping

import torch

from ..config import ConfigError, ModelConfig
from .base import BadInput, Handler, HandlerError, import_object, resolve_device, tensor_bytes
from .modules import InputSpec, ModuleHandler, StateDictHandler, TorchScriptHandler
from .exported import ExportHandler
from .huggingface import TransformersHandler
from .simple import FunctionHandler, IdentityHandler, SleepHandler

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
    "check_model_configs",
    "create_handler",
    "import_object",
    "read_module",
    "resolve_device",
    "tensor_bytes",
]

BUILTIN_HANDLERS: dict[str, type[Handler]] = {
    "export": ExportHandler,
    "state_dict": StateDictHandler,
    "function": FunctionHandler,
    "torchscript": TorchScriptHandler,
    "identity": IdentityHandler,
    "sleep": SleepHandler,
    "transformers": TransformersHandler,
}


def create_handler(name: str, config: ModelConfig) -> Handler:
    """Instantiate the handler a model's config names; :class:`HandlerError` explains failures."""
    spec = config.handler
    cls: Any = BUILTIN_HANDLERS.get(spec)
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
    classes: dict[str, type[ModuleHandler]] = {"export": ExportHandler, "state_dict": StateDictHandler, "torchscript": TorchScriptHandler}
    handler = classes[fmt]("router", config)
    handler.check()
    handler.read_weights()
    handler.load(torch.device("cpu"))
    return handler.module
