"""A tiny OTLP/HTTP trace receiver: what the compose test runs in Jaeger's place (no image
registry here), so it can read back the spans the gateway and the workers sent.

    python3 otlp_receiver.py [--port 4318]

POST /v1/traces takes an ExportTraceServiceRequest (protobuf, optionally gzip) as the OTLP
exporters send it, and keeps each span as a plain dict (`span_record`); GET /spans answers
them all as a JSON list. Standard library plus opentelemetry-proto (which the OTLP exporters
depend on), so it runs in the gateway's image, or in-process in the tests.
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(value: AnyValue) -> Any:
    """An OTLP attribute value as a JSON value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return None if kind is None else getattr(value, kind)


def span_record(resource_attributes: dict[str, Any], span) -> dict[str, Any]:
    """One span, flattened: ids in hex ("" for no parent), its service, attributes, links."""
    return {
        "name": span.name,
        "service": resource_attributes.get("service.name"),
        "kind": span.kind,  # the OTLP enum: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "start_unix_nano": span.start_time_unix_nano,
        "end_unix_nano": span.end_time_unix_nano,
        "status_code": span.status.code,
        "attributes": {kv.key: any_value(kv.value) for kv in span.attributes},
        "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links],
    }


def decode_spans(body: bytes) -> list[dict[str, Any]]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            spans += [span_record(resource, span) for span in scope_spans.spans]
    return spans


class SpanStore:
    """The spans received so far, shared by the handler threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[dict[str, Any]] = []

    def add(self, spans: list[dict[str, Any]]) -> None:
        with self._lock:
            self._spans += spans

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._spans)


def make_server(host: str, port: int, store: SpanStore) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self._reply(404, b"", "text/plain")
                return
            store.add(decode_spans(body))
            self._reply(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/spans":
                self._reply(404, b"", "text/plain")
                return
            self._reply(200, json.dumps(store.all()).encode(), "application/json")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    make_server(args.host, args.port, SpanStore()).serve_forever()


if __name__ == "__main__":
    main()
