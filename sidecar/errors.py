"""The sidecars' errors: one :class:`SidecarError` under the SDK's :class:`JetbatchError` root,
so ``except JetbatchError`` catches anything jetbatch raises. Each concept defines its own
subclass beside its code (``ConfigError`` in config, ``HandlerError`` in handlers, ...); the CLI
turns every one of them into one line and exit status 2."""

from __future__ import annotations

from jetbatch.sdk.errors import JetbatchError

__all__ = ["JetbatchError", "SidecarError"]


class SidecarError(JetbatchError):
    """Something a sidecar's operator can fix: configuration, a model file, the environment."""
