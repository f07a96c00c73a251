"""sidecar/runtime.py: what running a sidecar process adds around the sidecar itself."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import anyio
import pytest

from jetbatch.sidecar.runtime import _freeze_when_ready

pytestmark = pytest.mark.anyio


async def test_a_sidecar_freezes_its_start_up_heap_once_ready_not_before() -> None:
    """A full cyclic collection walked every object the start-up made (torch and the rest): a
    65-75 ms stop of a worker's loop. Once ready, they are frozen out of its reach."""
    gc.unfreeze()
    sidecar = SimpleNamespace(ready=anyio.Event())
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_freeze_when_ready, sidecar)
            await anyio.wait_all_tasks_blocked()
            assert gc.get_freeze_count() == 0  # still starting: nothing frozen
            sidecar.ready.set()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the test process keeps collecting as before
