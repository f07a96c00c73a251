"""Bodies on the wire: payload encodings (the zero-copy tensor among them), error bodies, the
batch metadata of a reply."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import msgspec

from .names import ContentType, ErrorCode, Headers, ProtocolError, Status

TENSOR_DTYPES: frozenset[str] = frozenset(
    {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
_DTYPE_SIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


# torch's and numpy's own bound on a tensor's dimensions; each dimension indexes with an int64.
MAX_TENSOR_RANK = 64
_MAX_DIM = 2**63


def _shape_text(shape: tuple[int, ...]) -> str:
    """A shape for a message, at most 8 dimensions of it (the rest counted)."""
    if len(shape) <= 8:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:8]))}, ... {len(shape) - 8} more]"


class Tensor(msgspec.Struct, frozen=True):
    """A dense tensor on the wire: dtype name, shape and raw little-endian C-order bytes.

    Decoding gives ``data`` as a read-only ``memoryview`` into the received message (no copy);
    :meth:`to_torch` wraps it with ``torch.frombuffer`` (no copy either).
    """

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def validate(self) -> "Tensor":
        """Check dtype and that shape and byte length agree; raise :class:`ProtocolError` if not.

        Bounded whatever the shape claims: at most :data:`MAX_TENSOR_RANK` dimensions, each below
        2**63 (what torch can index), and the element count is never carried past what the data
        holds, so a shape of thousands of huge dimensions is refused at once instead of making
        its product a number of thousands of digits (quadratic to compute, and past Python's
        limit to print)."""
        if self.dtype not in TENSOR_DTYPES:
            raise ProtocolError(f"$.dtype: unsupported tensor dtype {self.dtype[:32]!r}; expected one of {sorted(TENSOR_DTYPES)}")
        shape = self.shape
        if len(shape) > MAX_TENSOR_RANK:
            raise ProtocolError(f"$.shape: {len(shape)} dimensions, at most {MAX_TENSOR_RANK}")
        for dim in shape:
            if not 0 <= dim < _MAX_DIM:
                raise ProtocolError(f"$.shape: dimension {dim} out of range (0 to 2**63 - 1) in {_shape_text(shape)}")
        size = _DTYPE_SIZE[self.dtype]
        have = len(self.data)
        if 0 in shape:
            expected = 0
        else:
            expected = size
            for dim in shape:
                expected *= dim
                if expected > have:
                    break  # more than the data holds: the exact figure adds nothing
        if have != expected:
            claim = f"{expected} bytes" if expected <= have else f"more than {have} bytes"
            raise ProtocolError(f"$.data: {have} bytes do not match shape {_shape_text(shape)} of {self.dtype} ({claim})")
        if self.dtype == "bool" and have and bytes(self.data).translate(None, b"\x00\x01"):
            # torch reads a bool byte as 0 or 1 and leaves any other value undefined in its kernels.
            raise ProtocolError("$.data: a bool tensor's bytes must each be 0 or 1")
        return self

    @classmethod
    def from_torch(cls, tensor: Any) -> "Tensor":
        """Encode a torch tensor (moved to CPU, made contiguous). Needs torch only if you pass one."""
        import ctypes

        t = tensor.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in TENSOR_DTYPES:
            raise ProtocolError(f"unsupported tensor dtype {dtype!r}")
        nbytes = t.numel() * t.element_size()
        raw = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
        return cls(dtype=dtype, shape=tuple(t.shape), data=memoryview(_to_little_endian(raw, t.element_size())))

    @classmethod
    def from_numpy(cls, array: Any) -> "Tensor":
        """Encode a numpy array (converted to little-endian, C order)."""
        dtype = str(array.dtype)
        if dtype not in TENSOR_DTYPES:
            raise ProtocolError(f"unsupported array dtype {dtype!r}")
        arr = array.astype(array.dtype.newbyteorder("<"), copy=False)
        import numpy

        arr = numpy.ascontiguousarray(arr)
        return cls(dtype=dtype, shape=tuple(arr.shape), data=memoryview(arr).cast("B"))

    def to_torch(self) -> Any:
        """A torch tensor viewing ``data`` without copying (read-only memory: do not write in place)."""
        import importlib

        torch = importlib.import_module("torch")
        self.validate()
        dtype = getattr(torch, self.dtype)
        if len(self.data) == 0:
            try:
                return torch.empty(self.shape, dtype=dtype)
            except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
                # No elements, yet sizes whose strides overflow int64 ([0, 2**62, 2**62]).
                raise ProtocolError(f"$.shape: {_shape_text(self.shape)} is not a tensor torch can build: {str(exc)[:100]}") from None
        global _frombuffer_warned
        if _frombuffer_warned:
            flat = torch.frombuffer(self.data, dtype=dtype)
        else:
            import warnings

            with warnings.catch_warnings():
                # Read-only by design: the tensor views the received message without copying.
                # torch warns once per process; silence that one and skip the (costly) guard after.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(self.data, dtype=dtype)
            _frombuffer_warned = True
        if sys.byteorder != "little":  # pragma: no cover - wire order is little-endian
            flat = flat.byteswap()
        return flat.reshape(self.shape)


_frombuffer_warned = False


def _to_little_endian(raw: bytes, itemsize: int) -> bytes:
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    import array  # pragma: no cover

    arr = array.array({2: "H", 4: "I", 8: "Q"}[itemsize], raw)  # pragma: no cover
    arr.byteswap()  # pragma: no cover
    return arr.tobytes()  # pragma: no cover


class ErrorBody(msgspec.Struct, frozen=True):
    """Body of an error reply, JSON-encoded so any client and the `nats` CLI can read it."""

    code: str
    message: str
    request_id: str = ""


@dataclass(frozen=True)
class BatchInfo:
    """How a request was batched, read from the reply's headers."""

    batch_id: str
    batch_size: int
    queue_wait_ms: float
    model_loaded: bool
    model: str
    worker: str = ""
    trace_id: str = ""


# --- Encoders built once and reused -------------------------------------------------------------

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
_tensor_decoder = msgspec.msgpack.Decoder(Tensor)
# A structure of tensors: a map (names) or an array (positions); each tensor keeps its own encoding.
_tensors_decoder = msgspec.msgpack.Decoder(dict[str, Tensor] | list[Tensor])

MAX_STRUCTURED_TENSORS = 64  # inputs or outputs of one request; far above what models take (2-4)
MAX_TENSOR_NAME = 64
_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder()
_error_decoder = msgspec.json.Decoder(ErrorBody)


def encode_payload(obj: Any, content_type: ContentType | str | None = None) -> tuple[bytes, ContentType]:
    """Encode a request or result body and pick its content type.

    ``bytes`` are sent as they are (labelled ``content_type``, default octet-stream: a body the
    caller encoded itself), a :class:`Tensor` (or torch tensor, or numpy array) as the tensor
    encoding, anything else as msgpack unless ``content_type`` asks for JSON. Whatever cannot be
    encoded (an integer past 64 bits, a cycle, an object msgpack has no type for, a tensor on a
    device or in a layout that has no bytes) raises :class:`ProtocolError`, nothing else.
    """
    try:
        ctype = ContentType(content_type) if content_type is not None else None
    except ValueError:
        raise ProtocolError(f"unsupported content type {str(content_type)[:128]!r}; expected one of {[c.value for c in ContentType]}") from None
    if isinstance(obj, (bytes, bytearray, memoryview)):
        # Bytes with an explicit content type are a body the caller already encoded.
        return bytes(obj), ctype or ContentType.BYTES
    try:
        tensor = _as_tensor(obj)
        if tensor is not None and ctype in (None, ContentType.TENSOR):
            return _msgpack_encoder.encode(tensor), ContentType.TENSOR
        tensors = _as_tensors(obj)
        if tensors is not None and ctype in (None, ContentType.TENSORS):
            return _msgpack_encoder.encode(tensors), ContentType.TENSORS
        if ctype is ContentType.JSON:
            return _json_encoder.encode(obj), ContentType.JSON
        return _msgpack_encoder.encode(obj), ContentType.MSGPACK
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("cannot encode payload: nested too deep, or it contains itself") from None
    except (TypeError, ValueError, OverflowError, RuntimeError, msgspec.EncodeError) as exc:
        # msgspec's and torch's own refusals, all of them this payload's fault.
        kind = "JSON" if ctype is ContentType.JSON else "msgpack"
        raise ProtocolError(f"cannot encode payload as {kind}: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _as_tensor(obj: Any) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj
    module = type(obj).__module__
    if module.startswith("torch") and hasattr(obj, "data_ptr"):
        return Tensor.from_torch(obj)
    if module == "numpy" and type(obj).__name__ == "ndarray":
        return Tensor.from_numpy(obj)
    return None


def _as_tensors(obj: Any) -> dict[str, Tensor] | list[Tensor] | None:
    """A mapping of names to tensors, or a tuple of tensors, as the structured encoding (None for
    anything else: a list stays a list of values, msgpack or JSON)."""
    if isinstance(obj, tuple) and obj:
        items = [_as_tensor(v) for v in obj]
        return items if all(t is not None for t in items) else None  # type: ignore[return-value]
    if isinstance(obj, Mapping) and obj and all(isinstance(k, str) for k in obj):
        named = {k: _as_tensor(v) for k, v in obj.items()}
        return named if all(t is not None for t in named.values()) else None  # type: ignore[return-value]
    return None


def _checked_tensors(value: dict[str, Tensor] | list[Tensor]) -> dict[str, Tensor] | tuple[Tensor, ...]:
    if not value or len(value) > MAX_STRUCTURED_TENSORS:
        raise ProtocolError(f"a tensors payload holds 1 to {MAX_STRUCTURED_TENSORS} tensors, got {len(value)}")
    if isinstance(value, dict):
        for name, tensor in value.items():
            if not name or len(name) > MAX_TENSOR_NAME or not name.isidentifier():
                raise ProtocolError(f"tensor name {name[:MAX_TENSOR_NAME]!r}: a Python identifier of at most {MAX_TENSOR_NAME} characters")
            tensor.validate()
        return value
    for tensor in value:
        tensor.validate()
    return tuple(value)


def decode_payload(data: bytes, content_type: str | None) -> Any:
    """Decode a body by its content type; raise :class:`ProtocolError` naming what is wrong."""
    ctype = (content_type or ContentType.BYTES.value).split(";")[0].strip().lower()
    try:
        if ctype == ContentType.BYTES.value:
            return data
        if ctype == ContentType.TENSOR.value:
            return _tensor_decoder.decode(data).validate()
        if ctype == ContentType.TENSORS.value:
            return _checked_tensors(_tensors_decoder.decode(data))
        if ctype == ContentType.MSGPACK.value:
            return _msgpack_decoder.decode(data)
        if ctype == ContentType.JSON.value:
            return _json_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable {ctype} payload: {exc}") from exc
    except RecursionError:
        # msgspec's own limit on nesting: a deep payload is this request's fault, not its batch's.
        raise ProtocolError(f"undecodable {ctype} payload: nested too deep") from None
    except ProtocolError:
        raise  # a ValueError too: already names what is wrong
    except (ValueError, TypeError, OverflowError) as exc:
        # Not expected (the decoders and Tensor.validate raise the errors above), but a body is
        # hostile input: whatever it makes fail is this payload's fault, named as such.
        raise ProtocolError(f"undecodable {ctype} payload: {type(exc).__name__}: {str(exc)[:100]}") from None
    raise ProtocolError(f"unsupported content type {content_type!r}; expected one of {[c.value for c in ContentType]}")


def encode_error(code: ErrorCode, message: str, request_id: str = "") -> bytes:
    return _json_encoder.encode(ErrorBody(code=code.value, message=message, request_id=request_id))


# What of an error body's message a reader keeps: far above what a sidecar writes (its messages
# are bounded where they are made), so only a forged body is cut.
MAX_ERROR_MESSAGE = 4096


def decode_error(data: bytes) -> ErrorBody:
    try:
        body = _error_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return ErrorBody(code=ErrorCode.INTERNAL.value, message=data[:200].decode("utf-8", "replace"))
    if len(body.message) > MAX_ERROR_MESSAGE or len(body.code) > 64 or len(body.request_id) > 256:
        return ErrorBody(code=body.code[:64], message=body.message[:MAX_ERROR_MESSAGE] + " [cut]", request_id=body.request_id[:256])
    return body


def deadline_header(timeout_s: float, now: float | None = None) -> str:
    """Header value for a deadline ``timeout_s`` seconds from now."""
    return str(int(((time.time() if now is None else now) + timeout_s) * 1000))


MAX_BATCH_HEADER_BYTES = 512  # far above the longest value a worker writes (about 120)


def batch_header(batch_id: str, size: int, queue_wait_ms: float, loaded: bool, worker: str, trace_id: str = "") -> str:
    """The value of the ``Jetbatch-Batch`` reply header (protocol 2)."""
    return batch_header_of(batch_id, size, loaded, worker, trace_id)(queue_wait_ms)


def batch_header_of(batch_id: str, size: int, loaded: bool, worker: str, trace_id: str = "") -> Callable[[float], str]:
    """:func:`batch_header` for one batch, as a function of each request's queue wait: what the
    batch's requests share is formatted once (a worker sets the header on every answer)."""
    head = f"id={batch_id};size={size};wait_ms="
    tail = f";loaded={1 if loaded else 0};worker={worker}" + (f";trace={trace_id}" if trace_id else "")
    return lambda queue_wait_ms: f"{head}{queue_wait_ms:.3f}{tail}"


def batch_info_from_headers(headers: Mapping[str, str] | None) -> BatchInfo:
    """Read the batch metadata a worker puts on every reply: the ``Jetbatch-Batch`` header, or the
    six headers of protocol 1 from an older worker. Never raises: a malformed or oversized value
    gives defaults (the answer itself is still good)."""
    h = headers or {}
    fields: dict[str, str] = {}
    compact = h.get(Headers.BATCH)
    if isinstance(compact, str) and len(compact) <= MAX_BATCH_HEADER_BYTES:
        for part in compact.split(";"):
            key, _, value = part.partition("=")
            fields[key.strip()] = value.strip()
    elif compact is None:
        legacy = {
            "id": Headers.BATCH_ID, "size": Headers.BATCH_SIZE, "wait_ms": Headers.QUEUE_WAIT_MS,
            "loaded": Headers.MODEL_LOADED, "worker": Headers.WORKER, "trace": Headers.TRACE_ID,
        }  # fmt: skip
        fields = {key: h[name] for key, name in legacy.items() if isinstance(h.get(name), str)}

    def num(key: str, cast: Any, default: Any) -> Any:
        try:
            value = cast(fields[key])
        except (KeyError, TypeError, ValueError, OverflowError):
            return default
        return value if value == value and abs(value) != float("inf") else default  # no NaN or infinities

    return BatchInfo(
        batch_id=fields.get("id", "")[:64],
        batch_size=num("size", int, 0),
        queue_wait_ms=num("wait_ms", float, 0.0),
        model_loaded=fields.get("loaded", "").lower() in ("1", "true"),
        model=str(h.get(Headers.MODEL, ""))[:64],
        worker=fields.get("worker", "")[:128],
        trace_id=fields.get("trace", "")[:32],
    )


def error_headers(code: ErrorCode, request_id: str, model: str | None = None) -> dict[str, str]:
    """The headers of an error reply (the body is :func:`encode_error`)."""
    headers = {
        Headers.STATUS: Status.ERROR.value,
        Headers.ERROR_CODE: code.value,
        Headers.REQUEST_ID: request_id,
        Headers.CONTENT_TYPE: ContentType.JSON.value,
    }
    if model:
        headers[Headers.MODEL] = model
    return headers

