"""The dynamic-batcher quickstart's FastAPI app, on the jetbatch SDK.

    pip install 'jetbatch' fastapi uvicorn
    jetbatch up --config examples/migration/jetbatch.toml      # NATS + a worker serving add_1
    NATS_URL=nats://127.0.0.1:4222 uvicorn examples.fastapi_app:app --port 8000
    curl -X POST localhost:8000/items/batch/1 -H 'Content-Type: application/json' \\
         -d '{"content": "string", "nested": {"key": "string", "values": [1, 5, 2]}}'

One client per process, opened in the app's lifespan; each request awaits its own answer while
the worker batches it with others. Errors map to HTTP statuses without server internals.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException, Request

from jetbatch import sdk

MODEL = os.environ.get("JETBATCH_MODEL", "add_1")
TIMEOUT_S = float(os.environ.get("JETBATCH_TIMEOUT_S", "10"))

# What each typed SDK error means to an HTTP caller.
_STATUS = {
    sdk.BadRequest: 400,
    sdk.UnknownModel: 404,
    sdk.DeadlineExceeded: 504,
    sdk.RequestTimeout: 504,
    sdk.Overloaded: 503,
    sdk.ConnectionFailed: 503,
}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    url = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
    async with sdk.Client.connect(url, prefix=os.environ.get("JETBATCH_PREFIX", "jetbatch")) as client:
        app.state.client = client
        yield


app = FastAPI(title="jetbatch FastAPI example", lifespan=lifespan)


@app.post("/items/batch/{item_id}")
async def batch_item(item_id: int, request: Request) -> dict[str, Any]:
    body = await request.json()
    try:
        result = await request.app.state.client.infer(body, model=MODEL, timeout=TIMEOUT_S)
    except sdk.JetbatchError as exc:
        status = next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), 502)
        raise HTTPException(status_code=status, detail=str(exc)) from None
    return {"item_id": item_id, "data": result}
