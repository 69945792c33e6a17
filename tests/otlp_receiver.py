"""A small OTLP trace receiver for tests: it keeps every span it is sent, decoded.

    with OtlpReceiver("http/protobuf") as receiver:    # or "grpc"
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = receiver.protocol
        ...
        spans = receiver.wait_for(lambda spans: any(s.name == "pagedserve.request" for s in spans))

HTTP/protobuf: POST /v1/traces with an ExportTraceServiceRequest (gzip or not), answered
with an empty ExportTraceServiceResponse; GET /spans answers every span so far as a JSON list
of `ReceivedSpan` fields (what the compose test reads from the receiver it runs in a
container, in Jaeger's place: `python3 otlp_receiver.py --host 0.0.0.0 --port 4318`). gRPC: the TraceService's Export, on grpcio's
server. Both run in threads of the test process; `endpoint` is the base URL the exporters
take from OTEL_EXPORTER_OTLP_ENDPOINT (the HTTP exporter appends /v1/traces).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

HTTP_PROTOBUF = "http/protobuf"
GRPC = "grpc"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it, ids in hex."""

    name: str
    service_name: str  # its resource's service.name
    trace_id: str
    span_id: str
    parent_span_id: str | None  # None: a root span
    kind: int  # opentelemetry.proto Span.SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]  # values decoded: str, bool, int, float, or a list of them
    links: tuple[tuple[str, str], ...]  # (trace id, span id) of each link
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str = ""
    resource: dict[str, Any] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if kind is None else getattr(v, kind)


def decode(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of an export request."""
    spans = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(ReceivedSpan(
                    name=s.name, service_name=str(resource.get("service.name", "")), trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex() or None, kind=s.kind,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes={kv.key: _value(kv.value) for kv in s.attributes},
                    links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                    status_code=s.status.code, status_message=s.status.message, resource=resource,
                ))
    return spans


class OtlpReceiver:
    """Receives OTLP traces over `protocol` ("http/protobuf" or "grpc") on 127.0.0.1."""

    def __init__(self, protocol: str = HTTP_PROTOBUF, port: int = 0, host: str = "127.0.0.1"):
        assert protocol in (HTTP_PROTOBUF, GRPC), protocol
        self.protocol = protocol
        self._host = host
        self._port = port
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Condition()
        self.num_exports = 0  # export requests received
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> OtlpReceiver:
        if self.protocol == HTTP_PROTOBUF:
            self._http = ThreadingHTTPServer((self._host, self._port), self._http_handler())
            self._http.daemon_threads = True
            self._port = self._http.server_address[1]
            threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
        else:
            import grpc
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

            receiver = self

            class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):  # noqa: N802 - the generated name
                    receiver._add(decode(request))
                    return ExportTraceServiceResponse()

            self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
            self._port = self._grpc.add_insecure_port(f"{self._host}:{self._port}")
            self._grpc.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._grpc is not None:
            self._grpc.stop(grace=None)
            self._grpc = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """The base URL for OTEL_EXPORTER_OTLP_ENDPOINT (both protocols)."""
        return f"http://127.0.0.1:{self._port}"

    # -- what came -----------------------------------------------------------------------------
    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans once `predicate(spans)` holds; AssertionError (with what came) after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"OTLP receiver: condition not met in {timeout:g} s; got "
                                         f"{sorted((s.service_name, s.name) for s in self._spans)}")
                self._lock.wait(left)
            return list(self._spans)

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.num_exports += 1
            self._spans.extend(spans)
            self._lock.notify_all()

    def _http_handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._add(decode(ExportTraceServiceRequest.FromString(body)))
                self._reply(ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/spans":
                    self.send_error(404)
                    return
                self._reply(json.dumps([dataclasses.asdict(s) for s in receiver.spans]).encode(), "application/json")

            def _reply(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # quiet
                pass

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description="an OTLP trace receiver whose spans GET /spans lists")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--protocol", default=HTTP_PROTOBUF, choices=[HTTP_PROTOBUF])
    args = parser.parse_args()
    receiver = OtlpReceiver(args.protocol, args.port, args.host).start()
    threading.Event().wait()  # serve until killed
    receiver.stop()


if __name__ == "__main__":
    main()
