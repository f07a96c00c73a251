"""The hot path as deployed: producer, sidecars and nats-server each in its own process.

``bench.overhead.in_process`` runs producer, worker and server on one event loop. Here each is a process, as
in ``compose.yaml``: nats-server, a ``jetbatch worker`` (and a ``jetbatch classifier``), and the
producer (this process, the SDK). The raw baseline is laid out the same way: a consumer process
doing the least a JetStream request/reply needs (fetch up to 64, publish each reply, ack each;
``bench.harness.raw``) and this process publishing with JetStream and awaiting replies on one
inbox. Same payloads, requests and concurrency; rounds alternate raw / jetbatch / classified. With
``--raw-stored``, each round also runs the raw loop storing its replies (a JetStream publish into
a results stream, the requests acked once the PubAcks came; the producer listens on the results
subjects), the least a loop does that acks a request only once its answer is safe. With
``--raw-relayed``, the raw twin of the classifier path: the producer publishes to an ingress
stream, a raw relay process (fetch up to 64, republish each with its headers as a JetStream
publish, ack each once the batch's PubAcks came) feeds the stored raw loop's consumer; it is what
SDK → classifier → worker is compared with beyond the one-hop raw loop; ``--relay-fast-ingest``
also runs it with the relay publishing each batch as a JetStream fast-ingest batch (ADR-50,
nats-server 2.14+: one flow ack every few messages instead of a PubAck each). With
``--raw-republished``, the stored raw loop once more with its request stream republishing each
stored request's headers, as jetbatch's models stream does for its arrival events: what that costs
nats-server (``server_us``) with nobody listening. With ``--raw-twin``, the stored raw loop asking
nats-server for the work jetbatch's protocol asks: random request ids as the SDK makes them, the
SDK's request headers (no ``Reply``: the consumer answers under the request's key, at the subject
a worker builds) and a jetbatch answer's five headers, its request stream republishing each
request's headers; jetbatch against it (``jetbatch_over_raw_twin``, each process's CPU) is what
jetbatch's own code costs beyond the server work and the transport; ``--raw-relayed-twin``, the
same for the raw relayed loop, against the classifier path.
After each jetbatch run, ``--lone`` requests one at a time (``--lone-gap-s`` apart): a lone
request's median latency beyond its batch windows (``lone_p50_over_max_delay_ms``; through the
classifier, both windows), and how much of that is its worker batch starting past the worker's
window (``lone_batch_start_over_max_delay_ms``, the queue wait the worker reports). The raw
rounds send as many lone requests the same way: their median round trip (``lone_p50_ms``) is the
floor under jetbatch's (the raw loop has no window to wait).

Reported per round: throughput, and each process's CPU seconds per request (from /proc): the
producer, the consumer side (raw consumer, or worker, and the classifier), nats-server; and the
messages the consumer side published and received per request (``consumer_published``,
``consumer_received``, from nats-server's ``/connz``, which counts messages, not PINGs; by
connection name in ``consumer_msgs_by_connection``: which hop pays what); for
jetbatch, how its worker formed batches (``worker_per_batch``: requests, fetches, decisions, pull
requests sent and pull requests ended by a status message a batch; ``worker_events_per_request``:
the arrival events it heard), from its status counters.

    python -m bench.overhead.deployed [--requests 5000] [--concurrency 64] [--payload 256] [--rounds 3] [--lone 20]
                             [--lone-gap-s 0] [--max-delay-s 0.002] [--raw-stored] [--raw-twin] [--raw-republished] [--raw-relayed [--relay-fast-ingest]] [--raw-relayed-twin]
                             [--batch-sizes]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from bench import harness
from bench.harness.rounds import MAX_DELAY_S, free_port, jetbatch_round, raw_round


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--payload", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lone", type=int, default=20, help="requests sent one at a time after each jetbatch run (SDK -> worker, and through the classifier)")
    parser.add_argument("--lone-gap-s", type=float, default=0.0, help="pause between the lone requests (an idle host between them)")
    parser.add_argument("--max-delay-s", type=float, default=MAX_DELAY_S, help="the worker's batch window (max_delay_s)")
    parser.add_argument("--raw-stored", action="store_true", help="also the raw loop with its replies stored (PubAck before the ack)")
    parser.add_argument(
        "--raw-relayed", action="store_true",
        help="also the raw loop through a raw relay process (the classifier's hop), its replies stored: the raw twin of the classifier path",
    )  # fmt: skip
    parser.add_argument(
        "--relay-fast-ingest", action="store_true",
        help="also the raw relayed loop with each relayed batch published as a JetStream fast-ingest batch (nats-server 2.14+)",
    )  # fmt: skip
    parser.add_argument(
        "--raw-republished", action="store_true",
        help="also the stored raw loop with its request stream republishing each request's headers (jetbatch's arrival events; the server's part)",
    )  # fmt: skip
    parser.add_argument(
        "--raw-twin", action="store_true",
        help="also the stored raw loop doing the server work of jetbatch's protocol: random request ids, jetbatch's request and "
        "answer headers (each answer under the request's key), its request stream republishing each request's headers",
    )  # fmt: skip
    parser.add_argument(
        "--raw-relayed-twin", action="store_true",
        help="also the raw relayed loop with what --raw-twin adds (the server work of jetbatch's protocol): the twin of the classifier path",
    )  # fmt: skip
    parser.add_argument(
        "--batch-sizes", action="store_true", help="report each jetbatch round's mean batch size (read from every answer: a little more producer CPU)"
    )
    parser.add_argument("--json", help="append the record to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    payload = os.urandom(args.payload)
    rounds: list[dict[str, dict[str, Any]]] = []  # each round: its records by kind
    monitor_port = free_port()  # nats-server's /connz: the consumer side's messages
    with harness.server(extra_config=f"http: 127.0.0.1:{monitor_port}") as server:
        for _ in range(args.rounds):
            lone = {"lone": args.lone, "lone_gap_s": args.lone_gap_s, "monitor_port": monitor_port}
            by_kind = {"raw": raw_round(server.url, server.pid, args.requests, args.concurrency, payload, **lone)}
            if args.raw_stored:
                by_kind["raw_stored"] = raw_round(server.url, server.pid, args.requests, args.concurrency, payload, stored=True, **lone)
            if args.raw_twin:
                by_kind["raw_twin"] = raw_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, stored=True, republish=True, random_ids=True,
                    protocol_headers=True, **lone,
                )  # fmt: skip
            if args.raw_republished:
                by_kind["raw_republished"] = raw_round(server.url, server.pid, args.requests, args.concurrency, payload, stored=True, republish=True, **lone)
            if args.raw_relayed:
                by_kind["raw_relayed"] = raw_round(server.url, server.pid, args.requests, args.concurrency, payload, relayed=True, **lone)
            if args.raw_relayed_twin:
                by_kind["raw_relayed_twin"] = raw_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, relayed=True, republish=True, random_ids=True,
                    protocol_headers=True, **lone,
                )  # fmt: skip
            if args.raw_relayed and args.relay_fast_ingest:
                by_kind["raw_relayed_fast"] = raw_round(
                    server.url, server.pid, args.requests, args.concurrency, payload, relayed=True, fast_ingest=True, **lone
                )  # fmt: skip
            for kind, classifier in (("jetbatch", False), ("classified", True)):
                by_kind[kind] = jetbatch_round(
                    server.url, server.pid, args.requests, args.concurrency, payload,
                    classifier=classifier, lone=args.lone, max_delay_s=args.max_delay_s, batch_sizes=args.batch_sizes,
                    lone_gap_s=args.lone_gap_s, monitor_port=monitor_port,
                )  # fmt: skip
            rounds.append(by_kind)

    kinds = list(rounds[0])
    summary = {
        kind: {
            key: statistics.median(r[kind][key] for r in rounds)
            for key in ("rate", "producer_us", "consumer_us", "server_us", "consumer_published", "consumer_received")
        }
        for kind in kinds
    }
    for kind in kinds:
        for key in ("lone_p50_ms", "lone_p50_over_max_delay_ms", "lone_batch_start_over_max_delay_ms"):
            lone = [r[kind][key] for r in rounds if key in r[kind]]
            if lone:
                summary[kind][key] = statistics.median(lone)
    per_round = []
    for r in rounds:
        ratios = {
            "jetbatch_over_raw": r["jetbatch"]["rate"] / r["raw"]["rate"],
            "classified_over_raw": r["classified"]["rate"] / r["raw"]["rate"],
            "worker_cpu_over_raw_consumer": r["jetbatch"]["consumer_us"] / r["raw"]["consumer_us"],
        }
        if "raw_stored" in r:
            ratios["raw_stored_over_raw"] = r["raw_stored"]["rate"] / r["raw"]["rate"]
            ratios["jetbatch_over_raw_stored"] = r["jetbatch"]["rate"] / r["raw_stored"]["rate"]
            ratios["worker_cpu_over_raw_stored_consumer"] = r["jetbatch"]["consumer_us"] / r["raw_stored"]["consumer_us"]
            if "lone_p50_ms" in r["raw_stored"] and "lone_p50_over_max_delay_ms" in r["jetbatch"]:
                # What jetbatch's lone request takes beyond its window and the raw stored round trip.
                ratios["lone_over_max_delay_and_raw_stored_ms"] = r["jetbatch"]["lone_p50_over_max_delay_ms"] - r["raw_stored"]["lone_p50_ms"]
        if "raw_twin" in r:
            # jetbatch against the least loop that asks nats-server for the same work (stored
            # answers, random ids, the protocol's headers, the arrival events' republish): what
            # is left is jetbatch's own code, the producer's and the worker's.
            ratios["raw_twin_over_raw"] = r["raw_twin"]["rate"] / r["raw"]["rate"]
            ratios["jetbatch_over_raw_twin"] = r["jetbatch"]["rate"] / r["raw_twin"]["rate"]
            ratios["worker_cpu_over_raw_twin_consumer"] = r["jetbatch"]["consumer_us"] / r["raw_twin"]["consumer_us"]
            ratios["producer_cpu_over_raw_twin_producer"] = r["jetbatch"]["producer_us"] / r["raw_twin"]["producer_us"]
            ratios["server_us_jetbatch_minus_raw_twin"] = r["jetbatch"]["server_us"] - r["raw_twin"]["server_us"]
        if "raw_republished" in r and "raw_stored" in r:
            # What the republish of each request's headers costs nats-server, a request.
            ratios["server_us_republished_minus_stored"] = r["raw_republished"]["server_us"] - r["raw_stored"]["server_us"]
        if "raw_relayed" in r:
            # The classifier path against its raw twin (two stored hops, replies stored), and the
            # twin against the one-hop raw loop: how much of the gap the raw parts already take.
            ratios["raw_relayed_over_raw"] = r["raw_relayed"]["rate"] / r["raw"]["rate"]
            ratios["classified_over_raw_relayed"] = r["classified"]["rate"] / r["raw_relayed"]["rate"]
            ratios["classified_cpu_over_raw_relayed"] = r["classified"]["consumer_us"] / r["raw_relayed"]["consumer_us"]
        if "raw_relayed_twin" in r:
            ratios["raw_relayed_twin_over_raw"] = r["raw_relayed_twin"]["rate"] / r["raw"]["rate"]
            ratios["classified_over_raw_relayed_twin"] = r["classified"]["rate"] / r["raw_relayed_twin"]["rate"]
            ratios["classified_cpu_over_raw_relayed_twin"] = r["classified"]["consumer_us"] / r["raw_relayed_twin"]["consumer_us"]
            ratios["server_us_classified_minus_raw_relayed_twin"] = r["classified"]["server_us"] - r["raw_relayed_twin"]["server_us"]
        if "raw_relayed_fast" in r:
            ratios["raw_relayed_fast_over_raw_relayed"] = r["raw_relayed_fast"]["rate"] / r["raw_relayed"]["rate"]
        per_round.append(ratios)
    harness.emit({"bench": "deployed", "requests": args.requests, "concurrency": args.concurrency, "payload": args.payload,
                  "median": summary, "ratios": per_round, "rounds": [rec for r in rounds for rec in r.values()]}, args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
