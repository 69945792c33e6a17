"""The compose test's OTLP receiver, in-process: spans exported by the OpenTelemetry SDK's
OTLP/HTTP exporter come back whole from GET /spans."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from otlp_receiver import SpanStore, make_server

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")


def test_spans_exported_over_otlp_http_come_back_with_ids_attributes_and_links():
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    server = make_server("127.0.0.1", 0, SpanStore())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
        tracer = provider.get_tracer("test")
        attributes = {"n": 3, "f": 0.5, "s": "x", "l": ["a", "b"]}
        with (tracer.start_as_current_span("parent", kind=trace.SpanKind.SERVER, attributes=attributes) as parent,
              tracer.start_as_current_span("child")):
            pass
        tracer.start_span("linked", links=[trace.Link(parent.get_span_context())]).end()
        provider.shutdown()
        with urllib.request.urlopen(url + "/spans") as reply:
            spans = {span["name"]: span for span in json.load(reply)}
    finally:
        server.shutdown()
        server.server_close()
    context = parent.get_span_context()
    trace_id, span_id = f"{context.trace_id:032x}", f"{context.span_id:016x}"
    assert set(spans) == {"parent", "child", "linked"}
    assert spans["parent"]["kind"] == 2  # SERVER
    assert spans["parent"]["service"] == "svc"
    assert (spans["parent"]["trace_id"], spans["parent"]["span_id"], spans["parent"]["parent_span_id"]) == (trace_id, span_id, "")
    assert spans["parent"]["attributes"] == {"n": 3, "f": 0.5, "s": "x", "l": ["a", "b"]}
    assert (spans["child"]["trace_id"], spans["child"]["parent_span_id"]) == (trace_id, span_id)
    assert spans["linked"]["trace_id"] != trace_id
    assert spans["linked"]["links"] == [{"trace_id": trace_id, "span_id": span_id}]
