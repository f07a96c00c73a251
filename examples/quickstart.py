"""Quickstart producer: a few requests with and without a model, printing how each was batched.

    jetbatch up &                       # or any running deployment of the example models
    python examples/quickstart.py nats://127.0.0.1:4222 .jetbatch/credentials/app.json

The second argument, the app's credentials `jetbatch up` wrote, is for a server that admits only
its users (leave it out for one that admits anyone).
"""

from __future__ import annotations

import asyncio
import sys

from jetbatch import sdk


async def main(url: str, credentials: str | None = None) -> None:
    import json
    import random

    options = json.loads(open(credentials).read()) if credentials else {}  # user, password, inbox_prefix
    async with sdk.Client.connect(url, **options) as client:
        vectors = [[random.gauss(0, 1) for _ in range(16)] for _ in range(8)]
        tensors = [sdk.Tensor(dtype="float32", shape=(16,), data=memoryview(_f32(v))) for v in vectors]
        # Let the classifier pick the model for half, name it for the other half.
        calls = [client.infer_result(t, model=None if i % 2 else "sentiment", timeout=30) for i, t in enumerate(tensors)]
        for result in await asyncio.gather(*calls):
            b = result.batch
            print(f"{result.request_id[:8]}  model={b.model:<10} batch={b.batch_id[:8]} size={b.batch_size} "
                  f"wait={b.queue_wait_ms:.1f}ms load={'yes' if b.model_loaded else 'no'}  output shape={result.output.shape}")
        try:
            await client.infer(b"x", model="no-such-model", timeout=5)
        except sdk.UnknownModel as exc:
            print(f"typed error, as expected: {type(exc).__name__}: {exc}")


def _f32(values: list[float]) -> bytes:
    import struct

    return struct.pack(f"<{len(values)}f", *values)  # little-endian float32, as the wire wants


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "nats://127.0.0.1:4222", sys.argv[2] if len(sys.argv) > 2 else None))
