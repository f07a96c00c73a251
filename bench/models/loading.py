"""What a model switch costs from each tier, for a model of 100+ MB in each format, through the
worker's own handlers: cold (the file dropped from the page cache, then read and deserialised),
warm (its weights already in host memory: the worker's warm tier) and resident (nothing to do).
On a CUDA device it also measures host-to-device bandwidth from pinned and pageable memory, and
how much of the pinned bandwidth a warm reload reaches. Run:

    python -m bench.models.loading [--rounds 5] [--hidden 4096] [--device auto|cpu|cuda]
    python -m bench.models.loading --first-load [--rounds 5]   # the first load in a fresh process, with and without the warm start
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from jetbatch.sidecar.config import ModelConfig
from jetbatch.sidecar.handlers import create_handler, resolve_device

from bench import harness


class Big(torch.nn.Module):
    """Two square layers: ~134 MB of float32 weights at hidden=4096."""

    def __init__(self, hidden: int = 4096) -> None:
        super().__init__()
        self.a = torch.nn.Linear(hidden, hidden)
        self.b = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_formats(directory: Path, hidden: int) -> dict[str, ModelConfig]:
    import warnings

    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Big(hidden).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.export.save(torch.export.export(model, (torch.zeros(2, hidden),), dynamic_shapes=({0: batch},)), str(directory / "big.pt2"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "big.safetensors"))
    torch.save(model.state_dict(), directory / "big.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(model), str(directory / "big.ts"))
    cls = {"module_class": "__main__:Big", "module_kwargs": {"hidden": hidden}}
    return {
        "export": ModelConfig(handler="export", path=str(directory / "big.pt2")),
        "state_dict (safetensors)": ModelConfig(handler="state_dict", path=str(directory / "big.safetensors"), **cls),
        "state_dict (torch.save)": ModelConfig(handler="state_dict", path=str(directory / "big.pth"), **cls),
        "torchscript": ModelConfig(handler="torchscript", path=str(directory / "big.ts")),
    }


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(cfg: ModelConfig, device: torch.device, rounds: int, example: Any, files: list[Path] | None = None) -> dict[str, float]:
    """Switch time = load + the first batch (of ``example``: a memory-mapped file is only read
    when the first batch touches its pages, so a load alone would flatter the cold tier). Cold:
    ``files`` (default: the model's file) dropped from the page cache first."""
    cold, warm, resident = [], [], []
    size = 0
    for _ in range(rounds):
        for f in files or [Path(cfg.path or "")]:
            drop_from_page_cache(f)
        h = create_handler("big", cfg)
        h.target_device = device

        def switch() -> None:
            h.load(device)
            h.predict([example])

        cold.append(timed(switch))
        size = h.memory_bytes()
        resident.append(timed(switch))  # already resident: only the batch
        h.offload()  # → warm: the worker's warm tier
        warm.append(timed(switch))
        h.unload()
    return {
        "model_mb": round(size / 1e6, 1),
        "cold_s": statistics.median(cold),
        "warm_s": statistics.median(warm),
        "resident_s": statistics.median(resident),
        "warm_over_cold": statistics.median(warm) / statistics.median(cold),
    } | (
        # The copy alone: the warm switch minus the batch a resident model runs anyway.
        {"warm_gb_per_s": size / max(statistics.median(warm) - statistics.median(resident), 1e-9) / 1e9}
        if device.type == "cuda" else {}
    )


def measure_transformers(directory: Path, device: torch.device, rounds: int) -> dict[str, float]:
    """The `transformers` handler on a ~90 MB BERT-shaped directory (random weights from a config,
    with a tokenizer): switch time cold / warm / resident, the first batch (one text) included."""
    import transformers

    from examples.huggingface.build import WORDS

    transformers.utils.logging.disable_progress_bar()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS] + [f"w{i}" for i in range(8000)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048, num_labels=3)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(directory)
    cfg = ModelConfig(handler="transformers", path=str(directory))
    return measure(cfg, device, rounds, "the movie was good", files=list(directory.glob("*.safetensors")))


def bandwidth(device: torch.device, nbytes: int, rounds: int) -> dict[str, float]:
    """Host-to-device copy bandwidth from pinned and pageable memory (CUDA only)."""
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    out = {}
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        times = []
        for _ in range(rounds):
            times.append(timed(lambda: src.to(device, non_blocking=True)))
        out[f"{name}_gb_per_s"] = nbytes / statistics.median(times) / 1e9
    return out


_FIRST_LOAD = """
import json, sys, time
import torch
from jetbatch.sidecar.config import ModelConfig
from jetbatch.sidecar.handlers import create_handler
from jetbatch.sidecar.handlers.modules import warm_start
path, warm = sys.argv[1], sys.argv[2] == "warm"
started = time.perf_counter()
if warm:
    warm_start({"export"})
startup = time.perf_counter() - started
loads = []
for name in ("first", "second"):
    h = create_handler(name, ModelConfig(handler="export", path=path))
    h.check()
    t = time.perf_counter()
    h.load(torch.device("cpu"))
    loads.append(time.perf_counter() - t)
print(json.dumps({"startup_s": startup, "first_load_s": loads[0], "second_load_s": loads[1]}))
"""


def first_load(rounds: int) -> dict[str, Any]:
    """A fresh process's first .pt2 load, with and without the worker's warm start, alternating
    (each in its own process: torch's set-up happens once per process)."""
    import json
    import subprocess
    import sys

    from jetbatch.sidecar.dev.example_models import ExampleMLP, export_program

    out: dict[str, list[dict[str, float]]] = {"cold_start": [], "warm_start": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.pt2"
        torch.manual_seed(0)
        export_program(ExampleMLP(hidden=256, classes=3), path)
        for _ in range(rounds):
            for mode, key in (("cold", "cold_start"), ("warm", "warm_start")):
                proc = subprocess.run([sys.executable, "-c", _FIRST_LOAD, str(path), mode], capture_output=True, text=True, check=True)
                out[key].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {
        key: {field: statistics.median(r[field] for r in runs) for field in ("startup_s", "first_load_s", "second_load_s")}
        for key, runs in out.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    parser.add_argument("--first-load", action="store_true", help="only: a fresh process's first .pt2 load, with and without the warm start")
    args = parser.parse_args()
    if args.first_load:
        harness.emit({"bench": "first_load", "torch": torch.__version__, **first_load(args.rounds)}, args.json)
        return
    device = resolve_device(args.device)
    report: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        report["device_name"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in write_formats(Path(tmp), args.hidden).items():
            report[name] = measure(cfg, device, args.rounds, torch.zeros(args.hidden))
        try:
            import transformers  # noqa: F401
        except ImportError:
            pass  # pip install 'jetbatch[hf]' to measure the transformers handler too
        else:
            report["transformers (save_pretrained directory)"] = measure_transformers(Path(tmp) / "hf", device, args.rounds)
    if device.type == "cuda":
        bw = bandwidth(device, 256 * 1024 * 1024, args.rounds)
        report["host_to_device"] = bw
        for name in ("export", "state_dict (safetensors)", "state_dict (torch.save)", "torchscript"):
            report[name]["warm_share_of_pinned_bandwidth"] = report[name]["warm_gb_per_s"] / bw["pinned_gb_per_s"]
    harness.emit(report, args.json)


if __name__ == "__main__":
    main()
