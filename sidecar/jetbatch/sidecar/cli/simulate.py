"""``jetbatch simulate``: scheduling policies on a workload, in the discrete-event simulator that
drives the same policy core as the live worker."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ._common import CliError, add_json, add_record, open_recorder, plain, writable_file


def register(sub: Any) -> None:
    p = sub.add_parser("simulate", help="simulate scheduling policies on a workload", description=plain(__doc__))
    p.add_argument("--workload", required=True, metavar="FILE", help="workload file, TOML or JSON (docs/scheduler.md)")
    p.add_argument("--policy", default="all", help="comma-separated policy names, or all (default)")
    add_json(p, "one summary per policy")
    p.add_argument("--plot", default=None, metavar="PNG", help="a residency and batch timeline per policy (needs jetbatch[plot])")
    add_record(p, "the first simulated worker (one policy only)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetbatch.sidecar.policy import POLICIES
    from jetbatch.sidecar.simulator import WorkloadError, load_workload, plot, print_table, simulate, simulate_policies

    names = list(POLICIES) if args.policy == "all" else [p.strip() for p in args.policy.split(",") if p.strip()]
    if not names:
        raise CliError(f"--policy: name at least one of {', '.join(POLICIES)}, or all")
    if args.record is not None and len(names) != 1:
        raise CliError("--record: name one policy (--policy NAME): a recording is one worker's core")
    try:
        if args.plot:
            writable_file(args.plot, "--plot")
            import matplotlib  # noqa: F401  - fail before the run, not after it
        workload = load_workload(args.workload)  # its errors name the file
        recorder = open_recorder(args)
        try:
            results = [simulate(workload, names[0], record=recorder)] if recorder is not None else simulate_policies(workload, names)
        finally:
            if recorder is not None:
                recorder.close()
    except WorkloadError as exc:
        text, source = str(exc), str(Path(args.workload))
        raise CliError(text if text.startswith(f"{source}:") else f"{source}: {text}") from None
    except ValueError as exc:  # an unknown policy name
        raise CliError(str(exc)) from None
    rows = [r.summary(workload) for r in results]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows, workload)
    if args.plot:
        plot(results, workload, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
