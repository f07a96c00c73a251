"""Configs for a run: a :class:`Config` for the sidecars on this event loop, or the same sections
written out as a TOML file for the sidecars in processes of their own. :func:`write_config` is the
one place a benchmark's config becomes a file; scenarios never write TOML by hand."""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any

import msgspec
from jetbatch.sidecar.config import Config

__all__ = ["config", "fresh_prefix", "toml_text", "write_config"]

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def fresh_prefix(tag: str = "bn") -> str:
    """A subject prefix no other run on the server uses: ``<tag>`` and six hex digits."""
    return f"{tag}{uuid.uuid4().hex[:6]}"


def config(sections: dict[str, Any], *, tag: str = "bn") -> Config:
    """``sections`` as a :class:`Config`, with ``nats.prefix`` set to a fresh ``<tag><hex>``."""
    raw = dict(sections)
    raw["nats"] = {**raw.get("nats", {}), "prefix": fresh_prefix(tag)}
    return msgspec.convert(raw, Config)


def write_config(config: Config | dict[str, Any], directory: str | os.PathLike[str], name: str = "config") -> Path:
    """Write ``config`` (a :class:`Config`, or its sections as a dict) to ``directory/<name>.toml``
    for ``jetbatch`` processes (:func:`bench.harness.processes`) and return the path. Relative
    model paths resolve against ``directory``, as the worker reads them beside its config."""
    sections = msgspec.to_builtins(config) if isinstance(config, Config) else config
    path = Path(directory) / f"{name}.toml"
    path.write_text(toml_text(sections))
    return path


def toml_text(sections: dict[str, Any]) -> str:
    """``sections`` as TOML: each dict a table (``[models.m1]``, ``[models.m1.options]``), lists
    and scalars as values; ``None`` is left out (TOML has no null: the field keeps its default)."""
    out: list[str] = []
    _table(out, [], sections)
    return "\n".join(out).lstrip("\n") + "\n"


def _table(out: list[str], path: list[str], table: dict[str, Any]) -> None:
    values = {k: v for k, v in table.items() if v is not None and not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if path and (values or not tables):  # a header only where it holds something (or is empty)
        out.append(f"\n[{'.'.join(_key(p) for p in path)}]")
    out.extend(f"{_key(k)} = {_value(v)}" for k, v in values.items())
    for k, v in tables.items():
        _table(out, [*path, k], v)


def _key(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return ("-inf" if value < 0 else "inf") if math.isinf(value) else "nan"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")
