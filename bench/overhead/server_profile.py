"""Where nats-server's CPU goes a request: the stored raw loop beside jetbatch, as deployed.

On a small host the producer, the sidecars and nats-server share the cores, so nats-server's CPU
a request bounds throughput as much as the worker's. This runs ``bench.overhead.deployed``'s rounds on one
server with its Go CPU profile served (``prof_port``), alternating: the stored raw loop (request
ids ``r<i>``), the same with random ids as the SDK makes them (``raw_requests``), and jetbatch
(SDK → worker). Each round's profile covers ``--profile-s`` seconds of its timed requests (give it
enough requests to outlast that). Prints each kind's nats-server CPU a request (from ``/proc``,
medians over the rounds) and that CPU shared out by where the profile saw it: the parts of the
server's work named below (inclusive: a part includes what it calls) and the functions whose
share differs most between the stored raw loop and jetbatch.

    python -m bench.overhead.server_profile [--requests 100000] [--rounds 2] [--profile-s 8] [--out DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness.pprof import CpuProfile, read_profile
from bench.harness.rounds import free_port, jetbatch_round, raw_round

_S = "github.com/nats-io/nats-server/v2/server."
# The parts of nats-server's work a request goes through, by the function each is under.
PARTS = (
    ("storing a message", _S + "(*stream).processJetStreamMsg"),
    ("  in the file store", _S + "(*fileStore).StoreMsg"),
    ("  republishing its headers", _S + "newJSPubMsg"),
    ("reading from clients", _S + "(*client).readLoop"),
    ("  matching subjects", _S + "(*Sublist).Match"),
    ("writing to clients", _S + "(*client).writeLoop"),
    ("acks", _S + "(*consumer).processInboundAcks"),
    ("deliveries to pulls", _S + "(*consumer).loopAndGatherMsgs"),
    ("pull requests", _S + "(*consumer).processInboundNextMsgReqs"),
    ("flushing blocks to disk", _S + "(*msgBlock).flushPendingMsgsLocked"),
    ("garbage collection", "runtime.gcBgMarkWorker"),
    ("allocation", "runtime.mallocgc"),
)
_INDEX = "subject index lookups (stree Find)"


def _index_share(profile: CpuProfile) -> float:
    """The share spent finding subjects in the store's subject trees (per-subject state)."""
    return sum(ns for name, ns in profile.inclusive_ns.items() if "/stree." in name and ").Find" in name) / max(profile.total_ns, 1)


class _Profiler:
    """One pprof CPU profile at a time from nats-server's ``prof_port``, taken in a thread."""

    def __init__(self, port: int, out: Path, seconds: float) -> None:
        self.port, self.out, self.seconds = port, out, seconds
        self._thread: threading.Thread | None = None
        self.started_at = 0.0

    def start(self, name: str) -> Callable[[], None]:
        def begin() -> None:
            url = f"http://127.0.0.1:{self.port}/debug/pprof/profile?seconds={self.seconds:g}"

            def grab() -> None:
                with urllib.request.urlopen(url, timeout=self.seconds + 60) as r:
                    (self.out / f"{name}.pb.gz").write_bytes(r.read())

            self.started_at = time.monotonic()
            self._thread = threading.Thread(target=grab, daemon=True)
            self._thread.start()

        return begin

    def join(self) -> float:
        """Wait for the profile; returns how long the round outlasted it (negative: it did not)."""
        assert self._thread is not None
        ended = time.monotonic()
        self._thread.join()
        return ended - self.started_at - self.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile-s", type=float, default=8.0, help="seconds of each round's profile (its timed requests must outlast them)")
    parser.add_argument("--out", default=None, help="keep the profiles here (default: a temporary folder)")
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="jetbatch-server-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(256)
    prof_port = free_port()
    profiler = _Profiler(prof_port, out, args.profile_s)
    server_us: dict[str, list[float]] = {}
    profiles: dict[str, list[CpuProfile]] = {}
    short: list[str] = []
    with harness.server(extra_config=f"prof_port: {prof_port}") as server:
        for i in range(args.rounds):
            kinds: list[tuple[str, Callable[[Callable[[], None]], dict[str, Any]]]] = [
                ("raw_stored", lambda go: raw_round(server.url, server.pid, args.requests, args.concurrency, payload, stored=True, on_timed=go)),
                ("raw_stored_random_ids", lambda go: raw_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, stored=True, random_ids=True, on_timed=go)),
                ("jetbatch", lambda go: jetbatch_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, classifier=False, on_timed=go)),
            ]  # fmt: skip
            for kind, run in kinds:
                record = run(profiler.start(f"{kind}{i}"))
                if profiler.join() < 0:
                    short.append(f"{kind}{i}")
                server_us.setdefault(kind, []).append(record["server_us"])
                profiles.setdefault(kind, []).append(read_profile(out / f"{kind}{i}.pb.gz"))
    if short:
        print(f"warning: rounds {', '.join(short)} ended before their profile: more --requests or fewer --profile-s")
    us = {kind: statistics.median(v) for kind, v in server_us.items()}
    parts: dict[str, dict[str, float]] = {}
    for kind, ps in profiles.items():
        share = {label: statistics.median(p.share(fn) for p in ps) for label, fn in PARTS}
        share[_INDEX] = statistics.median(_index_share(p) for p in ps)
        parts[kind] = {label: s * us[kind] for label, s in share.items()}
    kinds = list(us)
    print(f"nats-server CPU a request (µs), {args.requests} requests a round, medians of {args.rounds} rounds; profiles in {out}")
    print(f"  {'':34s}" + "".join(f"{k:>22s}" for k in kinds))
    print(f"  {'all':34s}" + "".join(f"{us[k]:22.1f}" for k in kinds))
    for label in [label for label, _ in PARTS] + [_INDEX]:
        print(f"  {label:34s}" + "".join(f"{parts[k][label]:22.1f}" for k in kinds))
    # The functions whose CPU a request differs most between the stored raw loop and jetbatch.
    names = set().union(*(p.inclusive_ns for ps in profiles.values() for p in ps))

    def per_request(kind: str, name: str) -> float:
        return statistics.median(p.share(name) for p in profiles[kind]) * us[kind]

    diffs = sorted(((per_request("jetbatch", n) - per_request("raw_stored", n), n) for n in names), reverse=True)
    print("\n  jetbatch minus the stored raw loop, by function (inclusive, µs a request):")
    for d, name in diffs[:12] + diffs[-6:]:
        print(f"    {d:+6.1f}  {name.replace(_S, '')}")
    harness.emit({"bench": "server_profile", "requests": args.requests, "rounds": args.rounds, "server_us": server_us, "parts_us": parts}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
