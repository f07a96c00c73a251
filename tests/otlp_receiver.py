"""A tiny OTLP/HTTP receiver on loopback for end-to-end tracing tests and benchmarks."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpReceiver:
    """Collects the spans POSTed to ``/v1/traces`` (protobuf); metrics posts are counted only."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, protobuf Span)
        self.metric_posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.endswith("/v1/traces"):
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    with receiver._lock:
                        for rs in request.resource_spans:
                            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                            for ss in rs.scope_spans:
                                receiver.spans.extend((service, span) for span in ss.spans)
                else:
                    receiver.metric_posts += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "OtlpReceiver":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self.spans)
