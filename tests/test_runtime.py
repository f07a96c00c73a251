"""sidecar/runtime.py: what running a sidecar process adds around the sidecar itself."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

from jetbatch.sdk.connection import connect_nats, stopped_reading
from jetbatch.sidecar.runtime import freeze_start_up_heap, liveness


class _Cyclic(torch.nn.Module):
    """A model whose module graph holds a reference cycle (as hooks and some exported programs do)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.me = [self]


def test_the_start_up_heap_is_frozen_and_models_loaded_after_it_are_still_freed() -> None:
    """A full cyclic collection walked every object the start-up made (torch and the rest): a
    65-80 ms stop of a worker's loop. They are frozen out of its reach before the sidecar runs;
    a model loaded afterwards, cycles and all, is still freed once evicted."""
    gc.unfreeze()
    try:
        freeze_start_up_heap()
        assert gc.get_freeze_count() > 0
        model = _Cyclic()  # loaded after start-up
        weight = weakref.ref(model.linear.weight)
        del model  # evicted: only the cycle keeps it
        gc.collect()
        assert weight() is None
    finally:
        gc.unfreeze()  # the test process keeps collecting as before


@pytest.mark.anyio
async def test_a_connection_whose_read_loop_ended_is_not_alive(nats_url: str) -> None:
    """nats-py ends its read loop on an error it does not expect and never restarts it, while the
    connection still says "connected": such a sidecar reads nothing again, and only a restart
    brings it back, so /healthz fails (the loop's end is made here by cancelling its task)."""
    nc = await connect_nats(nats_url)
    replies = await connect_nats(nats_url)
    try:
        assert liveness(None) == (True, "alive")  # not connected yet
        assert liveness(nc, replies) == (True, "alive") and not stopped_reading(nc)
        replies._reading_task.cancel()
        await asyncio.wait_for(replies._reading_task, 5)  # nats-py's loop ends on a cancel as on any error: it breaks
        assert replies.is_connected and stopped_reading(replies)
        assert liveness(nc, replies) == (False, "NATS reply connection stopped reading (its read loop ended)")
        assert liveness(nc) == (True, "alive")
    finally:
        await replies.close()
        await nc.close()
    assert liveness(nc) == (False, "NATS connection closed")
