"""Routers: how the classifier decides each request's model, for a whole batch at once: a torch
classification network (one forward pass per batch), rules on headers or payload fields, or a
Python callable."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from jetbatch.sdk.protocol import ContentType, ErrorCode, ProtocolError, decode_payload

from ..config import ClassifierConfig, ConfigError
from ..handlers import HandlerError, import_object, read_module
from ..replies import client_message

__all__ = ["CallableRouter", "Item", "Route", "Router", "RulesRouter", "TorchRouter", "check_router_config", "make_router"]

_FILE_FORMATS = ("export", "state_dict", "torchscript")
_MAX_SHAPES_REMEMBERED = 64

log = logging.getLogger("jetbatch.classifier")


@dataclass(frozen=True)
class Route:
    """A router's verdict for one request: a model name, or an error for the caller."""

    model: str | None
    error: tuple[ErrorCode, str] | None = None


@dataclass
class Item:
    """One ingress request as a router sees it."""

    headers: Mapping[str, str]
    data: bytes
    content_type: str | None

    def payload(self) -> Any:
        """The decoded payload (raises ProtocolError when undecodable, whatever made it fail: the
        routers answer that per request, and one producer's body must not fail a batch)."""
        try:
            return decode_payload(self.data, self.content_type)
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to decode is this request's
            raise ProtocolError(f"undecodable payload: {type(exc).__name__}") from None


class Router:
    """Decides the model of every request of a batch at once."""

    # Whether ``route`` is cheap and bounded (no payload to decode, no model to run): then it runs
    # on the event loop; otherwise in a worker thread, so a slow batch does not stop the loop.
    inline = False

    def route(self, items: Sequence[Item]) -> list[Route]:
        raise NotImplementedError

    def load(self) -> None:
        """Prepare (load weights); called once, in a worker thread."""


class TorchRouter(Router):
    """A classification network run on the whole batch in one forward pass.

    Inputs are finite tensors (a tensor, or a JSON or msgpack list of numbers, as float32): of ``input_shape`` when it is configured or an exported program
    declares it (others are answered ``bad_request`` one by one; the network is warmed up on it at
    load, so it is known to work). Each distinct shape in a batch gets its own forward pass; a pass
    that fails is retried input by input, and the inputs that fail where others of their shape
    pass are ``bad_request``. A shape that fails whole is the input's fault if the network works
    on other shapes and never took this one, and the router's (``internal``, logged) if it took
    this shape before or has never worked at all. The argmax class (as a string index, or the network's
    label) maps to a model through ``labels``; below ``confidence_threshold`` the softmax top
    probability sends the request to ``fallback_model``.
    """

    def __init__(self, cfg: ClassifierConfig) -> None:
        if not cfg.path and cfg.handler in _FILE_FORMATS:
            raise ConfigError(f"classifier.path: required for the torch router with handler {cfg.handler!r}")
        if not cfg.labels:
            raise ConfigError("classifier.labels: the torch router needs a label -> model map")
        self.cfg = cfg
        self.module: Any = None
        self._shapes_ok: set[tuple[int, ...]] = set()  # input shapes the network has taken
        self._one_at_a_time = False  # the network fails on batches of more than one input
        # One request's shape: configured, or read from an exported program's signature.
        self.input_shape: tuple[int, ...] | None = tuple(cfg.input_shape) if cfg.input_shape is not None else None

    def load(self) -> None:
        if self.cfg.handler in _FILE_FORMATS:
            module = read_module(
                self.cfg.handler, self.cfg.path or "", module_class=self.cfg.module_class, module_kwargs=dict(self.cfg.module_kwargs)
            )
            self.module = module.to(self.cfg.device) if self.cfg.device != "cpu" else module
        else:
            factory = import_object(self.cfg.handler, what="classifier.handler", key="handler")
            self.module = factory(self.cfg) if isinstance(factory, type) else factory
            if hasattr(self.module, "eval"):
                self.module.eval()
        if self.input_shape is None and self.cfg.handler == "export":  # only a program declares it
            from ..handlers.exported import export_input_spec  # torch: only the torch router imports it

            spec = export_input_spec(self.module)
            if spec is not None and spec.shape is not None:
                self.input_shape = spec.shape
        if self.input_shape is not None:
            # One pass on zeros: the network is then known to work, so the first odd input after a
            # start is judged as the input's fault, not the router's.
            import torch

            try:
                self._forward([torch.zeros(self.input_shape)])
                self._shapes_ok.add(self.input_shape)
            except Exception as exc:  # noqa: BLE001 - serving reports it per batch
                log.warning("router warm-up on input shape %s failed: %r", list(self.input_shape), exc)

    def route(self, items: Sequence[Item]) -> list[Route]:
        routes: list[Route | None] = [None] * len(items)
        by_shape: dict[tuple[int, ...], list[tuple[int, Any]]] = {}
        for i, item in enumerate(items):
            try:
                tensor = self._tensor(item)
            except ProtocolError as exc:
                routes[i] = Route(None, (ErrorCode.BAD_REQUEST, str(exc)))
                continue
            by_shape.setdefault(tuple(tensor.shape), []).append((i, tensor))
        # One forward pass per input shape, so one producer's odd tensor cannot fail the others';
        # a pass that fails is retried input by input to find the one that made it fail.
        failed: list[tuple[tuple[int, ...], list[int], BaseException]] = []
        worked = False  # some pass succeeded in this batch: the network works now
        for shape, group in by_shape.items():
            if self._one_at_a_time and len(group) > 1:
                error = RuntimeError("the router takes one input at a time")
            else:
                try:
                    self._assign(routes, [i for i, _ in group], self._forward([t for _, t in group]), shape)
                    worked = True
                    continue
                except Exception as exc:  # noqa: BLE001 - judged below: the input's fault or the router's
                    error = exc
            if len(group) > 1:
                alone: list[int] = []
                for i, t in group:
                    try:
                        self._assign(routes, [i], self._forward([t]), shape)
                    except Exception as exc:  # noqa: BLE001
                        alone.append(i)
                        error = exc
                if len(alone) < len(group):  # the network takes this shape: those inputs are bad
                    worked = True
                    if not alone and not self._one_at_a_time:
                        # Each input passes alone and the batch does not: a network exported or
                        # written for a batch of one. Run it that way from now on.
                        self._one_at_a_time = True
                        log.warning("the router network fails on batches but not on single inputs: running it one input at a time (export it with a dynamic batch dimension)")
                    for i in alone:
                        routes[i] = Route(None, (ErrorCode.BAD_REQUEST, f"the router cannot classify this input: {client_message(error, 200)}"))
                    continue
            failed.append((shape, [i for i, _ in group], error))
        for shape, indices, error in failed:
            known = len(self._shapes_ok) < _MAX_SHAPES_REMEMBERED  # every shape it took is recorded
            if shape not in self._shapes_ok and (worked or (self._shapes_ok and known)):
                # The network works on other shapes (now, or before) and never took this one.
                message = f"the router cannot take input shape {list(shape)}: {client_message(error, 200)}"
                for i in indices:
                    routes[i] = Route(None, (ErrorCode.BAD_REQUEST, message))
                continue
            # It failed on a shape it took before, or has never worked at all: the router's fault.
            log.error("router failed on %d input(s) of shape %s: %r", len(indices), list(shape), error)
            for i in indices:
                routes[i] = Route(None, (ErrorCode.INTERNAL, f"router failed: {client_message(error)}"))
        return [r or Route(None, (ErrorCode.INTERNAL, "unrouted")) for r in routes]

    def _forward(self, tensors: list[Any]) -> list[tuple[float, int]]:
        """The top class and its probability for each input (one forward pass); raises on any
        failure, including logits that are not ``[inputs, classes]``."""
        import torch

        batch = torch.stack(tensors).to(self.cfg.device)
        with torch.inference_mode():
            logits = self.module(batch)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(tensors):
            raise ValueError(f"expected logits of shape [{len(tensors)}, classes], got {_shape_of(logits)}")
        top_p, top_i = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        return list(zip(top_p.tolist(), top_i.tolist()))

    def _assign(self, routes: list[Route | None], indices: list[int], top: list[tuple[float, int]], shape: tuple[int, ...]) -> None:
        if shape not in self._shapes_ok and len(self._shapes_ok) < _MAX_SHAPES_REMEMBERED:
            self._shapes_ok.add(shape)
        for i, (p, k) in zip(indices, top):
            if not p >= self.cfg.confidence_threshold:  # also NaN: scores from infinite logits
                if self.cfg.fallback_model:
                    routes[i] = Route(self.cfg.fallback_model)
                    continue
                if p != p:
                    routes[i] = Route(None, (ErrorCode.INTERNAL, "the router's scores for this input are not finite"))
                    continue
            model = self.cfg.labels.get(str(k))
            routes[i] = Route(model) if model else Route(None, (ErrorCode.UNKNOWN_MODEL, f"class {k} maps to no model"))

    def _tensor(self, item: Item) -> Any:
        """The request's input as a float32 tensor of the configured shape; ProtocolError if not."""
        import torch

        from ..handlers.structure import tensor_from_list

        value = item.payload()
        if isinstance(value, list):
            # A JSON or msgpack list of numbers, as a model subject takes it (handlers/modules.py).
            try:
                value = tensor_from_list(value)
            except ValueError as exc:
                raise ProtocolError(f"the torch router needs a tensor or a list of numbers: {exc}") from None
        elif not hasattr(value, "to_torch"):
            raise ProtocolError(
                f"the torch router needs a tensor ({ContentType.TENSOR.value}) or a list of numbers (JSON or msgpack), got {type(value).__name__}"
            )
        expected = self.input_shape
        if expected is not None and list(value.shape) != list(expected):
            raise ProtocolError(f"the router expects input shape {list(expected)}, got {list(value.shape)}")
        try:
            tensor = (value if isinstance(value, torch.Tensor) else value.to_torch()).to(torch.float32)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:  # a shape torch cannot build
            raise ProtocolError(f"$.shape: {list(value.shape)[:8]} is not a tensor torch can build: {client_message(exc, 200)}") from None
        if not bool(torch.isfinite(tensor).all()):
            raise ProtocolError("$.data: the input holds NaN or infinity")  # its logits would pick a class at random
        return tensor


def _shape_of(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return str(list(shape)) if shape is not None else type(value).__name__


class RulesRouter(Router):
    """First matching rule wins: ``{header = "X", equals = "v", model = "m"}`` or
    ``{field = "a.b", equals = v, model = "m"}`` (a field of a JSON/msgpack map payload)."""

    def __init__(self, cfg: ClassifierConfig) -> None:
        for n, rule in enumerate(cfg.rules):
            if "model" not in rule or ("header" not in rule and "field" not in rule) or "equals" not in rule:
                raise ConfigError(f"classifier.rules[{n}]: needs model, equals, and header or field")
        self.rules = cfg.rules
        self.default = cfg.default_model
        # Header rules and the default are dictionary lookups: a thread hop a batch cost more than
        # routing it (the classifier's busiest path). A field rule decodes payloads: a thread.
        self.inline = all("header" in rule for rule in cfg.rules)

    def route(self, items: Sequence[Item]) -> list[Route]:
        out = []
        for item in items:
            try:
                out.append(self._one(item))
            except ProtocolError as exc:
                out.append(Route(None, (ErrorCode.BAD_REQUEST, str(exc))))
        return out

    def _one(self, item: Item) -> Route:
        payload: Any = None
        decoded = False
        for rule in self.rules:
            if "header" in rule:
                if item.headers.get(rule["header"]) == rule["equals"]:
                    return Route(rule["model"])
                continue
            if not decoded:
                payload, decoded = item.payload(), True
            value: Any = payload
            for part in str(rule["field"]).split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value == rule["equals"]:
                return Route(rule["model"])
        if self.default:
            return Route(self.default)
        return Route(None, (ErrorCode.UNKNOWN_MODEL, "no routing rule matched and no default_model is set"))


class CallableRouter(Router):
    """``package.module:function``, called as ``function(payloads, headers) -> list[model]`` on
    the whole batch (payloads decoded; an undecodable one is passed as None)."""

    def __init__(self, cfg: ClassifierConfig) -> None:
        if not cfg.callable:
            raise ConfigError("classifier.callable: required for the callable router")
        self.fn: Callable[..., Sequence[str | None]] = import_object(cfg.callable, what="classifier.callable", key="callable")

    def route(self, items: Sequence[Item]) -> list[Route]:
        payloads: list[Any] = []
        bad: dict[int, str] = {}
        for i, item in enumerate(items):
            try:
                payloads.append(item.payload())
            except ProtocolError as exc:
                payloads.append(None)
                bad[i] = str(exc)
        models = list(self.fn(payloads, [dict(item.headers) for item in items]))
        if len(models) != len(items):
            raise RuntimeError(f"router callable returned {len(models)} models for {len(items)} requests")
        out = []
        for i, model in enumerate(models):
            if i in bad:
                out.append(Route(None, (ErrorCode.BAD_REQUEST, bad[i])))
            elif not model:
                out.append(Route(None, (ErrorCode.UNKNOWN_MODEL, "the router gave no model")))
            else:
                out.append(Route(str(model)))
        return out


def make_router(cfg: ClassifierConfig) -> Router:
    kinds: dict[str, type[Router]] = {"torch": TorchRouter, "rules": RulesRouter, "callable": CallableRouter}
    return kinds[cfg.router](cfg)


def check_router_config(cfg: ClassifierConfig, source: str) -> None:
    """Make the router and import what the config names (a custom ``handler`` factory, the
    ``callable``), before anything connects: a fault of the config is a :class:`ConfigError`
    naming ``source`` and the key."""
    try:
        if cfg.router == "torch" and cfg.handler not in _FILE_FORMATS:
            import_object(cfg.handler, what="classifier.handler", key="handler")
        make_router(cfg)
    except HandlerError as exc:
        detail = str(exc).removeprefix("classifier.handler ").removeprefix("classifier.callable ")
        raise ConfigError(f"{source}: classifier.{exc.key or 'handler'}: {detail}") from None
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
