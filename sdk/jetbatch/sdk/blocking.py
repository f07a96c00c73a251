"""A blocking facade over :class:`sdk.Client` for applications that are not async."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, Iterable, Mapping, Sequence, TypeVar

from .client import Client, Result
from .errors import ClientClosed
from .protocol import DEFAULT_PREFIX, ContentType, Priority

__all__ = ["BlockingClient"]

T = TypeVar("T")


class BlockingClient:
    """Runs a :class:`Client` on a private event loop in a background thread.

    ``with BlockingClient.connect(url) as client: client.infer(x, model="m1")``. Safe to call from
    many threads at once: every call is scheduled on the one loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: Client) -> None:
        self._loop = loop
        self._thread = thread
        self._client = client

    @classmethod
    def connect(
        cls, url: str | Sequence[str] | None = None, *, prefix: str = DEFAULT_PREFIX, **options: Any
    ) -> "BlockingClient":
        """Connect, raising the same typed errors as :meth:`Client.connect`."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="jetbatch-sdk", daemon=True)
        thread.start()
        try:
            async def opened() -> Client:
                return await Client.connect(url, prefix=prefix, **options)

            client = asyncio.run_coroutine_threadsafe(opened(), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            loop.close()
            raise
        return cls(loop, thread, client)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise ClientClosed("client is closed")
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def infer(
        self,
        payload: Any,
        *,
        model: str | None = None,
        timeout: float = 30.0,
        content_type: ContentType | str | None = None,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> Any:
        """Blocking :meth:`Client.infer`."""
        return self._run(
            self._client.infer(
                payload, model=model, timeout=timeout, content_type=content_type, request_id=request_id, headers=headers, priority=priority
            )
        )

    def infer_result(self, payload: Any, *, model: str | None = None, timeout: float = 30.0, **kw: Any) -> Result:
        """Blocking :meth:`Client.infer_result`."""
        return self._run(self._client.infer_result(payload, model=model, timeout=timeout, **kw))

    def infer_many(self, payloads: Iterable[Any], *, model: str | None = None, timeout: float = 30.0, **kw: Any) -> list[Any]:
        """Blocking :meth:`Client.infer_many`."""
        return self._run(self._client.infer_many(list(payloads), model=model, timeout=timeout, **kw))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    def __enter__(self) -> "BlockingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
