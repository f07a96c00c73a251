"""What reading the next model's weights ahead (while another model computes) saves at switch time.

A TorchScript model of about 130 MB is loaded through the worker's TorchScript handler two ways,
alternating, in one run: cold (the file dropped from the page cache with posix_fadvise, then
`load()` reads and deserialises it), and prefetched (`read_weights()` first, as the worker does
during the previous model's batches, then `load()`, which is what the switch pays). Run:

    python bench/prefetch.py [--rounds 5] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.config import ModelConfig  # noqa: E402
from sidecar.handlers import TorchScriptHandler  # noqa: E402


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.pt"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, args.hidden))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(torch.jit.script(model), str(path))
        size_mb = path.stat().st_size / 1e6
        cfg = ModelConfig(handler="torchscript", path=str(path))
        cold, read, switch = [], [], []
        for _ in range(args.rounds):
            drop_from_page_cache(path)
            h = TorchScriptHandler("big", cfg)
            t = time.perf_counter()
            h.load(torch.device("cpu"))
            cold.append(time.perf_counter() - t)
            h.unload()

            drop_from_page_cache(path)
            h = TorchScriptHandler("big", cfg)
            t = time.perf_counter()
            h.read_weights()  # overlapped with the previous model's compute in the worker
            read.append(time.perf_counter() - t)
            t = time.perf_counter()
            h.load(torch.device("cpu"))
            switch.append(time.perf_counter() - t)
            h.unload()
    out = {
        "model_mb": round(size_mb, 1),
        "cold_load_s_median": statistics.median(cold),
        "prefetched_switch_s_median": statistics.median(switch),
        "read_ahead_s_median": statistics.median(read),
        "switch_time_ratio": statistics.median(switch) / statistics.median(cold),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
