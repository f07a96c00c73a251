"""Idle unload on the CPU: how soon a model with no traffic goes, and what it gives back.

One worker in this process on the example models (``jetbatch examples build``, real ``torch.export``
programs, no warm tier, so an eviction releases the parameters), ``idle_unload_s`` on every model.
Each round sends one request to ``--model``, then watches the worker until the model is evicted:
the delay from the answer to the eviction, against ``idle_unload_s`` + one poll interval (the
target), and the parameter bytes the model held while resident and after.

    python -m bench.models.idle_unload [--model topic] [--idle-unload-s 1.0] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from jetbatch import sdk
from jetbatch.sidecar.config import load_config
from jetbatch.sidecar.dev.example_models import build_examples, sample_inputs

from bench import harness


async def _rounds(url: str, config_path: Path, model: str, idle_unload_s: float, rounds: int) -> dict[str, Any]:
    cfg = load_config(str(config_path))
    x, _ = sample_inputs(1)
    delays, held, left = [], [], []
    async with harness.in_process(cfg, url) as worker, sdk.Client.connect(url, prefix=cfg.subjects.prefix) as client:
        slot = worker.slots[model]
        for _ in range(rounds):
            await client.infer(x[0], model=model, timeout=30)
            answered = time.monotonic()
            held.append(slot.handler.memory_bytes())
            while model in worker.residency.resident_names():
                if time.monotonic() - answered > idle_unload_s + 30:
                    raise RuntimeError(f"{model} still resident {time.monotonic() - answered:.1f} s after its last answer")
                await asyncio.sleep(0.01)
            delays.append(time.monotonic() - answered)
            left.append(slot.handler.memory_bytes())
        poll_s = cfg.worker.poll_interval_ms / 1000.0
    return {
        "model": model, "idle_unload_s": idle_unload_s, "poll_interval_s": poll_s, "rounds": rounds,
        "eviction_after_s": delays, "max_over_limit_s": max(delays) - idle_unload_s,
        "within_target": all(d <= idle_unload_s + poll_s for d in delays),
        "bytes_resident": held, "bytes_after": left,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="topic")
    parser.add_argument("--idle-unload-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, harness.server() as server:
        examples = build_examples(Path(tmp) / "models")
        sections = {
            "nats": {"prefix": harness.fresh_prefix("idle")},
            "worker": {"host_memory_budget_bytes": 0, "idle_unload_s": args.idle_unload_s},
            "models": tomllib.loads(examples.models_toml.read_text())["models"],
        }
        config = harness.write_config(sections, examples.directory, "idle")  # beside the model files its paths name
        record = asyncio.run(_rounds(server.url, config, args.model, args.idle_unload_s, args.rounds))
    harness.emit({"bench": "idle_unload", **record}, args.json)


if __name__ == "__main__":
    main()
