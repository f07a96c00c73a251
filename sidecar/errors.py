"""The sidecars' errors: one :class:`SidecarError` under the SDK's :class:`JetbatchError` root,
so ``except JetbatchError`` catches anything jetbatch raises. Each concept defines its own
subclass beside its code (``ConfigError`` in config, ``HandlerError`` in handlers, ...); the CLI
turns every one of them into one line and exit status 2."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors

from jetbatch.sdk.errors import JetbatchError

__all__ = ["TRANSPORT_ERRORS", "JetbatchError", "SidecarError"]

# What a call to NATS or JetStream raises when the server, the connection or an election is in
# the way (not a bug of ours): the one tuple the sidecars catch such failures with.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, TimeoutError)


class SidecarError(JetbatchError):
    """Something a sidecar's operator can fix: configuration, a model file, the environment."""
