"""The jetbatch wire contract, shared by the SDK and the sidecar (``jetbatch.sdk.protocol``).

Everything a client in another language needs lives here and in docs/protocol.md: subject names,
header names, error codes and payload encodings. This module must import without torch or the
sidecar; tensors are described by :class:`Tensor` (dtype, shape, raw little-endian bytes).

Parts: :mod:`.names` (subjects, headers, codes), :mod:`.payloads` (encodings, error bodies,
batch metadata), :mod:`.requests` (header limits, the reply policy), :mod:`.reports` (what a
sidecar reports).
"""

from .names import (
    DEFAULT_PREFIX,
    JS_MSG_TOO_BIG,
    JS_STREAM_FULL,
    ContentType,
    ErrorCode,
    Headers,
    Priority,
    ProtocolError,
    Status,
    Subjects,
    subject_matches,
    validate_model_name,
    validate_token,
)
from .payloads import (
    TENSOR_DTYPES,
    BatchInfo,
    ErrorBody,
    Tensor,
    batch_header,
    batch_info_from_headers,
    deadline_header,
    decode_error,
    decode_payload,
    encode_error,
    encode_payload,
    error_headers,
)
from .reports import SidecarReport
from .requests import (
    DEFAULT_REPLY_PREFIXES,
    DEFAULT_TENANT_REPLY_PREFIX,
    MAX_REPLY_SUBJECT_BYTES,
    ReplyPolicy,
    RequestMeta,
    deadline_from_headers,
    dedupe_id,
    forwardable_headers,
    header_bytes,
    message_bytes,
    new_request_id,
    parse_request_headers,
    request_id_of,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_REPLY_PREFIXES",
    "DEFAULT_TENANT_REPLY_PREFIX",
    "JS_MSG_TOO_BIG",
    "JS_STREAM_FULL",
    "MAX_REPLY_SUBJECT_BYTES",
    "TENSOR_DTYPES",
    "BatchInfo",
    "ContentType",
    "ErrorBody",
    "ErrorCode",
    "Headers",
    "ProtocolError",
    "ReplyPolicy",
    "RequestMeta",
    "SidecarReport",
    "Priority",
    "Status",
    "Subjects",
    "Tensor",
    "batch_header",
    "batch_info_from_headers",
    "deadline_from_headers",
    "dedupe_id",
    "deadline_header",
    "decode_error",
    "decode_payload",
    "encode_error",
    "encode_payload",
    "error_headers",
    "forwardable_headers",
    "header_bytes",
    "message_bytes",
    "new_request_id",
    "parse_request_headers",
    "request_id_of",
    "subject_matches",
    "validate_model_name",
    "validate_token",
]
