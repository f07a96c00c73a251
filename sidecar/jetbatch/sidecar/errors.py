"""The sidecars' errors: one :class:`SidecarError` under the SDK's :class:`JetbatchError` root,
so ``except JetbatchError`` catches anything jetbatch raises. Each concept defines its own
subclass beside its code (``ConfigError`` in config, ``HandlerError`` in handlers, ...); the CLI
turns every one of them into one line and exit status 2."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jetbatch.sdk import failures
from jetbatch.sdk.errors import JetbatchError
from jetbatch.sdk.failures import TRANSPORT_ERRORS

__all__ = ["TRANSPORT_ERRORS", "JetbatchError", "Pulled", "SidecarError", "pull", "unsubscribe_all"]

# TRANSPORT_ERRORS (re-exported): what a call to NATS or JetStream raises when the server, the
# connection or an election is in the way. Every NATS exception group lives in jetbatch.sdk.failures.


class SidecarError(JetbatchError):
    """Something a sidecar's operator can fix: configuration, a model file, the environment."""


@dataclass(frozen=True)
class Pulled:
    """What one pull from a consumer gave: messages (none when the wait ran out), or why not."""

    msgs: list[Any] = field(default_factory=list)
    closed: bool = False  # the connection is closed for good: the sidecar stops
    trouble: BaseException | None = None  # a reconnect or an election in the way: back off


async def pull(
    psub: Any,
    n: int,
    timeout_s: float,
    *,
    linger: int | None = None,
    stored_only: bool = False,
    fill: bool = False,
    hold_open_s: float | None = None,
) -> Pulled:
    """Fetch up to ``n`` messages within ``timeout_s``, the NATS errors mapped once for the
    worker's batcher and the classifier: a pull never raises. ``linger`` (a
    :class:`~sidecar.pulling.Puller` only): when nothing is stored, return once that many came.
    ``stored_only`` (a ``Puller`` only): what is stored now, without waiting for arrivals.
    ``fill`` (a ``Puller`` only): until ``n`` came or exactly ``timeout_s`` passed.
    ``hold_open_s`` (a ``Puller`` only): one request open that long, the fetch returning with
    what is stored or the first arrival within ``timeout_s`` (``Puller.fetch``); with ``fill``,
    the fill's request stays open that long, for the next window (``Puller.fill``)."""
    try:
        if fill:
            return Pulled(await psub.fill(n, timeout_s, open_s=hold_open_s))
        if hold_open_s is not None:
            return Pulled(await psub.fetch(batch=n, timeout=timeout_s, hold_open_s=hold_open_s))
        if stored_only:
            return Pulled(await psub.fetch(batch=n, timeout=timeout_s, stored_only=True))
        if linger is not None:
            return Pulled(await psub.fetch(batch=n, timeout=timeout_s, linger=linger))
        return Pulled(await psub.fetch(batch=n, timeout=timeout_s))
    except failures.TIMEOUTS:
        return Pulled()
    except failures.CLOSED:
        return Pulled(closed=True)
    except TRANSPORT_ERRORS + (SidecarError,) as exc:  # SidecarError: pulling.PullError, a status
        return Pulled(trouble=exc)


async def unsubscribe_all(*subs: Any) -> None:
    """Unsubscribe each of ``subs`` (None is skipped) whatever the connection answers: on a stop, or
    a subscription given up, a closed or cut connection has nothing left to take back."""
    for sub in subs:
        if sub is None:
            continue
        try:
            await sub.unsubscribe()
        except TRANSPORT_ERRORS + (ValueError,):
            pass
