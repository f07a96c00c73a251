"""The SDK's exception tree: one root, :class:`JetbatchError`, with structured fields."""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "ClientClosed",
    "ConnectionFailed",
    "DeadlineExceeded",
    "InternalError",
    "JetbatchError",
    "ModelFailed",
    "Overloaded",
    "PayloadTooLarge",
    "RequestTimeout",
    "StreamNotFound",
    "UnknownModel",
    "error_for_code",
]


class JetbatchError(Exception):
    """Root of every jetbatch error, the SDK's and the sidecars'. ``code`` is the wire error code
    where one applies (the values of ``sdk.protocol.ErrorCode``)."""

    code: str = "internal"

    def __init__(self, message: str, *, request_id: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.message} (request {self.request_id})" if self.request_id else self.message


class ConnectionFailed(JetbatchError):
    """The NATS server could not be reached, or the connection was lost."""


class ClientClosed(ConnectionFailed):
    """The client was closed: make a new one to send more requests."""


class StreamNotFound(JetbatchError):
    """No jetbatch stream exists for that subject: no sidecar has set up this server yet."""


class RequestTimeout(JetbatchError, TimeoutError):
    """No reply arrived within the timeout. Subclasses TimeoutError so either catch works."""


class BadRequest(JetbatchError, ValueError):
    """The request was rejected as malformed (garbled payload, bad header, bad model name)."""

    code = "bad_request"


class PayloadTooLarge(BadRequest):
    """The payload is over the server's or the stream's maximum message size."""


class UnknownModel(JetbatchError):
    """No model of that name is served (or the classifier chose a label mapped to no model)."""

    code = "unknown_model"


class DeadlineExceeded(JetbatchError):
    """The request's deadline passed before it was computed; it was not run."""

    code = "deadline_exceeded"


class Cancelled(JetbatchError):
    """The caller cancelled the request before it was computed; it was not run. A caller that
    cancelled is gone, so this is what a retry under the same request id finds in the store."""

    code = "cancelled"


class ModelFailed(JetbatchError):
    """The model's handler raised while serving this request."""

    code = "model_failed"


class Overloaded(JetbatchError):
    """The queue is full (the stream refused the message) or the sidecar shed the request."""

    code = "overloaded"


class InternalError(JetbatchError):
    """The sidecar failed in a way that is not the request's fault."""

    code = "internal"


_BY_CODE: dict[str, type[JetbatchError]] = {
    "bad_request": BadRequest,
    "unknown_model": UnknownModel,
    "deadline_exceeded": DeadlineExceeded,
    "cancelled": Cancelled,
    "model_failed": ModelFailed,
    "overloaded": Overloaded,
    "internal": InternalError,
}


def error_for_code(code: str, message: str, request_id: str = "") -> JetbatchError:
    """Build the typed exception for a wire error code (unknown codes become InternalError)."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(message, request_id=request_id, code=code)
