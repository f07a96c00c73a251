"""On a CUDA device (skipped without one): real models loaded and unloaded, device memory back to
its baseline, a warm reload cheaper than a cold one, and the [m1, m2, m1, m2, m1, m2] case."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from jetbatch import sdk
from jetbatch.sidecar.config import ModelConfig
from jetbatch.sidecar.dev.example_models import ExampleMLP, export_program
from jetbatch.sidecar.handlers import create_handler
from tests.helpers import make_config, running_worker, wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def big_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpu") / "big.pt2"
    torch.manual_seed(0)
    export_program(ExampleMLP(2048, 8), path)  # ~17 MB of weights
    return path


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated(DEVICE))


def test_load_and_unload_return_device_memory_to_its_baseline(big_export: Path) -> None:
    baseline = _allocated()
    h = create_handler("big", ModelConfig(handler="export", path=str(big_export)))
    h.target_device = DEVICE
    h.load(DEVICE)
    assert h.memory_bytes() > 10_000_000  # measured by the allocator, not estimated
    out = h.predict([torch.zeros(16)])[0]
    assert out.shape == (8,)
    h.offload()
    assert _allocated() == baseline  # warm: the weights left the device
    assert h.warm and all(t.is_pinned() for t in h._host_tensors.values())  # pinned host copy
    h.load(DEVICE)
    h.unload()
    assert _allocated() == baseline


def test_warm_reload_is_cheaper_than_cold(big_export: Path) -> None:
    import time

    h = create_handler("big", ModelConfig(handler="export", path=str(big_export)))
    h.target_device = DEVICE
    started = time.perf_counter()
    h.load(DEVICE)
    cold_s = time.perf_counter() - started
    h.offload()
    started = time.perf_counter()
    h.load(DEVICE)
    warm_s = time.perf_counter() - started
    h.unload()
    assert warm_s < cold_s


@pytest.mark.anyio
async def test_interleaved_requests_become_one_batch_per_model_on_the_device(nats_url: str, prefix: str, big_export: Path) -> None:
    model: dict[str, Any] = {"handler": "export", "path": str(big_export), "max_batch_size": 3, "max_delay_ms": 50, "load_cost_s": 0.5}
    config = make_config(prefix, {"m1": model, "m2": dict(model)}, worker={"max_resident_models": 1, "device": "cuda"})
    order = ["m1", "m2", "m1", "m2", "m1", "m2"]
    from tests.test_worker_scheduling import _prepare_streams, _queued

    await _prepare_streams(config, nats_url)
    results: list[sdk.Result] = []
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:

        async def send(m: str) -> None:
            results.append(await client.infer_result(torch.zeros(16), model=m, timeout=60))

        async with anyio.create_task_group() as tg:
            for m in order:
                tg.start_soon(send, m)
            await _queued(client, len(order))
            async with running_worker(config, nats_url) as worker:
                await wait_until(lambda: len(results) == len(order), timeout_s=60, what="all replies")
    assert len({r.batch.batch_id for r in results}) == 2
    assert worker.stats["loads"] == 2


@pytest.mark.anyio
async def test_the_hugging_face_example_on_cuda(tmp_path: Path, nats_url: str, prefix: str) -> None:
    """examples/huggingface's model served by a worker on the CUDA device: the same logits as the
    model run on the CPU here."""
    pytest.importorskip("transformers")
    import transformers

    from examples.huggingface.build import build

    directory = build(tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    reference = transformers.BertForSequenceClassification.from_pretrained(str(directory), local_files_only=True).eval()
    texts = ["a great movie", "this film was not good at all"]
    config = make_config(prefix, {"sentiment": {"handler": "transformers", "path": str(directory)}}, worker={"device": "cuda"})
    async with running_worker(config, nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            outs = [await client.infer(t, model="sentiment", timeout=60) for t in texts]
    for text, out in zip(texts, outs):
        with torch.inference_mode():
            want = reference(**tokenizer(text, return_tensors="pt")).logits[0]
        torch.testing.assert_close(out["logits"].to_torch(), want, atol=1e-4, rtol=1e-3)


@pytest.mark.anyio
async def test_idle_unload_gives_the_device_memory_back(big_export: Path, nats_url: str, prefix: str) -> None:
    """A model idle past its idle_unload_s is evicted: torch.cuda.memory_allocated back to its
    value before the load, within the limit and one turn of the loop."""
    baseline = _allocated()
    config = make_config(prefix, {"big": {"handler": "export", "path": str(big_export), "idle_unload_s": 0.5}}, worker={"device": "cuda"})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(torch.zeros(16), model="big", timeout=60)
        assert _allocated() > baseline
        await wait_until(lambda: "big" not in worker.residency.resident_names(), timeout_s=10)
        assert _allocated() == baseline
