"""`Tracing` from the OTEL_* variables: off by default, on for each exporter and protocol,
OTEL_SDK_DISABLED and OTEL_TRACES_EXPORTER=none win; and a span really reaches an OTLP
receiver over each protocol."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from pagedserve.telemetry import tracing as t
from pagedserve.telemetry.tracing import TraceSettings, Tracing

from otlp_receiver import GRPC, HTTP_PROTOBUF, OtlpReceiver

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


def _exporters(tracing: Tracing) -> list[type]:
    assert tracing.provider is not None
    processors = tracing.provider._active_span_processor._span_processors  # the SDK keeps them here
    assert all(isinstance(p, BatchSpanProcessor) for p in processors)
    return [type(p._batch_processor._exporter) for p in processors]


@pytest.mark.parametrize("environ", [
    {},  # nothing asked for
    {"OTEL_SERVICE_NAME": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},  # still no exporter or endpoint
    {**ENDPOINT, "OTEL_SDK_DISABLED": "true"},
    {**ENDPOINT, "OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"},
    {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"},
    {"OTEL_TRACES_EXPORTER": "zipkin"},  # not supported: warned about, off
])
def test_off(environ):
    tracing = Tracing.from_env("pagedserve-gateway", environ)
    assert not tracing.enabled and tracing.provider is None and tracing.tracer is None
    tracing.shutdown()  # nothing to do, no error


@pytest.mark.parametrize(("environ", "exporters"), [
    (ENDPOINT, [HttpExporter]),  # http/protobuf unless told
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, [HttpExporter]),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, [GrpcExporter]),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
     [HttpExporter]),  # the traces' own variable wins
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, [GrpcExporter]),  # the default endpoint
    ({"OTEL_TRACES_EXPORTER": "console"}, [ConsoleSpanExporter]),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp,console"}, [HttpExporter, ConsoleSpanExporter]),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, [HttpExporter]),  # unsupported: the default
])
def test_on(environ, exporters):
    tracing = Tracing.from_env("pagedserve-worker", environ)
    try:
        assert tracing.enabled
        assert _exporters(tracing) == exporters
        assert tracing.service_name == "pagedserve-worker"
    finally:
        tracing.shutdown()


def test_settings_and_service_name(monkeypatch):
    assert TraceSettings.from_env({}) == TraceSettings(False, (), "http/protobuf")
    assert TraceSettings.from_env({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": " GRPC "}) == \
        TraceSettings(True, ("otlp",), "grpc")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,service.name=ignored")
    tracing = Tracing.with_processors("pagedserve-gateway", [])
    assert tracing.service_name == "pagedserve-gateway"  # ours wins over OTEL_RESOURCE_ATTRIBUTES' name
    assert tracing.provider.resource.attributes["deployment.environment"] == "test"
    named = Tracing.with_processors("pagedserve-gateway", [], {"OTEL_SERVICE_NAME": "edge"})
    assert named.service_name == "edge"
    assert tracing.provider._span_limits.max_links == t.MAX_LINKS  # a step of 256 requests keeps every link


def test_traceparent_round_trip():
    tracing = Tracing.with_processors("x", [])
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = tracing.tracer.start_span("s", context=t.extract(client))
    header = t.traceparent_of(span)
    context = span.get_span_context()
    assert header == f"00-0af7651916cd43dd8448eb211c80319c-{context.span_id:016x}-01"
    assert t.extract(None) is None and t.extract("") is None


@pytest.mark.parametrize("protocol", [HTTP_PROTOBUF, GRPC])
def test_a_span_reaches_the_receiver(protocol):
    with OtlpReceiver(protocol) as receiver:
        tracing = Tracing.from_env("pagedserve-worker", {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                                         "OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
        with tracing.tracer.start_as_current_span("hello", attributes={"a": 1, "b": ["x", "y"]}):
            pass
        tracing.shutdown()  # flushes
        [span] = receiver.spans
        listed = httpx.get(receiver.endpoint + "/spans").json() if protocol == HTTP_PROTOBUF else None
    assert (span.name, span.service_name, span.attributes) == ("hello", "pagedserve-worker", {"a": 1, "b": ["x", "y"]})
    if listed is not None:  # what the compose test reads from the receiver in its container
        assert [(s["name"], s["service_name"], s["trace_id"], s["parent_span_id"], s["links"], s["attributes"])
                for s in listed] == [("hello", "pagedserve-worker", span.trace_id, None, [], {"a": 1, "b": ["x", "y"]})]


def test_shutdown_with_the_collector_down_is_bounded():
    """A closed port: the export fails (the SDK warns), and shutdown returns within its bound."""
    from serve_helpers import free_port

    tracing = Tracing.from_env("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    for _ in range(10):
        tracing.tracer.start_span("lost").end()
    tracing.shutdown(timeout=3.0)
    assert not tracing.enabled
