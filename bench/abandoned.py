"""Callers who give up: the closed burst of examples/workloads/burst.toml (4 models x 64 requests,
one slot, 0.5 s loads) simulated with every request's deadline at ``--deadline-s`` (about half
the burst's mean queueing time by default), counting the loads whose model then computed nothing
because every caller was gone. Run:

    python -m bench.abandoned [--deadline-s 0.67]
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from bench import harness
from jetbatch.sidecar.simulator import build_workload, simulate

BURST = Path(__file__).resolve().parent.parent / "examples" / "workloads" / "burst.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deadline-s", type=float, default=0.67)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    raw = tomllib.loads(BURST.read_text())
    for model in raw["models"].values():
        model["deadline_s"] = args.deadline_s
    result = simulate(build_workload(raw), "cost-aware")
    loaded = [m for _, _, m in result.load_log]
    computed = {m for _, _, m, _, _ in result.batches}
    harness.emit(
        {
            "bench": "abandoned", "deadline_s": args.deadline_s, "loads": result.loads, "loaded": loaded,
            "loads_for_nothing": sum(1 for m in loaded if m not in computed), "reaped_queues": result.reaped_queues,
            "completed": result.completed, "deadline_exceeded": result.deadline_exceeded,
        },
        args.json,
    )  # fmt: skip


if __name__ == "__main__":
    main()
