"""Read a Go CPU profile (pprof's gzipped ``profile.proto``, what nats-server serves on its
``prof_port``) without Go's tools: the CPU each function was on the stack for (inclusive) and at
the top of it (self). Only the fields this needs are decoded (samples, locations' lines,
functions, the string table)."""

from __future__ import annotations

import collections
import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuProfile", "read_profile"]


@dataclass(frozen=True)
class CpuProfile:
    """CPU nanoseconds in all, and by function: inclusive (on the stack) and self (on top)."""

    total_ns: int
    inclusive_ns: dict[str, int]
    self_ns: dict[str, int]

    def share(self, function: str) -> float:
        """The part of all CPU spent with ``function`` on the stack."""
        return self.inclusive_ns.get(function, 0) / self.total_ns if self.total_ns else 0.0


def _varint(b: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        c = b[i]
        i += 1
        result |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return result, i


def _fields(b: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of one protobuf message."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        wire = key & 7
        value: int | bytes
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            value, i = b[i : i + n], i + n
        elif wire == 1:
            value, i = b[i : i + 8], i + 8
        elif wire == 5:
            value, i = b[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield key >> 3, wire, value


def _ints(value: int | bytes) -> list[int]:
    """A repeated integer field's values (packed, or one unpacked)."""
    if isinstance(value, int):
        return [value]
    out, i = [], 0
    while i < len(value):
        x, i = _varint(value, i)
        out.append(x)
    return out


def read_profile(path: Path) -> CpuProfile:
    """The CPU profile at ``path`` (sample value 1: CPU nanoseconds, as Go writes it)."""
    data = gzip.decompress(path.read_bytes())
    strings: list[str] = []
    samples: list[tuple[list[int], list[int]]] = []
    locations: dict[int, list[int]] = {}  # location id -> function ids, innermost (inlined) first
    names: dict[int, int] = {}  # function id -> its name's index in the string table
    for field, _, value in _fields(data):
        if field == 6 and isinstance(value, bytes):
            strings.append(value.decode("utf-8", "replace"))
        elif field == 2 and isinstance(value, bytes):
            ids: list[int] = []
            values: list[int] = []
            for f, _, v in _fields(value):
                (ids if f == 1 else values if f == 2 else []).extend(_ints(v))
            samples.append((ids, values))
        elif field == 4 and isinstance(value, bytes):
            location, functions = 0, []
            for f, _, v in _fields(value):
                if f == 1 and isinstance(v, int):
                    location = v
                elif f == 4 and isinstance(v, bytes):
                    functions += [fid for lf, _, fid in _fields(v) if lf == 1 and isinstance(fid, int)]
            locations[location] = functions
        elif field == 5 and isinstance(value, bytes):
            fn = {f: v for f, _, v in _fields(value) if isinstance(v, int)}
            names[fn.get(1, 0)] = fn.get(2, 0)
    inclusive: collections.Counter[str] = collections.Counter()
    on_top: collections.Counter[str] = collections.Counter()
    total = 0
    for ids, values in samples:
        ns = values[1] if len(values) > 1 else 0
        stack = [strings[names.get(fid, 0)] for loc in ids for fid in locations.get(loc, [])]
        if not stack:
            continue
        total += ns
        on_top[stack[0]] += ns
        for name in set(stack):
            inclusive[name] += ns
    return CpuProfile(total, dict(inclusive), dict(on_top))
