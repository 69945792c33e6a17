"""The worker's spans, in-process (a real tiny engine, a real Redis, an in-memory exporter):
each request's `pagedserve.queue` and `pagedserve.request` spans are children of the span in
its queued message; each engine step is one `pagedserve.engine.step` span, a root linked to
the request spans of exactly the requests it computed for, and no request span has children."""

from __future__ import annotations

import asyncio
import threading
import time

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pagedserve import LLM, SamplingParams
from pagedserve.common.queue_protocol import QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.common.step_stats import StepStats
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.telemetry.tracing import Tracing
from pagedserve.worker.service import WorkerService

TRACE_IDS = ["0af7651916cd43dd8448eb211c80319c", "4bf92f3577b34da6a3ce929d0e0e4736"]
GATEWAY_SPAN = "b7ad6b7169203331"
PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 7]]
MAX_TOKENS = [6, 3]


def _run_requests(redis_url: str, config: ServeConfig, requests: list[QueuedRequest]) -> None:
    async def one(client: QueueClient, request: QueuedRequest) -> None:
        await client.submit(request)
        async for _ in client.outputs(request.request_id, 1, request.deadline):
            pass

    async def run() -> None:
        client = QueueClient(redis_url, config)
        try:
            await asyncio.gather(*(one(client, r) for r in requests))
        finally:
            await client.close()

    asyncio.run(run())


def test_queue_request_and_linked_step_spans(tiny_checkpoint, monkeypatch):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22).engine
    steps: list[StepStats] = []
    step = engine.step

    def recording_step():
        deltas = step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
        return deltas

    monkeypatch.setattr(engine, "step", recording_step)
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processors("pagedserve-worker", [SimpleSpanProcessor(exporter)])
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=5.0, drain_timeout=1.0)
    with EmbeddedRedis() as redis_server:
        service = WorkerService(engine, config, redis_server.url, tracing=tracing)
        thread = threading.Thread(target=service.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not service.queue.redis.zscore("pagedserve:workers", service.worker_id):
            assert time.monotonic() < deadline, "the worker never beat"
            time.sleep(0.05)
        now = time.time()
        requests = [QueuedRequest(request_id=f"r{i}", prompt_token_ids=PROMPTS[i], deadline=now + 60, enqueued_at=now,
                                  traceparent=f"00-{TRACE_IDS[i]}-{GATEWAY_SPAN}-01",
                                  params=SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True))
                    for i in range(2)]
        try:
            _run_requests(redis_server.url, config, requests)
        finally:
            service.drain()
            thread.join(timeout=30)
        assert not thread.is_alive()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert sorted(by_name) == ["pagedserve.engine.step", "pagedserve.queue", "pagedserve.request"]
    assert {s.resource.attributes["service.name"] for s in spans} == {"pagedserve-worker"}
    request_spans = {s.attributes["pagedserve.request.id"]: s for s in by_name["pagedserve.request"]}
    queue_spans = {s.attributes["pagedserve.request.id"]: s for s in by_name["pagedserve.queue"]}
    assert sorted(request_spans) == sorted(queue_spans) == ["r0", "r1"]
    for i, request_id in enumerate(["r0", "r1"]):
        for span in (request_spans[request_id], queue_spans[request_id]):
            assert f"{span.get_span_context().trace_id:032x}" == TRACE_IDS[i]
            assert f"{span.parent.span_id:016x}" == GATEWAY_SPAN
        queue = queue_spans[request_id]
        assert queue.start_time == int(now * 1e9) and queue.end_time <= request_spans[request_id].start_time
        request = request_spans[request_id]
        assert request.kind == SpanKind.CONSUMER
        attributes = dict(request.attributes)
        assert attributes.pop("pagedserve.time_to_first_token") > 0
        assert attributes == {
            "pagedserve.request.id": request_id, "pagedserve.worker.id": service.worker_id,
            "gen_ai.request.model": engine.config.model, "gen_ai.request.max_tokens": MAX_TOKENS[i],
            "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0, "gen_ai.request.choice.count": 1,
            "pagedserve.attempt": 1, "pagedserve.resumed": False,
            "gen_ai.usage.input_tokens": len(PROMPTS[i]), "gen_ai.usage.output_tokens": MAX_TOKENS[i],
            "gen_ai.usage.cache_read.input_tokens": 0, "gen_ai.response.finish_reasons": ("length",),
            "pagedserve.preemptions": 0,
        }
    # One step span per engine step, in order, each linked to exactly its requests' spans.
    step_spans = sorted(by_name["pagedserve.engine.step"], key=lambda s: s.start_time)
    assert len(step_spans) == len(steps) and sum(len(s.request_ids) for s in steps) == sum(MAX_TOKENS)
    context_of = {r: s.get_span_context() for r, s in request_spans.items()}
    for stats, span in zip(steps, step_spans):
        assert span.parent is None
        assert [link.context for link in span.links] == [context_of[r] for r in stats.request_ids]
        assert span.attributes["pagedserve.step.num_batched_tokens"] == stats.num_batched_tokens
        assert span.attributes["pagedserve.step.num_generated_tokens"] == stats.num_generated_tokens
        assert span.attributes["pagedserve.worker.id"] == service.worker_id
    request_span_ids = {c.span_id for c in context_of.values()}
    assert not [s for s in spans if s.parent is not None and s.parent.span_id in request_span_ids]
    assert service.traces.spans == {}  # nothing kept once the requests ended


def test_off_makes_no_spans(tiny_checkpoint):
    from pagedserve.worker.request_tracing import NoRequestTraces

    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22).engine
    with EmbeddedRedis() as redis_server:
        service = WorkerService(engine, ServeConfig(), redis_server.url)
        assert type(service.traces) is NoRequestTraces
        service.queue.stop()


def test_spans_still_open_when_the_worker_stops_are_ended():
    from pagedserve.worker.request_tracing import request_traces

    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processors("pagedserve-worker", [SimpleSpanProcessor(exporter)])
    traces = request_traces(tracing, "w1", "tiny")
    request = QueuedRequest(request_id="r0", prompt_token_ids=[1, 2], deadline=time.time() + 60,
                            params=SamplingParams(max_tokens=2))
    traces.start(request, attempt=1)
    assert [s.name for s in exporter.get_finished_spans()] == []  # no enqueued_at: no queue span
    traces.close()
    (span,) = exporter.get_finished_spans()
    assert (span.name, span.status.status_code, span.status.description) == (
        "pagedserve.request", StatusCode.ERROR, "the worker stopped")
    traces.close()  # nothing left: no second end
    assert len(exporter.get_finished_spans()) == 1
