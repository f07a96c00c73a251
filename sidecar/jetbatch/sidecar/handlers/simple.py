"""Handlers without weights: ``identity``, ``sleep`` (controlled costs for benchmarks) and
``function`` (a plain ``package.module:function(batch) -> list``, the shape of a Redis
``dynamic-batcher`` processor)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from ..config import ModelConfig
from .base import Handler, HandlerError, import_object

if TYPE_CHECKING:
    import torch

__all__ = ["FunctionHandler", "IdentityHandler", "SleepHandler"]

log = logging.getLogger("jetbatch.handlers")
_warned: set[str] = set()


class IdentityHandler(Handler):
    """Returns each input as its output."""

    inline = True  # a list copy: far cheaper than a thread's round trip
    uses_torch = False

    def load(self, device: torch.device) -> None:
        self.device = device

    def unload(self) -> None:
        pass

    def predict(self, inputs: list[Any]) -> list[Any]:
        return list(inputs)


class SleepHandler(Handler):
    """Simulated model with controlled costs: it sleeps ``load_cost_s`` to load and
    ``batch_cost_s + item_cost_s * n`` per batch, and returns its inputs (options of the same
    names override the model's cost estimates; the older ``load_s``/``batch_s``/``item_s`` still
    work for one release, with a warning). ``fail_on``: a payload (bytes or str) that makes the batch raise, for poison tests.
    ``warm_load_cost_s``: the load time when the model is warm (default: a tenth of a cold load).
    """

    uses_torch = False

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        opt = self.options
        for old, new in (("load_s", "load_cost_s"), ("batch_s", "batch_cost_s"), ("item_s", "item_cost_s")):
            if old in opt and old not in _warned:
                _warned.add(old)
                log.warning("sleep handler option %r is deprecated; use %r", old, new)
        self.load_cost_s = float(opt.get("load_cost_s", opt.get("load_s", config.load_cost_s)))
        self.batch_cost_s = float(opt.get("batch_cost_s", opt.get("batch_s", config.batch_cost_s)))
        self.item_cost_s = float(opt.get("item_cost_s", opt.get("item_s", config.item_cost_s)))
        self.warm_load_cost_s = float(opt.get("warm_load_cost_s", self.load_cost_s / 10.0))
        fail_on = opt.get("fail_on")
        self.fail_on = fail_on.encode() if isinstance(fail_on, str) else fail_on
        self.loaded = False
        self._warm = False

    def read_weights(self) -> None:
        if not self._warm:
            time.sleep(self.load_cost_s - self.warm_load_cost_s)
            self._warm = True

    @property
    def warm(self) -> bool:
        return self._warm

    def load(self, device: torch.device) -> None:
        time.sleep(self.warm_load_cost_s if self._warm else self.load_cost_s)
        self._warm = True  # like a real model, the host copy stays while resident
        self.device = device
        self.loaded = True

    def offload(self) -> None:
        self.loaded = False

    def unload(self) -> None:
        self.loaded = False
        self._warm = False

    def drop_host_copy(self) -> None:
        self._warm = False

    def host_bytes(self) -> int:
        return (self.config.memory_bytes or 0) if self._warm else 0

    def predict(self, inputs: list[Any]) -> list[Any]:
        if self.fail_on is not None and any(
            (x.encode() if isinstance(x, str) else x) == self.fail_on for x in inputs if isinstance(x, (bytes, str))
        ):
            raise RuntimeError(f"poison input {self.fail_on!r}")
        time.sleep(self.batch_cost_s + self.item_cost_s * len(inputs))
        return list(inputs)


class FunctionHandler(Handler):
    """``function = "package.module:function"``: called with the batch's decoded inputs (a list),
    returns one output per input. Tensors arrive as torch tensors, msgpack/JSON as Python values,
    raw bytes as bytes. No weights, so no tiers; the import happens at load."""

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        if not config.function:
            raise HandlerError(f"model {name}: the function handler needs `function` (package.module:function)", key="function")
        self._fn: Callable[[list[Any]], Any] | None = None

    def check(self) -> None:

        fn = import_object(self.config.function or "", what=f"model {self.name}: function", key="function")
        if not callable(fn):
            raise HandlerError(f"model {self.name}: function {self.config.function!r} is not callable", key="function")

    def load(self, device: torch.device) -> None:

        self._fn = import_object(self.config.function or "", what=f"model {self.name}: function")
        self.device = device

    def unload(self) -> None:
        self._fn = None

    def predict(self, inputs: list[Any]) -> list[Any]:
        if self._fn is None:
            raise RuntimeError(f"model {self.name} is not loaded")
        out = list(self._fn(list(inputs)))
        if len(out) != len(inputs):
            raise RuntimeError(f"function returned {len(out)} outputs for {len(inputs)} inputs")
        return out
