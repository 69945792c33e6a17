"""OpenTelemetry traces of one process: `Tracing` holds its own TracerProvider (never the SDK's
global one), built from the standard OTEL_* variables, and off unless they ask for it.

On when OTEL_SDK_DISABLED is not "true", OTEL_TRACES_EXPORTER is not "none", and an exporter
is asked for: OTEL_TRACES_EXPORTER names one ("otlp", "console", or both comma-separated), or
an OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).
The OTLP protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
else "http/protobuf": the OpenTelemetry specification's default (and port 4318's), which
needs no gRPC channel in the process. "grpc" selects the gRPC exporter. The exporters read
their own endpoint, headers, compression and timeout variables; without a timeout variable
an export gives up after `DEFAULT_EXPORT_TIMEOUT` seconds instead of the SDK's 10.

Spans are exported by a BatchSpanProcessor (its bounded queue and delays from OTEL_BSP_*):
ending a span only appends to that queue, the export runs in the processor's thread, and
when the collector is down the queue fills and further spans are dropped with the SDK's
warning. Nothing on a request's path or in an engine step ever waits for the collector.
When tracing is off there is no provider and no tracer: callers check `enabled` (or hold
`None`) and make no span at all.

The span and attribute names shared by the gateway and the workers are below: the GenAI
semantic conventions where they have a name, `pagedserve.*` for the rest.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from pagedserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: seconds one OTLP export may take when no OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT says
DEFAULT_EXPORT_TIMEOUT = 2.0
#: seconds `Tracing.shutdown` waits for the last spans to leave (a down collector must not hold a drain)
SHUTDOWN_TIMEOUT = 5.0
#: links a span may hold unless OTEL_SPAN_LINK_COUNT_LIMIT says (a step links each of its
#: requests: up to max_num_seqs, 256 by default)
MAX_LINKS = 4096
HTTP_PROTOBUF = "http/protobuf"
GRPC = "grpc"

# -- span names ------------------------------------------------------------------------------
QUEUE_SPAN = "pagedserve.queue"  # admission → a worker took it (emitted by the worker)
REQUEST_SPAN = "pagedserve.request"  # the worker's request span
STEP_SPAN = "pagedserve.engine.step"  # one engine step, linked to the requests it served

# -- attributes ------------------------------------------------------------------------------
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
ERROR_TYPE = "error.type"
GEN_AI_OPERATION = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_N = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prompt tokens from the prefix cache
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
REQUEST_ID = "pagedserve.request.id"
TENANT = "pagedserve.tenant"
WORKER_ID = "pagedserve.worker.id"
ATTEMPT = "pagedserve.attempt"  # the delivery: 1, then 2, … after a worker died with it
STRUCTURED_OUTPUT = "pagedserve.structured_output"  # the request's constraint kind (json, regex, ...), when it has one
RESUMED = "pagedserve.resumed"  # true when this worker continues what another began
TIME_TO_FIRST_TOKEN = "pagedserve.time_to_first_token"  # seconds, on this worker
PREEMPTIONS = "pagedserve.preemptions"
STEP_BATCHED_TOKENS = "pagedserve.step.num_batched_tokens"
STEP_PROMPT_TOKENS = "pagedserve.step.num_prompt_tokens"
STEP_GENERATED_TOKENS = "pagedserve.step.num_generated_tokens"
STEP_PREEMPTED = "pagedserve.step.num_preempted"
STEP_RUNNING = "pagedserve.step.num_running"
STEP_WAITING = "pagedserve.step.num_waiting"
STEP_KV_USAGE = "pagedserve.step.kv_cache_usage"
STEP_REQUESTS = "pagedserve.step.num_requests"

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """What the OTEL_* variables ask of this process."""

    enabled: bool
    exporters: tuple[str, ...]  # "otlp" and/or "console"; () when off
    protocol: str  # GRPC or HTTP_PROTOBUF (the OTLP exporter's)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TraceSettings:
        protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or HTTP_PROTOBUF).strip().lower()
        off = cls(False, (), protocol)
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return off
        named = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
        if "none" in named:
            return off
        if not named and (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
            named = ["otlp"]
        exporters = tuple(dict.fromkeys(e for e in named if e in ("otlp", "console")))
        for unknown in sorted(set(named) - {"otlp", "console"}):
            logger.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); ignored", unknown)
        if "otlp" in exporters and protocol not in (GRPC, HTTP_PROTOBUF):
            logger.warning("OTLP protocol %r is not supported (grpc, http/protobuf); using %s", protocol, HTTP_PROTOBUF)
            protocol = HTTP_PROTOBUF
        return cls(bool(exporters), exporters, protocol)


def otlp_exporter(protocol: str, environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """The OTLP span exporter for `protocol`. The endpoint comes from `environ` (as the exporter
    itself reads it: the traces' URL as is, or the base URL, to which HTTP adds /v1/traces);
    headers, certificates and compression from OTEL_* as the exporter reads them."""
    has_timeout = environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")
    timeout = None if has_timeout else DEFAULT_EXPORT_TIMEOUT
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint or base, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    if not endpoint and base:
        endpoint = base.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint, timeout=timeout)


class Tracing:
    """One process's traces: a tracer when on (`tracer`), nothing when off.

    Made once per process and passed to what makes spans (the gateway's state, the worker
    service); `shutdown` sends what is left, within SHUTDOWN_TIMEOUT.
    """

    def __init__(self, provider: TracerProvider | None = None):
        self.provider = provider  # None: tracing is off
        self.tracer: Tracer | None = provider.get_tracer("pagedserve") if provider is not None else None

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @classmethod
    def disabled(cls) -> Tracing:
        return cls(None)

    @classmethod
    def from_env(cls, default_service_name: str, environ: Mapping[str, str] = os.environ) -> Tracing:
        """As the OTEL_* variables say; service.name is OTEL_SERVICE_NAME, else `default_service_name`."""
        settings = TraceSettings.from_env(environ)
        if not settings.enabled:
            return cls.disabled()
        processors: list[SpanProcessor] = []
        for name in settings.exporters:
            exporter = otlp_exporter(settings.protocol, environ) if name == "otlp" else ConsoleSpanExporter()
            processors.append(BatchSpanProcessor(exporter))
        tracing = cls.with_processors(default_service_name, processors, environ)
        logger.info("tracing on: service %s, exporters %s (%s)", tracing.service_name, ",".join(settings.exporters),
                    settings.protocol)
        return tracing

    @classmethod
    def with_processors(cls, default_service_name: str, processors: list[SpanProcessor],
                        environ: Mapping[str, str] = os.environ) -> Tracing:
        """Tracing that hands its spans to `processors` (tests pass an in-memory exporter's)."""
        # Resource.create adds OTEL_RESOURCE_ATTRIBUTES (read from os.environ); the name wins over them.
        name = environ.get("OTEL_SERVICE_NAME") or default_service_name
        # A step span links every request it computed for: more than the SDK's 128 by default.
        limits = SpanLimits(max_links=None if environ.get("OTEL_SPAN_LINK_COUNT_LIMIT") else MAX_LINKS)
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}), span_limits=limits)
        for processor in processors:
            provider.add_span_processor(processor)
        return cls(provider)

    @property
    def service_name(self) -> str | None:
        return None if self.provider is None else str(self.provider.resource.attributes.get(SERVICE_NAME))

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Send the spans still queued and stop; gives up after `timeout` seconds (a collector
        that is down must not hold the process's exit)."""
        provider, self.provider, self.tracer = self.provider, None, None
        if provider is None:
            return
        thread = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("tracing: spans not sent within %g s at shutdown; dropped", timeout)


# -- W3C trace context -------------------------------------------------------------------------
def extract(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The context a `traceparent` header (and its `tracestate`) names; None without one."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)


def traceparent_of(span: Span) -> str | None:
    """The `traceparent` header string that makes a span the parent of another process's."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return carrier.get("traceparent")



def sampling_attributes(params: SamplingParams) -> dict[str, AttributeValue]:
    """The GenAI request attributes of a request's sampling parameters (the gateway's and the worker's)."""
    attributes: dict[str, AttributeValue] = {GEN_AI_TEMPERATURE: float(params.temperature),
                                             GEN_AI_TOP_P: float(params.top_p), GEN_AI_N: params.n}
    if params.max_tokens is not None:  # None: up to the context length
        attributes[GEN_AI_MAX_TOKENS] = params.max_tokens
    return attributes
