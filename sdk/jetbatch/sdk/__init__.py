"""jetbatch SDK (``from jetbatch import sdk``): submit inference requests to jetbatch sidecars
over NATS JetStream.

Needs only nats-py, msgspec and opentelemetry-api: no torch, no sidecar.

    async with Client.connect("nats://127.0.0.1:4222") as client:
        output = await client.infer(payload, model="m1")
"""

from .blocking import BlockingClient
from .client import Client, Result
from .errors import (
    BadRequest,
    Cancelled,
    ClientClosed,
    ConnectionFailed,
    DeadlineExceeded,
    InternalError,
    JetbatchError,
    ModelFailed,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    StreamNotFound,
    UnknownModel,
)
from .protocol import BatchInfo, ContentType, ErrorCode, Headers, Priority, Subjects, Tensor

__all__ = [
    "BadRequest",
    "BatchInfo",
    "BlockingClient",
    "Cancelled",
    "Client",
    "ClientClosed",
    "ConnectionFailed",
    "ContentType",
    "DeadlineExceeded",
    "ErrorCode",
    "Headers",
    "InternalError",
    "JetbatchError",
    "ModelFailed",
    "Overloaded",
    "PayloadTooLarge",
    "Priority",
    "RequestTimeout",
    "Result",
    "StreamNotFound",
    "Subjects",
    "Tensor",
    "UnknownModel",
]

__version__ = "0.2.0"  # the distribution's one version string (hatch reads it here)
