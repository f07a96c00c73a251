"""A small web app using the SDK, like the FastAPI `/items/batch/{id}` example of the
`dynamic-batcher` package, on the standard library (no web framework to install).

    NATS_URL=nats://127.0.0.1:4222 NATS_USER=app NATS_PASSWORD=... NATS_INBOX_PREFIX=_INBOX.app python -m examples.webapp --port 8000
    curl -X POST localhost:8000/items/batch/42 -d '{"values": [0.1, 0.2, ...16 floats]}'

POST /items/batch/{item_id} with a JSON body {"values": [16 floats], "model": optional} runs one
inference through jetbatch (the classifier picks the model unless one is given) and returns the
output with how the request was batched. GET /healthz answers "ok".
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Mapping

from jetbatch import sdk


def make_handler(client: sdk.BlockingClient) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server API
            if self.path == "/healthz":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            parts = self.path.strip("/").split("/")
            if len(parts) != 3 or parts[:2] != ["items", "batch"]:
                self._send(404, {"error": "POST /items/batch/{item_id}"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                values = [float(v) for v in body["values"]]
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, {"error": f"expected JSON {{'values': [floats]}}: {exc}"})
                return
            tensor = sdk.Tensor(dtype="float32", shape=(len(values),), data=memoryview(struct.pack(f"<{len(values)}f", *values)))
            try:
                result = client.infer_result(tensor, model=body.get("model"), timeout=30)
            except sdk.BadRequest as exc:
                self._send(400, {"error": exc.code, "message": exc.message})
                return
            except sdk.UnknownModel as exc:
                self._send(404, {"error": exc.code, "message": exc.message})
                return
            except sdk.JetbatchError as exc:
                self._send(503, {"error": exc.code, "message": exc.message})
                return
            out = result.output
            output = list(struct.unpack(f"<{len(out.data) // 4}f", out.data)) if isinstance(out, sdk.Tensor) else out
            self._send(200, {
                "item_id": parts[2], "output": output, "model": result.batch.model, "batch_id": result.batch.batch_id,
                "batch_size": result.batch.batch_size, "queue_wait_ms": result.batch.queue_wait_ms,
                "model_loaded": result.batch.model_loaded, "trace_id": result.batch.trace_id,
            })  # fmt: skip

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """The app's NATS identity from NATS_USER, NATS_PASSWORD and NATS_INBOX_PREFIX (compose and
    examples/k8s set them; `jetbatch up` keeps the same three in its app.json)."""
    names = {"NATS_USER": "user", "NATS_PASSWORD": "password", "NATS_INBOX_PREFIX": "inbox_prefix"}
    return {key: environ[var] for var, key in names.items() if environ.get(var)}


def serve(url: str | None, host: str, port: int) -> ThreadingHTTPServer:
    client = sdk.BlockingClient.connect(url, **credentials(os.environ))
    return ThreadingHTTPServer((host, port), make_handler(client))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL"))
    args = parser.parse_args()
    server = serve(args.nats_url, args.host, args.port)
    print(f"listening on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
