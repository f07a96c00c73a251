"""The wire contract: round trips (hypothesis), validation, and typed errors for bad bodies."""

from __future__ import annotations

import msgspec
import nats.aio.client as nats_client
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetbatch.sdk.protocol import (
    Priority,
    BatchInfo,
    ContentType,
    ErrorCode,
    Headers,
    ProtocolError,
    Subjects,
    Tensor,
    batch_header,
    forwardable_headers,
    batch_info_from_headers,
    deadline_from_headers,
    decode_error,
    decode_payload,
    encode_error,
    encode_payload,
    subject_matches,
    unwritable_header_names,
    validate_model_name,
    validate_tenant,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(json_values)
def test_msgpack_and_json_round_trip(value: object) -> None:
    for ctype in (ContentType.MSGPACK, ContentType.JSON):
        data, used = encode_payload(value, ctype)
        assert used is ctype
        assert decode_payload(data, used.value) == value


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=256))
def test_bytes_round_trip(value: bytes) -> None:
    data, used = encode_payload(value)
    assert used is ContentType.BYTES
    assert decode_payload(data, used.value) == value


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3))
def test_tensor_round_trip(dtype: torch.dtype, shape: list[int]) -> None:
    source = (torch.arange(int(torch.tensor(shape).prod().item()) if shape else 1) % 7).to(dtype).reshape(shape)
    data, used = encode_payload(source)
    assert used is ContentType.TENSOR
    decoded = decode_payload(data, used.value)
    assert isinstance(decoded, Tensor)
    back = decoded.to_torch()
    assert back.dtype == dtype and list(back.shape) == shape
    assert torch.equal(back, source)


def test_tensor_decode_does_not_copy() -> None:
    import ctypes

    data, _ = encode_payload(torch.arange(1024, dtype=torch.float32))
    decoded = decode_payload(data, ContentType.TENSOR.value)
    assert decoded.data.obj is data  # msgspec gives a view into the received message
    t = decoded.to_torch()
    # torch.frombuffer wraps that memory: the tensor's first element lies inside the message bytes.
    msg_start = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    assert msg_start <= t.data_ptr() < msg_start + len(data)
    assert torch.equal(t, torch.arange(1024, dtype=torch.float32))


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=128), st.sampled_from([c.value for c in ContentType] + ["text/plain", "", "application/x-unknown"]))
def test_random_bytes_decode_or_raise_protocol_error(data: bytes, ctype: str) -> None:
    try:
        decode_payload(data, ctype)
    except ProtocolError:
        pass  # the only acceptable failure: it becomes a bad_request reply


def test_tensor_shape_and_length_disagree() -> None:
    body = msgspec.msgpack.encode({"dtype": "float32", "shape": [2, 3], "data": b"\x00" * 20})
    with pytest.raises(ProtocolError, match="do not match shape"):
        decode_payload(body, ContentType.TENSOR.value)
    body = msgspec.msgpack.encode({"dtype": "complex64", "shape": [1], "data": b"\x00" * 8})
    with pytest.raises(ProtocolError, match="unsupported tensor dtype"):
        decode_payload(body, ContentType.TENSOR.value)
    body = msgspec.msgpack.encode({"dtype": "float32", "shape": "nope", "data": b""})
    with pytest.raises(ProtocolError, match=r"\$\.shape"):
        decode_payload(body, ContentType.TENSOR.value)


def _tensor_body(shape: list[int], data: bytes = b"", dtype: str = "float32") -> bytes:
    return msgspec.msgpack.encode({"dtype": dtype, "shape": shape, "data": data})


def test_a_tensor_shape_is_bounded_before_its_product() -> None:
    """Found by an attack: the element count was the product of every dimension as an unbounded
    integer, quadratic in their number (80 000 dimensions of 2**64 - 1, a 720 KB body, held a
    worker's event loop 13 s), and past 4 300 digits printing it in the error raised ValueError,
    not ProtocolError (a classifier batch failed whole, the SDK raised an untyped error). Now:
    at most 64 dimensions, each below 2**63, the count never carried past the data's length,
    and every message short."""
    huge = 2**64 - 1
    for shape, match in (
        ([huge] * 80_000, "80000 dimensions, at most 64"),
        ([huge] * 300, "300 dimensions, at most 64"),
        ([2, 2**63], r"dimension 9223372036854775808 out of range"),
        ([2**62] * 64, r"more than 0 bytes"),
        ([3, 2**40], r"\$\.data: 8 bytes do not match shape \[3, 1099511627776\] of float32 \(more than 8 bytes\)"),
    ):
        with pytest.raises(ProtocolError, match=match) as caught:
            decode_payload(_tensor_body(shape, b"\x00" * (8 if shape[0] == 3 else 0)), ContentType.TENSOR.value)
        assert len(str(caught.value)) < 400
    for ctype in (ContentType.TENSORS.value,):
        with pytest.raises(ProtocolError, match="at most 64"):
            decode_payload(msgspec.msgpack.encode([{"dtype": "float32", "shape": [huge] * 300, "data": b""}]), ctype)
    # No elements, so the data agrees; but torch cannot lay out sizes whose strides overflow.
    empty = decode_payload(_tensor_body([0] + [2**62] * 2), ContentType.TENSOR.value)
    with pytest.raises(ProtocolError, match="not a tensor torch can build"):
        empty.to_torch()
    assert decode_payload(_tensor_body([1] * 64, b"\x00" * 4), ContentType.TENSOR.value).to_torch().dim() == 64


def test_a_bool_tensor_holds_only_zeros_and_ones() -> None:
    """torch leaves a bool byte other than 0 or 1 undefined in its kernels."""
    assert decode_payload(_tensor_body([2], b"\x00\x01", "bool"), ContentType.TENSOR.value).to_torch().tolist() == [False, True]
    with pytest.raises(ProtocolError, match="bool"):
        decode_payload(_tensor_body([2], b"\x02\xff", "bool"), ContentType.TENSOR.value)


@given(
    shape=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 4), max_size=8) | st.lists(st.integers(1, 2**64 - 1), min_size=60, max_size=400),
    data=st.binary(max_size=64),
    dtype=st.sampled_from(["float32", "int8", "bool", "float64"]),
)
@settings(max_examples=300, deadline=None)
def test_crafted_tensor_bodies_decode_or_raise_a_short_protocol_error(shape: list[int], data: bytes, dtype: str) -> None:
    """Whatever shape a body claims: a tensor whose data matches it, or a ProtocolError with a
    short message (the only failure a worker, a router or the SDK answers per request)."""
    try:
        tensor = decode_payload(_tensor_body(shape, data, dtype), ContentType.TENSOR.value)
    except ProtocolError as exc:
        assert len(str(exc)) < 400
        return
    count = 1
    for dim in shape:
        count *= dim
    assert len(shape) <= 64 and count * {"float32": 4, "int8": 1, "bool": 1, "float64": 8}[dtype] == len(data)
    assert tensor.shape == tuple(shape) and bytes(tensor.data) == data


def test_an_error_body_is_read_with_limits() -> None:
    """A forged error answer cannot hand a caller a megabyte of message."""
    body = decode_error(msgspec.json.encode({"code": "internal", "message": "x" * 1_000_000, "request_id": "r" * 10_000}))
    assert body.code == "internal" and len(body.message) < 4200 and len(body.request_id) <= 256
    assert decode_error(encode_error(ErrorCode.BAD_REQUEST, "short", "r1")) == decode_error(encode_error(ErrorCode.BAD_REQUEST, "short", "r1"))
    assert decode_error(encode_error(ErrorCode.BAD_REQUEST, "short", "r1")).message == "short"


@pytest.mark.parametrize("name", ["m1", "resnet-50", "A_b-9"])
def test_valid_model_names(name: str) -> None:
    assert validate_model_name(name) == name


@pytest.mark.parametrize("name", ["a.b", "a b", "*", ">", "m>", "", "x" * 65, "mé"])
def test_invalid_model_names(name: str) -> None:
    with pytest.raises(ProtocolError):
        validate_model_name(name)


def test_subjects_and_streams() -> None:
    s = Subjects("acme.jb")
    assert s.ingress == "acme.jb.in"
    assert s.model("m1") == "acme.jb.model.m1"
    assert s.model_from_subject("acme.jb.model.m1") == "m1"
    assert s.models_stream == "ACME_JB_MODELS"
    with pytest.raises(ProtocolError):
        Subjects("bad prefix")


def test_error_body_round_trip_and_garbage() -> None:
    body = decode_error(encode_error(ErrorCode.UNKNOWN_MODEL, "no such model", "r1"))
    assert (body.code, body.message, body.request_id) == ("unknown_model", "no such model", "r1")
    assert decode_error(b"\xff not json").code == "internal"


def test_deadline_header() -> None:
    assert deadline_from_headers({Headers.DEADLINE: "1500"}) == 1.5
    assert deadline_from_headers({}) is None
    with pytest.raises(ProtocolError, match=Headers.DEADLINE):
        deadline_from_headers({Headers.DEADLINE: "soon"})


def test_batch_info_tolerates_missing_and_bad_headers() -> None:
    info = batch_info_from_headers({Headers.BATCH_SIZE: "x", Headers.MODEL_LOADED: "TRUE", Headers.BATCH_ID: "b"})
    assert info.batch_size == 0 and info.model_loaded is True and info.batch_id == "b"


def test_batch_header_round_trip() -> None:
    value = batch_header("3f2a9c1d0b7e4a12", 64, 2.4171, True, "gpu-1-4711", "4bf92f3577b34da6a3ce929d0e0e4736")
    assert value == "id=3f2a9c1d0b7e4a12;size=64;wait_ms=2.417;loaded=1;worker=gpu-1-4711;trace=4bf92f3577b34da6a3ce929d0e0e4736"
    info = batch_info_from_headers({Headers.BATCH: value, Headers.MODEL: "m1"})
    assert info == BatchInfo("3f2a9c1d0b7e4a12", 64, 2.417, True, "m1", "gpu-1-4711", "4bf92f3577b34da6a3ce929d0e0e4736")
    untraced = batch_info_from_headers({Headers.BATCH: batch_header("b", 1, 0.0, False, "w")})
    assert (untraced.trace_id, untraced.model_loaded, untraced.batch_size) == ("", False, 1)


def test_batch_info_reads_the_six_headers_of_protocol_1() -> None:
    info = batch_info_from_headers(
        {
            "Jetbatch-Batch-Id": "b1", "Jetbatch-Batch-Size": "3", "Jetbatch-Queue-Wait-Ms": "1.5",
            "Jetbatch-Model-Loaded": "true", "Jetbatch-Worker": "w", "Jetbatch-Trace-Id": "t", Headers.MODEL: "m",
        }  # fmt: skip
    )
    assert info == BatchInfo("b1", 3, 1.5, True, "m", "w", "t")


def test_batch_info_ignores_unknown_fields_and_bad_values() -> None:
    info = batch_info_from_headers({Headers.BATCH: "id=b;size=NaN;wait_ms=inf;loaded=yes;future=1;;=;worker"})
    assert (info.batch_id, info.batch_size, info.queue_wait_ms, info.model_loaded, info.worker) == ("b", 0, 0.0, False, "")
    assert batch_info_from_headers({Headers.BATCH: "id=b;" + "x" * 600}).batch_id == ""  # over the length limit


@given(st.dictionaries(st.sampled_from([Headers.BATCH, Headers.MODEL, "Jetbatch-Batch-Size", "Jetbatch-Queue-Wait-Ms"]), st.text(max_size=700)))
def test_batch_info_never_raises(headers: dict[str, str]) -> None:
    info = batch_info_from_headers(headers)
    assert len(info.batch_id) <= 64 and len(info.trace_id) <= 32


def _reply_allowed_by_the_rules(subject: str, allowed: tuple[str, ...], forbidden: tuple[str, ...]) -> bool:
    """The reply policy as docs/security.md states it, token by token."""
    if not subject or len(subject.encode()) > 255 or any(not ("!" <= c <= "~") for c in subject):
        return False
    tokens = subject.split(".")
    if any(not t or "*" in t or ">" in t for t in tokens) or subject.startswith("$"):
        return False
    if any(tokens[: len(f.split("."))] == f.split(".") for f in forbidden):
        return False
    if any(t.startswith("_jbs") for t in tokens[1:]):  # a sidecar's own inbox
        return False
    return any(tokens[: len(p.split("."))] == p.split(".") and len(tokens) > len(p.split(".")) for p in allowed)


@settings(max_examples=400)
@given(
    st.lists(st.sampled_from(["_INBOX", "a", "b", "jetbatch", "$JS", "API", "*", ">", "", "x y", "é", "ok-1", "_INBOXa", "_jbs", "_jbs0f"]), min_size=1, max_size=5).map(".".join)
    | st.text(alphabet="_INBOXjetbach.*>$ a1é-", max_size=40)
)
def test_reply_policy_follows_its_rules_for_any_subject(subject: str) -> None:
    from jetbatch.sdk.protocol import ReplyPolicy

    policy = ReplyPolicy(allowed_prefixes=("_INBOX", "a.b"), forbidden_prefixes=("jetbatch",))
    try:
        policy.check(subject)
        accepted = True
    except ProtocolError:
        accepted = False
    assert accepted == _reply_allowed_by_the_rules(subject, ("_INBOX", "a.b"), ("jetbatch",))


def test_forwardable_headers_drop_every_nats_header_whatever_its_case() -> None:
    """What a sidecar copies from a request onto its own publish: never a header the server acts on."""
    request = {
        Headers.MSG_ID: "r1", "Nats-Expected-Stream": "X", "nats-rollup": "all", "NATS-TTL": "1s",
        Headers.REPLY_TO: "_INBOX.a.r1", Headers.DEADLINE: "1700000000000", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        "X-App": "kept", "Natsy": "kept too",
    }  # fmt: skip
    assert forwardable_headers(request) == {
        Headers.REPLY_TO: "_INBOX.a.r1", Headers.DEADLINE: "1700000000000", "traceparent": request["traceparent"], "X-App": "kept", "Natsy": "kept too",
    }  # fmt: skip
    assert forwardable_headers(None) == {}


@given(
    st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True), st.lists(st.integers(0, 4), max_size=2), min_size=1, max_size=4),
    st.booleans(),
)
def test_structured_tensors_round_trip(shapes: dict[str, list[int]], as_tuple: bool) -> None:
    """A mapping of named tensors (or a tuple) in, the same structure out, each tensor intact."""
    tensors = {name: torch.arange(int(torch.tensor(shape).prod().item()) if shape else 1, dtype=torch.float32).reshape(shape) for name, shape in shapes.items()}
    value = tuple(tensors.values()) if as_tuple else tensors
    body, ctype = encode_payload(value)
    assert ctype is ContentType.TENSORS
    out = decode_payload(body, ctype.value)
    if as_tuple:
        assert isinstance(out, tuple) and [t.to_torch().tolist() for t in out] == [t.tolist() for t in tensors.values()]
    else:
        assert isinstance(out, dict) and {k: v.to_torch().tolist() for k, v in out.items()} == {k: v.tolist() for k, v in tensors.items()}


def test_structured_tensors_are_checked_with_limits() -> None:
    one = Tensor.from_torch(torch.zeros(1))
    for bad, why in [
        ({}, "1 to 64 tensors"),
        ({f"t{i}": one for i in range(65)}, "1 to 64 tensors"),
        ({"not an identifier": one}, "a Python identifier"),
        ({"x" * 65: one}, "a Python identifier of at most 64"),
        ({"x": {"dtype": "float32", "shape": [2], "data": b"\0" * 4}}, "do not match shape"),
        ([{"dtype": "complex64", "shape": [1], "data": b"\0" * 8}], "unsupported tensor dtype"),
        ({"x": 3}, "undecodable"),
    ]:
        with pytest.raises(ProtocolError, match=why):
            decode_payload(msgspec.msgpack.encode(bad), ContentType.TENSORS.value)
    # A list stays a list of values (msgpack), never read as tensors; a mapping with a non-tensor
    # value stays msgpack too.
    assert encode_payload([torch.zeros(1).tolist()])[1] is ContentType.MSGPACK
    assert encode_payload({"a": 1})[1] is ContentType.MSGPACK


_tokens = st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z")


@given(_tokens, _tokens, _tokens)
def test_a_tenants_dedupe_id_gives_back_its_request_id_and_no_other_tenants(tenant: str, other: str, rid: str) -> None:
    from jetbatch.sdk.protocol import ReplyPolicy, dedupe_id, parse_request_headers, request_id_of

    msg_id = dedupe_id(tenant, rid)
    assert request_id_of(msg_id, tenant) == rid and dedupe_id(None, rid) == rid
    meta = parse_request_headers({"Nats-Msg-Id": msg_id}, policy=ReplyPolicy(), tenant=tenant, fallback_id="fb")
    assert (meta.request_id, meta.problem) == (rid, None)
    if other != tenant:
        # Another tenant's prefix is not taken off: the dot makes it no request id.
        forged = parse_request_headers({"Nats-Msg-Id": msg_id}, policy=ReplyPolicy(), tenant=other, fallback_id="fb")
        assert forged.request_id == "fb" and forged.problem is not None


def test_queue_and_cancel_subjects_name_their_model_class_and_tenant() -> None:
    s = Subjects("jb")
    assert s.queue_from_subject(s.model("m-1", "batch")) == ("m-1", Priority.BATCH)
    assert s.queue_from_subject(s.model("m-1")) == ("m-1", Priority.INTERACTIVE)
    assert s.queue_from_arrival(s.arrived("m", "batch")) == ("m", Priority.BATCH)
    assert s.queue_from_subject("jb.in") is None
    assert (s.tenant_from_cancel(s.cancel()), s.tenant_from_cancel(s.cancel("t1"))) == ((True, None), (True, "t1"))
    assert s.tenant_from_cancel("jb.cancel.a.b") == (False, None) and s.tenant_from_cancel("jb.cancelx") == (False, None)
    with pytest.raises(ValueError):
        s.model("m", "urgent")


def test_answer_subjects_put_the_tenant_first_and_never_a_wildcard_from_the_caller() -> None:
    """Protocol 3: one subject per answer, ``<prefix>.result.<tenant or _>.<key>.<id>``; a client
    subscribes to its key's, a lookup from another process filters over keys within the tenant,
    and ``_`` (no tenant) can never be a tenant's name, so no tenant's permission covers it."""
    s = Subjects("jb")
    assert s.answer("r1", "k1") == "jb.result._.k1.r1" and s.answer("r1", "k1", "app1") == "jb.result.app1.k1.r1"
    assert subject_matches(s.answers("k1", "app1"), s.answer("r1", "k1", "app1"))
    assert not subject_matches(s.answers("k1", "app1"), s.answer("r1", "k2", "app1"))
    assert subject_matches(s.answer_anywhere("r1", "app1"), s.answer("r1", "k2", "app1"))
    assert not subject_matches(s.answer_anywhere("r1", "app1"), s.answer("r1", "k2", "app2"))
    assert not subject_matches("jb.result.app1.>", s.answer("r1", "app1"))  # a key named like a tenant
    for bad in ("*", ">", "a.b", "", "k\n"):
        with pytest.raises(ProtocolError):
            s.answer("r1", bad)
        with pytest.raises(ProtocolError):
            s.answers(bad)
    with pytest.raises(ProtocolError, match="reserved"):
        validate_tenant("_")
    with pytest.raises(ProtocolError):
        s.answer("r1", "k1", "_")
    assert s.tenant_from_subject("jb.in._") is None and s.tenant_from_subject("jb.in.app1") == "app1"


def test_a_fresh_request_id_is_one_token_of_32_hex_characters_and_never_repeats() -> None:
    from jetbatch.sdk.protocol import new_request_id, validate_token

    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") and validate_token(i, "id") == i for i in ids)


def test_a_body_nested_too_deep_is_a_protocol_error_and_an_error_body_falls_back() -> None:
    """msgspec raises RecursionError past its nesting limit: a typed ProtocolError for a payload
    (the SDK then raises JetbatchError, not RecursionError), a fallback body for an error."""
    from jetbatch.sdk.protocol import decode_error, decode_payload

    for data, ctype in ((b"\x91" * 100_000 + b"\xc0", "application/msgpack"), (b"[" * 100_000 + b"]" * 100_000, "application/json")):
        with pytest.raises(ProtocolError, match="nested too deep"):
            decode_payload(data, ctype)
    body = decode_error(b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"code":"bad_request"}')
    assert body.code == ErrorCode.INTERNAL.value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12) | st.sampled_from(["a(b", "Jetbatch-Reply-To", " X-A ", "é", "a b", "", "  ", "x:y", "Nats-Msg-Id"]))
def test_unwritable_header_names_are_those_nats_py_refuses(name: str) -> None:
    """A sidecar copying a producer's headers drops the names nats-py would refuse the publish
    for (a dead letter's copy was lost to one): the same rule as nats-py's own."""
    key = name.strip()
    refused = bool(key) and nats_client._HEADER_KEY_RE.fullmatch(key) is None
    assert unwritable_header_names({name: "v"}) == ([name] if refused else [])
