"""Scaling with payload size (1 KiB to 1 MiB tensors) and with batch size, and the copies the
tensor encoding makes, in one run on one embedded nats-server.

1. SDK → worker (identity handler) throughput for float32 tensors of 1 KiB ... 1 MiB.
2. Throughput for 4 KiB tensors with max_batch_size 1, 8, 32, 64.
3. Decode cost of the tensor encoding against a copying decode (bytes(...) + torch.tensor), and
   a check that the decoded torch tensor points into the received message. Run:

    python -m bench.overhead.payload [--requests 600]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import time

import msgspec
import torch
from jetbatch import sdk
from jetbatch.sdk.protocol import ContentType, Tensor, decode_payload, encode_payload

from bench import harness


async def throughput(url: str, n: int, payload_bytes: int, max_batch: int) -> dict[str, float]:
    cfg = harness.config(
        {
            "streams": {"max_msg_size": 2 * 1024 * 1024},
            "models": {"m": {"handler": "identity", "max_batch_size": max_batch, "max_delay_ms": 2}},
        },
        tag="ps",
    )
    tensor = Tensor.from_torch(torch.arange(payload_bytes // 4, dtype=torch.float32))
    async with harness.in_process(cfg, url), sdk.Client.connect(url, prefix=cfg.nats.prefix) as client:
        await client.infer(tensor, model="m", timeout=60)
        run = await harness.gather(lambda: client.infer_result(tensor, model="m", timeout=120), n, 32)
    return {"payload_bytes": payload_bytes, "max_batch": max_batch, "throughput_rps": run.rate,
            "mib_per_s": run.rate * payload_bytes / 2**20, "mean_batch": sum(r.batch.batch_size for r in run.results) / n}  # fmt: skip


def decode_costs() -> list[dict[str, float]]:
    rows = []
    for size in (1024, 64 * 1024, 1024 * 1024):
        data, _ = encode_payload(torch.arange(size // 4, dtype=torch.float32))
        reps = 200
        t = time.perf_counter()
        for _ in range(reps):
            view = decode_payload(data, ContentType.TENSOR.value).to_torch()
        zero_copy_us = (time.perf_counter() - t) / reps * 1e6
        t = time.perf_counter()
        for _ in range(reps):
            raw = msgspec.msgpack.decode(data)
            copied = torch.frombuffer(bytearray(raw["data"]), dtype=torch.float32).clone()
        copying_us = (time.perf_counter() - t) / reps * 1e6
        start = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
        rows.append({
            "payload_bytes": size, "zero_copy_decode_us": zero_copy_us, "copying_decode_us": copying_us,
            "tensor_points_into_message": bool(start <= view.data_ptr() < start + len(data)), "same_values": bool(torch.equal(view, copied)),
        })  # fmt: skip
    return rows


async def main(n: int) -> dict[str, object]:
    out: dict[str, object] = {"decode": decode_costs(), "by_payload": [], "by_batch": []}
    with harness.server() as server:
        for size in (1024, 16 * 1024, 256 * 1024, 1024 * 1024):
            count = n if size <= 16 * 1024 else max(50, n // 6)
            out["by_payload"].append(await throughput(server.url, count, size, 64))  # type: ignore[union-attr]
        for batch in (1, 8, 32, 64):
            out["by_batch"].append(await throughput(server.url, n, 4096, batch))  # type: ignore[union-attr]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    harness.emit(asyncio.run(main(args.requests)), args.json)
