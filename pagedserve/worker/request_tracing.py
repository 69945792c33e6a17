"""The worker's spans: for each request it takes, a `pagedserve.queue` span (admission → taken)
and a `pagedserve.request` span, both children of the gateway's span (the queued message's
`traceparent`); for each engine step a `pagedserve.engine.step` span *linked* to the request
spans it computed for. A step span is the root of its own trace: one step serves requests of
many traces, and a 2,000-token request gets 2,000 links pointing at it, not 2,000 children.

Everything here reads what the service and the engine already hand out (`QueuedRequest`,
`StepStats`, `FinishedRequestStats`). A request's span is kept from `start` until its end
is seen, and never after: `observe` ends the spans of the requests that ended this pass and
of any the service no longer runs. `NoRequestTraces` is what the service holds when tracing
is off: every method does nothing and no span is made.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable
from typing import NamedTuple

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from pagedserve.common.queue_protocol import QueuedRequest, WireError
from pagedserve.common.step_stats import FinishedRequestStats, StepStats
from pagedserve.telemetry import tracing as t
from pagedserve.telemetry.tracing import Tracing

_NS = 1_000_000_000
#: an empty context: a step span is a root, whatever span is current
_ROOT = Context()


class _Open(NamedTuple):
    """A request's open span, and the link a step span makes to it (made once, not per step)."""

    span: Span
    link: Link


class NoRequestTraces:
    """Tracing off: the service's calls cost a method call and make nothing."""

    def start(self, request: QueuedRequest, attempt: int) -> None:
        """A worker took `request` (delivery `attempt`)."""

    def error(self, request_id: str, error: WireError | None, started: bool) -> None:
        """The service ends a request outside a normal finish (`started`: the engine had it)."""

    def observe(self, step: StepStats | None, finished: Iterable[FinishedRequestStats],
                running: Container[str]) -> None:
        """After a pass: the latest step, the requests that ended, the requests still running."""

    def close(self) -> None:
        """The worker stops: end the spans of the requests still open."""


class RequestTraces(NoRequestTraces):
    """The spans of one worker's requests and steps."""

    def __init__(self, tracing: Tracing, worker_id: str, model: str):
        assert tracing.tracer is not None, "RequestTraces needs tracing on"
        self.tracer = tracing.tracer
        self.worker_id = worker_id
        self.model = model
        self.spans: dict[str, _Open] = {}  # request id → its open request span (only while it runs here)

    def start(self, request: QueuedRequest, attempt: int) -> None:
        parent = t.extract(request.traceparent)
        now_ns = time.time_ns()
        common: dict[str, AttributeValue] = {t.REQUEST_ID: request.request_id, t.WORKER_ID: self.worker_id}
        if request.enqueued_at is not None:
            # The gateway's clock: never let the span end before it starts when the hosts disagree.
            queued_ns = min(int(request.enqueued_at * _NS), now_ns)
            queue = self.tracer.start_span(t.QUEUE_SPAN, context=parent, kind=SpanKind.INTERNAL, start_time=queued_ns,
                                           attributes={**common, t.ATTEMPT: attempt})
            queue.end(end_time=now_ns)
        attributes: dict[str, AttributeValue] = {
            **common, **t.sampling_attributes(request.params), t.GEN_AI_MODEL: self.model, t.ATTEMPT: attempt,
            t.RESUMED: attempt > 1,
        }
        if request.tenant is not None:
            attributes[t.TENANT] = request.tenant
        if request.params.structured_outputs is not None:
            attributes[t.STRUCTURED_OUTPUT] = request.params.structured_outputs.kind
        old = self.spans.pop(request.request_id, None)
        if old is not None:  # taken again while an earlier delivery's span was open here
            old.span.end()
        span = self.tracer.start_span(t.REQUEST_SPAN, context=parent, kind=SpanKind.CONSUMER, start_time=now_ns,
                                      attributes=attributes)
        self.spans[request.request_id] = _Open(span, Link(span.get_span_context()))

    def error(self, request_id: str, error: WireError | None, started: bool) -> None:
        open_ = self.spans.get(request_id)
        if open_ is None:
            return
        span = open_.span
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error.message))
            span.set_attribute(t.ERROR_TYPE, error.code or error.type)
        if not started:  # the engine never had it: nothing more will come
            del self.spans[request_id]
            span.end()

    def observe(self, step: StepStats | None, finished: Iterable[FinishedRequestStats],
                running: Container[str]) -> None:
        offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic → unix nanoseconds
        if step is not None:
            self._step_span(step, offset_ns)
        for stats in finished:
            open_ = self.spans.pop(stats.request_id, None)
            if open_ is not None:
                self._end(open_.span, stats, offset_ns)
        # A request the service dropped without an engine end (settled on resume, lost): end it.
        for request_id in [r for r in self.spans if r not in running]:
            self.spans.pop(request_id).span.end()

    def close(self) -> None:
        for open_ in self.spans.values():
            open_.span.set_status(Status(StatusCode.ERROR, "the worker stopped"))
            open_.span.end()
        self.spans.clear()

    def _end(self, span: Span, stats: FinishedRequestStats, offset_ns: int) -> None:
        span.set_attributes({
            t.GEN_AI_INPUT_TOKENS: stats.num_prompt_tokens, t.GEN_AI_OUTPUT_TOKENS: stats.num_output_tokens,
            t.GEN_AI_CACHED_TOKENS: stats.num_cached_tokens, t.GEN_AI_FINISH_REASONS: stats.finish_reasons,
            t.PREEMPTIONS: stats.num_preemptions,
        })
        if (ttft := stats.time_to_first_token) is not None:
            span.set_attribute(t.TIME_TO_FIRST_TOKEN, ttft)
        if stats.error is not None:
            span.set_status(Status(StatusCode.ERROR, stats.error))
            span.set_attribute(t.ERROR_TYPE, "engine_error")
        span.end(end_time=int(stats.finished_time * _NS) + offset_ns)

    def _step_span(self, step: StepStats, offset_ns: int) -> None:
        spans = self.spans
        links = [spans[r].link for r in step.request_ids if r in spans]
        span = self.tracer.start_span(
            t.STEP_SPAN, context=_ROOT, kind=SpanKind.INTERNAL, links=links,
            start_time=int(step.started * _NS) + offset_ns,
            attributes={
                t.WORKER_ID: self.worker_id, t.STEP_REQUESTS: len(step.request_ids),
                t.STEP_BATCHED_TOKENS: step.num_batched_tokens, t.STEP_PROMPT_TOKENS: step.num_prompt_tokens,
                t.STEP_GENERATED_TOKENS: step.num_generated_tokens, t.STEP_PREEMPTED: step.num_preempted,
                t.STEP_RUNNING: step.num_running, t.STEP_WAITING: step.num_waiting,
                t.STEP_KV_USAGE: step.kv_cache_usage,
            })
        span.end(end_time=int(step.ended * _NS) + offset_ns)


def request_traces(tracing: Tracing | None, worker_id: str, model: str) -> NoRequestTraces:
    """What the worker service records its requests with: nothing when tracing is off."""
    if tracing is None or not tracing.enabled:
        return NoRequestTraces()
    return RequestTraces(tracing, worker_id, model)
