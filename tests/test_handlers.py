"""Model formats end to end through NATS (export, state_dict from safetensors and torch.save,
function, legacy torchscript), the warm tier, measured memory, an out-of-memory load and a model
file missing at startup."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import logging
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from jetbatch import sdk
from jetbatch.sidecar.config import ModelConfig
from jetbatch.sidecar.dev.example_models import ExampleMLP, export_program
from jetbatch.sidecar.handlers import BadInput, ExportHandler, HandlerError, StateDictHandler, create_handler
from jetbatch.sidecar.handlers.base import Handler
from tests.helpers import make_config, running_worker, wait_until, worker_reports

pytestmark = pytest.mark.anyio
DIM = 16


def _model(seed: int = 0, hidden: int = 32, classes: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ExampleMLP(hidden, classes).eval()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("formats")
    m = _model()
    export_program(m, d / "m.pt2")
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(d / "m.safetensors"))
    torch.save(m.state_dict(), d / "m.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated upstream: building a legacy file
        torch.jit.save(torch.jit.script(m), str(d / "m.ts"))
    x = torch.randn(4, DIM)
    with torch.inference_mode():
        expected = m(x)
    return {"dir": d, "x": x, "expected": expected}


def _configs(d: Path) -> dict[str, dict[str, Any]]:
    cls = {"module_class": "jetbatch.sidecar.dev.example_models:ExampleMLP", "module_kwargs": {"hidden": 32, "classes": 3}}
    return {
        "exp": {"handler": "export", "path": str(d / "m.pt2")},
        "safe": {"handler": "state_dict", "path": str(d / "m.safetensors"), **cls, "options": {"input_shape": [DIM]}},
        "pickled": {"handler": "state_dict", "path": str(d / "m.pth"), **cls},
        "legacy": {"handler": "torchscript", "path": str(d / "m.ts")},
        "fn": {"handler": "function", "function": "tests.fault_handlers:double_all"},
    }


async def test_every_format_serves_a_real_model_through_nats(nats_url: str, prefix: str, model_files: dict[str, Any]) -> None:
    models = {name: {**cfg, "max_batch_size": 8, "max_delay_ms": 20} for name, cfg in _configs(model_files["dir"]).items()}
    config = make_config(prefix, models, worker={"max_resident_models": 2})
    x, expected = model_files["x"], model_files["expected"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # jetbatch's own paths stay quiet, torchscript included
        async with running_worker(config, nats_url):
            async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                for name in ("exp", "safe", "pickled", "legacy"):
                    outs = await asyncio.gather(*(client.infer_result(x[i], model=name, timeout=30) for i in range(4)))
                    got = torch.stack([o.output.to_torch() for o in outs])
                    assert torch.allclose(got, expected, atol=1e-5), name
                    assert max(o.batch.batch_size for o in outs) > 1  # one forward pass for several requests
                assert await client.infer([1, 2, 3], model="fn", timeout=30) == [2, 4, 6]
                # The exported program knows its input shape: a wrong one is bad_request, named.
                with pytest.raises(sdk.BadRequest, match=r"shape \[16\].*got shape \[15\]"):
                    await client.infer(torch.zeros(15), model="exp", timeout=30)
                with pytest.raises(sdk.BadRequest, match=r"shape \[16\]"):
                    await client.infer(torch.zeros(3, 3), model="safe", timeout=30)


def test_state_dict_loads_without_allocating_twice(model_files: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Built on the meta device, weights assigned: the module's tensors are the loaded ones
    (no second, randomly initialised copy is allocated and then overwritten)."""
    loaded: list[dict[str, torch.Tensor]] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        assert kwargs.get("weights_only") is True and kwargs.get("mmap") is True  # no pickle code, mapped
        state = real_load(*args, **kwargs)
        loaded.append(state)
        return state

    monkeypatch.setattr(torch, "load", spy)
    cfg = ModelConfig(
        handler="state_dict", path=str(model_files["dir"] / "m.pth"),
        module_class="jetbatch.sidecar.dev.example_models:ExampleMLP", module_kwargs={"hidden": 32, "classes": 3},
    )  # fmt: skip
    h = create_handler("m", cfg)
    assert isinstance(h, StateDictHandler)
    h.load(torch.device("cpu"))
    weight = h._host.net[0].weight
    assert not weight.is_meta and h.memory_bytes() == sum(t.numel() * 4 for t in _model().state_dict().values())
    assert weight.data_ptr() == loaded[0]["net.0.weight"].data_ptr()  # the loaded tensor itself


def test_warm_tier_keeps_weights_in_host_memory_and_reload_is_cheaper(model_files: dict[str, Any]) -> None:
    h = ExportHandler("m", ModelConfig(handler="export", path=str(model_files["dir"] / "m.pt2")))
    assert not h.warm
    h.load(torch.device("cpu"))
    module = h._host
    h.offload()
    assert h.warm and h.host_bytes() > 0 and h.memory_bytes() == 0
    h.load(torch.device("cpu"))
    assert h._host is module  # a warm reload reuses the host copy: no disk read, no deserialisation
    h.unload()
    assert not h.warm and h.host_bytes() == 0


@pytest.mark.parametrize("name", ["exp", "safe", "pickled"])
def test_several_tensors_for_a_model_of_one_input_are_a_bad_request(model_files: dict[str, Any], name: str) -> None:
    """Found by an attack: two tensors sent to a model that takes one were answered
    ``model_failed`` (the forward pass raised), so a producer's mistake read as a model bug. A
    module known to take one tensor (an exported program with one input, a ``forward(x)``, a
    declared ``input_shape``) refuses them as ``bad_request``; one tensor, alone or in a tuple of
    one, is still its input."""
    h = create_handler(name, msgspec.convert(_configs(model_files["dir"])[name], ModelConfig))
    h.load(torch.device("cpu"))
    x = model_files["x"][0]
    two, ctype = sdk.protocol.encode_payload((x, x))
    with pytest.raises(BadInput, match="takes one tensor"):
        h.decode(two, ctype.value)
    named, ctype = sdk.protocol.encode_payload({"x": x, "y": x})
    with pytest.raises(BadInput, match="takes one tensor"):
        h.decode(named, ctype.value)
    one, ctype = sdk.protocol.encode_payload((x,))
    assert isinstance(h.decode(one, ctype.value), tuple)
    h.unload()


def test_missing_or_unreadable_file_is_a_handler_error(tmp_path: Path) -> None:
    h = create_handler("m", ModelConfig(handler="export", path=str(tmp_path / "nope.pt2")))
    with pytest.raises(HandlerError, match="not found"):
        h.check()
    (tmp_path / "bad.pt2").write_bytes(b"not a program")
    h = create_handler("m", ModelConfig(handler="export", path=str(tmp_path / "bad.pt2")))
    with pytest.raises(HandlerError, match="cannot load"):
        h.load(torch.device("cpu"))


def test_handler_input_checks() -> None:
    h = create_handler("m", ModelConfig(handler="state_dict", path="x", module_class="jetbatch.sidecar.dev.example_models:ExampleMLP", module_kwargs={"hidden": 4, "classes": 2}))
    with pytest.raises(BadInput, match="floating-point"):
        h.decode(sdk.protocol.encode_payload(torch.zeros(3, dtype=torch.int64))[0], sdk.ContentType.TENSOR.value)
    with pytest.raises(HandlerError, match="module_class"):
        create_handler("m", ModelConfig(handler="state_dict", path="x"))
    with pytest.raises(HandlerError, match="not a torch.nn.Module"):
        create_handler("m", ModelConfig(handler="state_dict", path="x", module_class="jetbatch.sdk:Client"))
    # The class to subclass is named by its one import name.
    with pytest.raises(HandlerError, match=r"not a subclass of jetbatch\.sidecar\.handlers\.Handler"):
        create_handler("m", ModelConfig(handler="jetbatch.sdk:Client", path="x"))


async def test_missing_model_file_is_reported_at_startup_and_answered(nats_url: str, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    models = {"gone": {"handler": "export", "path": str(tmp_path / "gone.pt2")}, "ok": {"handler": "identity"}}
    config = make_config(prefix, models, worker={"max_resident_models": 2})
    with caplog.at_level(logging.ERROR, logger="jetbatch.worker"):
        async with running_worker(config, nats_url) as worker:
            # The operator's log names the file in full, at startup, in one line.
            assert any(f"{tmp_path / 'gone.pt2'} not found" in r.getMessage() for r in caplog.records)
            reports = await worker_reports(nats_url, prefix)
            assert reports[0].broken["gone"] == "file gone.pt2 not found"
            # /readyz's detail names the model once.
            assert worker.problems() == ["model gone: file gone.pt2 not found"]
            async with sdk.Client.connect(nats_url, prefix=prefix) as client:
                with pytest.raises(sdk.ModelFailed, match="gone.pt2 not found") as info:
                    await client.infer(torch.zeros(DIM), model="gone", timeout=20)
                assert str(tmp_path) not in str(info.value)  # no server path reaches a caller
                assert await client.infer(b"still", model="ok", timeout=20) == b"still"


class OomOnceWhileOthersResident(Handler):
    """Raises CUDA-style out-of-memory when another model is loaded beside it (first try only)."""

    others_resident: list[str] = []

    def load(self, device: torch.device) -> None:
        if self.options.get("oom") == "always" or (self.options.get("oom") == "crowded" and OomOnceWhileOthersResident.others_resident):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        OomOnceWhileOthersResident.others_resident.append(self.name)

    def unload(self) -> None:
        if self.name in OomOnceWhileOthersResident.others_resident:
            OomOnceWhileOthersResident.others_resident.remove(self.name)

    def predict(self, inputs: list[Any]) -> list[Any]:
        return list(inputs)


async def test_out_of_memory_load_evicts_and_retries_once_then_fails_that_model_only(nats_url: str, prefix: str) -> None:
    OomOnceWhileOthersResident.others_resident = []
    h = "tests.test_handlers:OomOnceWhileOthersResident"
    models = {"small": {"handler": h}, "big": {"handler": h, "options": {"oom": "crowded"}}, "huge": {"handler": h, "options": {"oom": "always"}}}
    config = make_config(prefix, models, worker={"max_resident_models": 3})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            assert await client.infer(b"s", model="small", timeout=20) == b"s"
            assert await client.infer(b"b", model="big", timeout=20) == b"b"  # evicted "small", retried, loaded
            assert not worker.slots["small"].resident and worker.slots["big"].resident
            with pytest.raises(sdk.ModelFailed, match="out of memory"):
                await client.infer(b"h", model="huge", timeout=20)
            assert await client.infer(b"s2", model="small", timeout=20) == b"s2"  # the worker keeps serving


async def test_warm_tier_makes_a_switch_back_cheap_and_status_shows_tiers(nats_url: str, prefix: str) -> None:
    slow = {"handler": "sleep", "load_cost_s": 0.6, "memory_bytes": 1000, "max_delay_ms": 5,
            "options": {"load_cost_s": 0.6, "warm_load_cost_s": 0.05, "batch_cost_s": 0.0, "item_cost_s": 0.0}}  # fmt: skip
    config = make_config(prefix, {"a": slow, "b": slow}, worker={"max_resident_models": 1, "prefetch_weights": False})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"1", model="a", timeout=20)
            await client.infer(b"2", model="b", timeout=20)  # evicts a: a stays warm
            await wait_until(lambda: worker.slots["a"].tier == "warm", what="a warm")
            reports = await worker_reports(nats_url, prefix)
            assert reports[0].warm == ["a"] and reports[0].resident == ["b"]
            # The scheduler is told the warm cost (measured or the prior), not the cold one.
            assert worker.residency.load_cost_s(worker.slots["a"]) < 0.3
            result = await client.infer_result(b"3", model="a", timeout=20)
            assert result.batch.model_loaded
    assert worker.costs.load_cost_s("a", "warm") < 0.2 < worker.costs.load_cost_s("a", "cold")


async def test_without_a_host_budget_evicted_models_go_cold(nats_url: str, prefix: str) -> None:
    slow = {"handler": "sleep", "memory_bytes": 1000, "max_delay_ms": 5, "options": {"load_cost_s": 0.05}}
    config = make_config(prefix, {"a": slow, "b": slow}, worker={"host_memory_budget_bytes": 0})
    async with running_worker(config, nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer(b"1", model="a", timeout=20)
            await client.infer(b"2", model="b", timeout=20)
    assert worker.slots["a"].tier == "cold"


# --- structured inputs and outputs ------------------------------------------------------------


def _save(module: torch.nn.Module, path: Path) -> str:
    from safetensors.torch import save_file

    save_file(module.state_dict(), str(path))
    return str(path)


@pytest.mark.anyio
async def test_dict_outputs_come_back_as_mappings_of_tensors(nats_url: str, prefix: str, tmp_path: Path) -> None:
    """A model returning {"logits", "probs"} (as Hugging Face models do) is served by the
    state_dict and export handlers; the SDK gives back the same mapping, equal to the model run
    here."""
    from tests.structured_models import DictOut, build

    module = build(DictOut)
    program = torch.export.export(module, (torch.zeros(2, DIM),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, str(tmp_path / "dict.pt2"))
    models = {
        "sd": {"handler": "state_dict", "path": _save(module, tmp_path / "dict.safetensors"),
               "module_class": "tests.structured_models:DictOut", "options": {"input_shape": [DIM]}},
        "ex": {"handler": "export", "path": str(tmp_path / "dict.pt2")},
    }  # fmt: skip
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = module(x)
    async with running_worker(make_config(prefix, models, worker={"max_resident_models": 2}), nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            for model in ("sd", "ex"):
                outs = await asyncio.gather(*(client.infer(x[i], model=model, timeout=30) for i in range(5)))
                for i, out in enumerate(outs):
                    assert isinstance(out, dict) and set(out) == {"logits", "probs"}
                    for key in out:
                        torch.testing.assert_close(out[key].to_torch(), expected[key][i])


@pytest.mark.anyio
async def test_two_named_inputs_of_different_lengths_share_a_padded_pass(nats_url: str, prefix: str, tmp_path: Path) -> None:
    """Token ids and a mask of different lengths in one batch: padded to the longest, one forward
    pass, and each request's answer (a tuple) equals the model run on that request alone, the
    per-token output cut back to the request's own length."""
    from tests.structured_models import TwoInputs, build

    module = build(TwoInputs)
    models = {
        "text": {"handler": "state_dict", "path": _save(module, tmp_path / "two.safetensors"), "module_class": "tests.structured_models:TwoInputs",
                 "max_batch_size": 8, "max_delay_s": 0.2,
                 "options": {"pad": True, "inputs": {"input_ids": {"shape": [-1], "dtype": "int64"}, "attention_mask": {"shape": [-1], "dtype": "int64"}}}},
    }  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    requests = [torch.randint(1, 50, (n,), generator=gen) for n in (3, 7, 5)]
    async with running_worker(make_config(prefix, models), nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            await client.infer({"input_ids": requests[0], "attention_mask": torch.ones(3, dtype=torch.int64)}, model="text", timeout=30)  # loaded
            passes = TwoInputs.passes
            results = await asyncio.gather(
                *(client.infer_result({"input_ids": ids, "attention_mask": torch.ones(len(ids), dtype=torch.int64)}, model="text", timeout=30) for ids in requests)
            )
            with pytest.raises(sdk.BadRequest, match="tensor input_ids must be int64"):
                await client.infer({"input_ids": torch.zeros(3), "attention_mask": torch.ones(3, dtype=torch.int64)}, model="text", timeout=30)
            assert TwoInputs.passes - passes == 1  # the three lengths in one padded forward pass
    assert {(r.batch.batch_id, r.batch.batch_size) for r in results} == {(results[0].batch.batch_id, 3)}
    for ids, out in zip(requests, [r.output for r in results]):
        assert isinstance(out, tuple) and len(out) == 2
        with torch.inference_mode():
            pooled, tokens = module(ids.unsqueeze(0), torch.ones(1, len(ids), dtype=torch.int64))
        torch.testing.assert_close(out[0].to_torch(), pooled[0])
        torch.testing.assert_close(out[1].to_torch(), tokens[0])  # its own length, not the padded one


@pytest.mark.anyio
async def test_a_model_whose_output_cannot_be_served_is_refused_once_at_load(nats_url: str, prefix: str, tmp_path: Path) -> None:
    from tests.structured_models import NotTensors, build

    models = {
        "bad": {"handler": "state_dict", "path": _save(build(NotTensors), tmp_path / "bad.safetensors"),
                "module_class": "tests.structured_models:NotTensors", "options": {"input_shape": [DIM]}},
    }  # fmt: skip
    async with running_worker(make_config(prefix, models), nats_url) as worker:
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            with pytest.raises(sdk.ModelFailed, match="cannot be served: the model's output is a list of str: expected a tensor, a tuple or a mapping of tensors"):
                await client.infer(torch.zeros(DIM), model="bad", timeout=30)
        assert worker.stats["batches"] == 0  # refused at load, not per request


@pytest.mark.anyio
async def test_the_worker_pays_torchs_set_up_before_it_is_ready(nats_url: str, prefix: str, model_files: dict[str, Any]) -> None:
    """With export and torchscript models configured, torch's one-time set-up for those formats
    runs at start (counted in warm_start_us), so the first load is the model's own; with none,
    nothing runs."""
    from jetbatch.sidecar.handlers.modules import warm_start

    assert warm_start({"export", "torchscript", "identity"}) == {"export", "torchscript"}
    assert warm_start({"identity", "state_dict"}) == set()
    configs = _configs(model_files["dir"])
    async with running_worker(make_config(prefix, {"exp": configs["exp"], "legacy": configs["legacy"]}), nats_url) as worker:
        assert worker.stats["warm_start_us"] > 0  # before ready: running_worker returns once ready
    async with running_worker(make_config(f"{prefix}b", {"id": {"handler": "identity"}}), nats_url) as worker:
        assert worker.stats["warm_start_us"] == 0


@pytest.mark.anyio
async def test_every_handler_that_can_takes_several_inputs_and_returns_structures(nats_url: str, prefix: str, tmp_path: Path) -> None:
    """Two inputs in, a tuple out, through export (a program with a dynamic batch and sequence
    dimension), torchscript, and a function; each answer equals the model run here."""
    from tests.structured_models import TwoInputs, build

    module = build(TwoInputs)
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.int64)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    program = torch.export.export(module, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    torch.export.save(program, str(tmp_path / "two.pt2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated upstream: building a legacy file
        torch.jit.save(torch.jit.trace(module, (ids, mask)), str(tmp_path / "two.ts"))
    models = {
        "ex": {"handler": "export", "path": str(tmp_path / "two.pt2"), "options": {"pad": True}},
        "ts": {"handler": "torchscript", "path": str(tmp_path / "two.ts"), "options": {"pad": True}},
        "fn": {"handler": "function", "function": "tests.structured_models:pooled_and_tokens"},
    }
    requests = [torch.randint(1, 50, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 6)]
    async with running_worker(make_config(prefix, models, worker={"max_resident_models": 3}), nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            for model in ("ex", "ts", "fn"):
                outs = await asyncio.gather(
                    *(client.infer((r, torch.ones(len(r), dtype=torch.int64)), model=model, timeout=30) for r in requests)
                )
                for r, out in zip(requests, outs):
                    with torch.inference_mode():
                        pooled, tokens = module(r.unsqueeze(0), torch.ones(1, len(r), dtype=torch.int64))
                    assert isinstance(out, tuple), model
                    torch.testing.assert_close(out[0].to_torch(), pooled[0])
                    torch.testing.assert_close(out[1].to_torch(), tokens[0])


def _export_vector_and_features(tmp_path: Path) -> torch.nn.Module:
    """The docs' recipe for a model of several inputs, twice: positional inputs (``two.pt2``) and
    keyword ones (``kw.pt2``), one ``Dim`` for the batch shared by every input."""
    from tests.structured_models import VectorAndFeatures, build

    module = build(VectorAndFeatures)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(module, (torch.zeros(2, DIM), torch.zeros(2, 8)), dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, str(tmp_path / "two.pt2"))
    kwargs = {"features": torch.zeros(2, 8), "scale": torch.ones(2, 3)}
    program = torch.export.export(module, (torch.zeros(2, DIM),), kwargs, dynamic_shapes={"x": {0: batch}, "features": {0: batch}, "scale": {0: batch}})
    torch.export.save(program, str(tmp_path / "kw.pt2"))
    return module


@pytest.mark.anyio
async def test_an_export_of_two_inputs_is_served_as_the_module_runs_here(nats_url: str, prefix: str, tmp_path: Path) -> None:
    """Found by a new user: a two-input program exported as docs/handlers.md says failed every
    request (the load-time example was built from its first input only), and declaring
    ``options.inputs`` failed too (the program takes its inputs positionally, not by name). Now
    positional and keyword programs are served, a tuple or a mapping by name, each answer equal
    to the module run here, and a request that does not fit the program is ``bad_request``."""
    module = _export_vector_and_features(tmp_path)
    named = {"x": {"shape": [DIM], "dtype": "float32"}, "features": {"shape": [8], "dtype": "float32"}}
    models = {
        "pos": {"handler": "export", "path": str(tmp_path / "two.pt2")},
        "declared": {"handler": "export", "path": str(tmp_path / "two.pt2"), "options": {"inputs": named}},
        "kw": {"handler": "export", "path": str(tmp_path / "kw.pt2")},
    }
    models = {name: {**cfg, "max_batch_size": 8, "max_delay_ms": 50} for name, cfg in models.items()}
    gen = torch.Generator().manual_seed(7)
    x, f, s = torch.randn(4, DIM, generator=gen), torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
    with torch.inference_mode():
        plain, scaled = module(x, f), module(x, f, scale=s)
    requests: dict[str, list[Any]] = {
        "pos": [(x[i], f[i]) for i in range(4)],
        "declared": [{"x": x[i], "features": f[i]} for i in range(4)],
        "kw": [{"x": x[i], "features": f[i], "scale": s[i]} for i in range(4)],
    }
    async with running_worker(make_config(prefix, models, worker={"max_resident_models": 3}), nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            for model, expected in (("pos", plain), ("declared", plain), ("kw", scaled)):
                outs = await asyncio.gather(*(client.infer_result(r, model=model, timeout=30) for r in requests[model]))
                torch.testing.assert_close(torch.stack([o.output.to_torch() for o in outs]), expected)
                assert max(o.batch.batch_size for o in outs) > 1, model  # one forward pass for several requests
            # A positional program also takes its inputs by name; a float64 row is cast as for one input.
            out = await client.infer({"features": f[0].double(), "x": x[0]}, model="pos", timeout=30)
            torch.testing.assert_close(out.to_torch(), plain[0])
            with pytest.raises(sdk.BadRequest, match=r"takes the tensors \(x: float32 \[16\], features: float32 \[8\]\)"):
                await client.infer(x[0], model="pos", timeout=30)
            with pytest.raises(sdk.BadRequest, match=r"tensor features must have shape \[8\], got \[7\]"):
                await client.infer((x[0], torch.zeros(7)), model="pos", timeout=30)
            with pytest.raises(sdk.BadRequest, match=r"scale: float32 \[3\]\) by name, got a tuple"):
                await client.infer((x[0], f[0], s[0]), model="kw", timeout=30)
            with pytest.raises(sdk.BadRequest, match="tensor x must be float32, got int64"):
                await client.infer({"x": torch.zeros(DIM, dtype=torch.int64), "features": f[0], "scale": s[0]}, model="kw", timeout=30)


def test_an_export_with_a_dynamic_sequence_runs_its_load_time_check_within_its_range(tmp_path: Path) -> None:
    """A program whose second dimension is dynamic and bounded (``max=6``): the load-time example
    is a length the range allows, a request past the bound or with lengths that differ where
    the program shares one dimension is ``bad_request`` (not torch's guard as ``model_failed``)."""
    from tests.structured_models import TwoInputs, build

    module = build(TwoInputs)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=1, max=6)
    ids, mask = torch.ones(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.int64)
    program = torch.export.export(module, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    torch.export.save(program, str(tmp_path / "seq.pt2"))
    h = create_handler("m", ModelConfig(handler="export", path=str(tmp_path / "seq.pt2")))
    passes = TwoInputs.passes
    h.load(torch.device("cpu"))
    assert isinstance(h, ExportHandler) and h.signature is not None and TwoInputs.passes == passes  # the program, not the module, ran
    example = h._example()
    assert isinstance(example, tuple) and [t.shape[0] for t in example] == [6, 6]  # 8 clamped to the range

    def encode(value: Any) -> tuple[bytes, str]:
        data, ctype = sdk.protocol.encode_payload(value)
        return data, ctype.value
    with pytest.raises(BadInput, match=r"tensor input_ids's dimension 0 must be 1 to 6, got 7"):
        h.decode(*encode((torch.ones(7, dtype=torch.int64), torch.ones(7, dtype=torch.int64))))
    with pytest.raises(BadInput, match=r"attention_mask's dimension 0 \(4\) must equal input_ids's dimension 0 \(3\)"):
        h.decode(*encode((torch.ones(3, dtype=torch.int64), torch.ones(4, dtype=torch.int64))))
    r = torch.randint(1, 50, (4,), generator=torch.Generator().manual_seed(2))
    (got,) = h.predict([h.decode(*encode((r, torch.ones(4, dtype=torch.int64))))])
    with torch.inference_mode():
        pooled, tokens = module(r.unsqueeze(0), torch.ones(1, 4, dtype=torch.int64))
    torch.testing.assert_close(got[0], pooled[0])
    torch.testing.assert_close(got[1], tokens[0])


def test_a_model_refused_at_load_keeps_torchs_whole_message_on_one_bounded_line(tmp_path: Path) -> None:
    """Torch puts the useful part of many errors after their first line (the flatten error said
    only ``...exported input tree spec:``): the refusal keeps it, on one line, bounded."""
    from tests.structured_models import FailsInTwoLines, build

    cfg = ModelConfig(handler="state_dict", path=_save(build(FailsInTwoLines), tmp_path / "fails.safetensors"),
                      module_class="tests.structured_models:FailsInTwoLines", options={"input_shape": [DIM]})  # fmt: skip
    h = create_handler("m", cfg)
    with pytest.raises(HandlerError) as info:
        h.load(torch.device("cpu"))
    message = str(info.value)
    assert message.startswith("model m: cannot be served: Trying to run with exported input tree spec: the useful part xxx")
    assert "\n" not in message and len(message) <= 1100


def test_a_worker_of_sleeps_and_identities_never_imports_torch_nor_do_the_classifiers_modules() -> None:
    """``import torch`` costs seconds and about 500 MiB: a worker whose handlers do not use it
    (``Handler.uses_torch``) never imports it, nor does importing the classifier (only its torch
    router does); a function handler, a module format or a named device does (the device is
    checked then)."""
    from jetbatch.sidecar.handlers import models_use_torch

    script = (
        "import sys\n"
        "from jetbatch.sidecar.worker import Worker\n"
        "from jetbatch.sidecar.classifier import Classifier\n"
        "from tests.helpers import make_config, sleep_model\n"
        "config = make_config('p', {'m1': sleep_model(), 'm2': {'handler': 'identity'}})\n"
        "class Conn:\n"
        "    def jetstream(self, **kw): return None\n"
        "worker = Worker(config, Conn())\n"
        "assert worker.device == 'cpu', worker.device\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    sleep, function = ModelConfig(handler="sleep"), ModelConfig(handler="function", function="json:dumps")
    assert not models_use_torch({"a": sleep, "b": ModelConfig(handler="identity")}, "auto")
    assert models_use_torch({"a": sleep, "b": function}, "auto")
    assert models_use_torch({"a": sleep}, "cuda:0")  # a named device is checked, so torch is needed
    assert models_use_torch({"a": ModelConfig(handler="tests.fault_handlers:NoSuchHandler")}, "cpu")  # unknown: its error comes elsewhere
