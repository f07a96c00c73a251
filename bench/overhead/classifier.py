"""Classifier throughput (requests/s) with a trivial network, against raw JetStream
consume + republish + ack of the same messages with nats-py, side by side on one server.

Both sides start from N messages already queued on an ingress stream and stop when all N sit in
the model stream; the raw side does the least that job needs (fetch a batch, publish each with
its headers and await the PubAcks concurrently, ack each). Run:

    python -m bench.overhead.classifier [--messages 5000] [--batch 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import msgspec
import nats
from jetbatch.sdk.protocol import Headers, Tensor, encode_payload
from jetbatch.sidecar.config import Config
from jetbatch.sidecar.streams import ensure_classifier_streams, ensure_streams
from jetbatch.sidecar.transport import connect

from bench import harness


async def queue(js: nats.js.JetStreamContext, subject: str, n: int, body: bytes, ctype: str) -> None:
    await asyncio.gather(
        *(js.publish(subject, body, headers={Headers.MSG_ID: uuid.uuid4().hex, Headers.CONTENT_TYPE: ctype, Headers.REPLY_TO: "nowhere.x"}) for _ in range(n))
    )


async def wait_count(js: nats.js.JetStreamContext, stream: str, n: int) -> None:
    while (await js.stream_info(stream)).state.messages < n:
        await asyncio.sleep(0.005)


async def raw_round(url: str, n: int, batch: int, body: bytes, ctype: str) -> float:
    p = f"raw{uuid.uuid4().hex[:6]}"
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=f"{p}_IN", subjects=[f"{p}.in"], retention="workqueue")
    await js.add_stream(name=f"{p}_OUT", subjects=[f"{p}.model.m1"], retention="workqueue", duplicate_window=120)
    await queue(js, f"{p}.in", n, body, ctype)
    psub = await js.pull_subscribe(f"{p}.in", durable="c", stream=f"{p}_IN")
    started = time.perf_counter()
    done = 0
    while done < n:
        msgs = await psub.fetch(batch, timeout=5)
        await asyncio.gather(*(js.publish(f"{p}.model.m1", m.data, headers=m.headers) for m in msgs))
        for m in msgs:
            await m.ack()
        done += len(msgs)
    await wait_count(js, f"{p}_OUT", n)
    elapsed = time.perf_counter() - started
    await js.delete_stream(f"{p}_IN")
    await js.delete_stream(f"{p}_OUT")
    await nc.close()
    return n / elapsed


async def classifier_round(url: str, n: int, batch: int, body: bytes, ctype: str) -> float:
    p = f"cls{uuid.uuid4().hex[:6]}"
    cfg = msgspec.convert(
        {
            "nats": {"prefix": p},
            "models": {"m1": {"handler": "identity"}},
            "classifier": {"router": "torch", "handler": "bench.overhead.classifier:TrivialNet", "labels": {"0": "m1", "1": "m1"}, "max_batch_size": batch, "max_delay_ms": 1},
        },
        Config,
    )
    nc = await connect(cfg.nats, url)
    js = nc.jetstream()
    await ensure_classifier_streams(js, cfg.subjects, cfg.streams)
    await ensure_streams(js, cfg.subjects, cfg.streams, ["m1"])
    await queue(js, cfg.subjects.ingress, n, body, ctype)
    async with harness.classifier_in_process(cfg, url):  # ready: like the raw side, the clock starts once subscribed
        started = time.perf_counter()
        await wait_count(js, cfg.subjects.models_stream, n)
        elapsed = time.perf_counter() - started
    for stream in (cfg.subjects.ingress_stream, cfg.subjects.models_stream, cfg.subjects.dead_letter_stream):
        await js.delete_stream(stream)
    await nc.close()
    return n / elapsed


class TrivialNet:
    """A two-class 'network': one matrix multiply."""

    def __init__(self, cfg: object) -> None:
        import torch

        self.weight = torch.ones(16, 2)

    def __call__(self, x: object) -> object:
        return x @ self.weight  # type: ignore[operator]


async def main(args: argparse.Namespace) -> dict[str, object]:
    import torch

    body, ctype = encode_payload(Tensor.from_torch(torch.randn(16)))
    raw, ours = [], []
    with harness.server() as server:
        for _ in range(args.rounds):
            raw.append(await raw_round(server.url, args.messages, args.batch, body, ctype.value))
            ours.append(await classifier_round(server.url, args.messages, args.batch, body, ctype.value))
    ratios = [o / r for o, r in zip(ours, raw)]
    return {
        "messages": args.messages,
        "batch": args.batch,
        "raw_rps": [round(x) for x in raw],
        "classifier_rps": [round(x) for x in ours],
        "ratio_median": statistics.median(ratios),
        "ratios": [round(x, 3) for x in ratios],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    harness.emit(asyncio.run(main(args)), args.json)
