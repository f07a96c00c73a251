"""``jetbatch replay``: feed a flight recording (``worker --record``, ``simulate --record``) to a
fresh worker core and check that it answers every recorded event with the recorded action."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import EXIT_FAILED, EXIT_OK, CliError, add_json, plain


def register(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a worker's flight recording and check its decisions", description=plain(__doc__))
    p.add_argument("path", metavar="PATH", help="a recording written by `jetbatch worker --record` or `jetbatch simulate --record`")
    add_json(p, "the counts (and the first divergence)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from jetbatch.sidecar.recording import RecordingError, replay_file

    try:
        result = replay_file(args.path)
    except RecordingError as exc:
        raise CliError(f"{args.path}: {exc}") from None
    if args.json:
        print(json.dumps({"ok": result.ok, **msgspec.to_builtins(result)}, indent=2))
        return EXIT_OK if result.ok else EXIT_FAILED
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.by_action.items())) or "none"
    end = " (the recording stopped at its size bound)" if result.truncated else ""
    if result.ok:
        print(f"{result.events} events replayed, {result.matched} actions as recorded ({kinds}){end}")
        return EXIT_OK
    d = result.divergence
    assert d is not None
    print(f"diverged at line {d.line} after {result.matched} matching actions ({kinds})")
    print(f"  event:    {d.event}")
    print(f"  recorded: {d.recorded}")
    print(f"  replayed: {d.replayed}")
    return EXIT_FAILED
