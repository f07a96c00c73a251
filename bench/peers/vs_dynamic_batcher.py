"""jetbatch against the Redis-based `dynamic-batcher` package (1.0.6.1), side by side in one run.

The same identity work (each request's JSON body comes back), batch size 64, at concurrency 1 and
100, on loopback: `dynamic-batcher` with its `BatchProcessor` in its own process on a
`redis-server` we start, and its `DynamicBatcher.asend` as the client; jetbatch with a worker
process (identity handler, `max_batch_size` 64, `max_delay_ms` 5) and the SDK.

`dynamic-batcher`'s batch window (`DYNAMIC_BATCHER__BATCH_TIME`) is a whole number of seconds (and
counted in 1 ms polling steps); we use its smallest setting, 1, and say so. Its client polls Redis
for the answer every 10 ms (`delay=0.01`, its default).

Needs `pip install dynamic-batcher==1.0.6.1` and `redis-server` (Debian: `apt-get install
redis-server`); skips with a message otherwise. Run:

    python -m bench.peers.vs_dynamic_batcher [--requests 400] [--lone 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jetbatch.sidecar.percentiles import percentile

from bench import harness

ROOT = Path(__file__).resolve().parents[2]

PROCESSOR = """
import asyncio, os
from dynamic_batcher import BatchProcessor
def identity(bodies):
    return bodies
asyncio.run(BatchProcessor(batch_size=64, batch_time=1).start_daemon(identity))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    return percentile(values, q / 100) * 1000


async def drive(send: object, n: int, concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            t = time.perf_counter()
            out = await send({"key": str(i), "values": [i, i + 1, i + 2]})  # type: ignore[operator]
            assert out == {"key": str(i), "values": [i, i + 1, i + 2]}, out
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - started
    return {"throughput_rps": n / elapsed, "p50_ms": pct(latencies, 50), "p99_ms": pct(latencies, 99), "requests": n}


def run_dynamic_batcher(n: int, lone: int) -> dict[str, dict[str, float]]:
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="jetbatch-redis-")
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = {**os.environ, "REDIS__HOST": "127.0.0.1", "REDIS__PORT": str(port),
           "DYNAMIC_BATCHER__BATCH_SIZE": "64", "DYNAMIC_BATCHER__BATCH_TIME": "1"}  # fmt: skip
    os.environ.update({"REDIS__HOST": "127.0.0.1", "REDIS__PORT": str(port)})  # read at import time
    processor = None
    try:
        import redis as redis_py

        client = redis_py.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis_py.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        processor = subprocess.Popen([sys.executable, "-c", PROCESSOR], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from dynamic_batcher import DynamicBatcher

        batcher = DynamicBatcher()
        time.sleep(1.0)  # let the processor create its consumer group before the first request
        return {
            "concurrency_1": asyncio.run(drive(batcher.asend, lone, 1)),
            "concurrency_100": asyncio.run(drive(batcher.asend, n, 100)),
        }
    finally:
        if processor is not None:
            processor.terminate()
            processor.wait(10)
        redis.terminate()
        redis.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def run_jetbatch(n: int, lone: int) -> dict[str, dict[str, float]]:
    from jetbatch import sdk

    with tempfile.TemporaryDirectory() as tmp:
        cfg = harness.write_config({"models": {"ident": {"handler": "identity", "max_batch_size": 64, "max_delay_ms": 5}}}, tmp, "ident")
        with harness.processes(cfg) as dep:

            async def both() -> dict[str, dict[str, float]]:
                async with sdk.Client.connect(dep.url) as client:

                    async def send(body: object) -> object:
                        return await client.infer(body, model="ident", content_type="application/json", timeout=60)

                    await send({"warm": True})
                    return {"concurrency_1": await drive(send, lone, 1), "concurrency_100": await drive(send, n, 100)}

            return asyncio.run(both())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="requests at concurrency 100")
    parser.add_argument("--lone", type=int, default=5, help="requests at concurrency 1 (each waits a whole batch window there)")
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    import importlib.util

    # Not imported here: dynamic-batcher reads REDIS__PORT when first imported.
    if importlib.util.find_spec("dynamic_batcher") is None:
        print("skipped: pip install dynamic-batcher==1.0.6.1 to run this comparison")
        return
    if shutil.which("redis-server") is None:
        print("skipped: redis-server not found (Debian: apt-get install redis-server)")
        return
    ours = run_jetbatch(args.requests, args.lone)
    theirs = run_dynamic_batcher(args.requests, args.lone)
    out = {"jetbatch": ours, "dynamic_batcher": theirs, "ratios_jetbatch_over_dynamic_batcher": {}}
    for c in ("concurrency_1", "concurrency_100"):
        out["ratios_jetbatch_over_dynamic_batcher"][c] = {
            "throughput": ours[c]["throughput_rps"] / theirs[c]["throughput_rps"],
            "p50_latency": ours[c]["p50_ms"] / theirs[c]["p50_ms"],
            "p99_latency": ours[c]["p99_ms"] / theirs[c]["p99_ms"],
        }
    harness.emit(out, args.json)


if __name__ == "__main__":
    main()
