"""sidecar/runtime.py: what running a sidecar process adds around the sidecar itself."""

from __future__ import annotations

import gc
import weakref

import torch

from jetbatch.sidecar.runtime import freeze_start_up_heap


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
