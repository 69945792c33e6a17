"""The gateway's server span, in-process (an in-memory exporter, a fake worker on a real
Redis): it continues the client's traceparent, puts its own context in the queued message,
ends with the answer (for a stream, when the stream ends) with its usage, and an error
answer gets its status."""

from __future__ import annotations

import time

import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import (
    Chunk,
    CompletionDelta,
    QueuedRequest,
)
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.tokenizer import PromptTokenizer
from pagedserve.telemetry.tracing import Tracing

from serve_helpers import fake_worker
from tiny_models import build_tokenizer

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture()
def gateway(redis_server, tmp_path):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.zadd(q.WORKERS, {"w1": time.time() + 60})  # a live worker, as far as admission knows
    build_tokenizer(tmp_path)
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processors("pagedserve-gateway", [SimpleSpanProcessor(exporter)])
    app = create_app(ServeConfig(max_tokens_limit=32), redis_server.url, PromptTokenizer(tmp_path), ("tiny",), 64, {},
                     tracing=tracing)
    with TestClient(app) as http:
        yield http, client, exporter
    client.close()


CHUNKS = [Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=0, token_ids=[5, 6], text="ab")]),
          Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=2, token_ids=[7], text="c", finish_reason="length")],
                done=True, num_cached_tokens=0)]


@pytest.mark.parametrize("stream", [False, True])
def test_server_span_continues_the_client_and_goes_into_the_queue(gateway, stream):
    http, redis_client, exporter = gateway
    taken: list[QueuedRequest] = []
    worker = fake_worker(redis_client, CHUNKS, taken)
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0, "stream": stream}
    r = http.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
    worker.join()
    assert r.status_code == 200 and ("[DONE]" in r.text if stream else r.json()["choices"][0]["text"] == "abc")
    [span] = exporter.get_finished_spans()
    context = span.get_span_context()
    assert (span.name, span.kind) == ("POST /v1/completions", SpanKind.SERVER)
    assert f"{context.trace_id:032x}" == TRACE_ID and f"{span.parent.span_id:016x}" == CLIENT_SPAN
    assert span.resource.attributes["service.name"] == "pagedserve-gateway"
    assert [qr.traceparent for qr in taken] == [f"00-{TRACE_ID}-{context.span_id:016x}-01"]
    attributes = dict(span.attributes)
    assert attributes.pop("gen_ai.response.id").startswith("cmpl-")
    assert attributes == {
        "http.request.method": "POST", "http.route": "/v1/completions", "http.response.status_code": 200,
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "tiny", "gen_ai.request.max_tokens": 3,
        "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0, "gen_ai.request.choice.count": 1,
        "gen_ai.usage.input_tokens": 4, "gen_ai.usage.output_tokens": 3, "gen_ai.usage.cache_read.input_tokens": 0,
        "gen_ai.response.finish_reasons": ("length",),
    }
    assert span.status.status_code == StatusCode.UNSET


def test_a_new_trace_without_traceparent_and_errors_get_their_status(gateway, redis_server):
    http, redis_client, exporter = gateway
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert http.post("/v1/chat/completions", json={**ok, "max_tokens": 33}).status_code == 400  # the handler's check
    assert http.post("/v1/chat/completions", content=b"{").status_code == 400  # the body, before the handler
    redis_client.delete(q.WORKERS)
    assert http.post("/v1/chat/completions", json=ok).status_code == 503  # admission: no live worker
    assert http.get("/health").status_code == 200  # not traced
    spans = exporter.get_finished_spans()
    assert [(s.name, s.attributes["http.response.status_code"], s.attributes.get("error.type"), s.status.status_code)
            for s in spans] == [
        ("POST /v1/chat/completions", 400, "400", StatusCode.UNSET),  # the client's error (HTTP conventions)
        ("POST /v1/chat/completions", 400, "400", StatusCode.UNSET),
        ("POST /v1/chat/completions", 503, "503", StatusCode.ERROR),
    ]
    assert all(s.parent is None and s.attributes["gen_ai.operation.name"] == "chat" for s in spans)
    assert len({s.get_span_context().trace_id for s in spans}) == 3


def test_off_by_default_keeps_the_clients_traceparent(redis_server, tmp_path):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.zadd(q.WORKERS, {"w1": time.time() + 60})
    build_tokenizer(tmp_path)
    app = create_app(ServeConfig(), redis_server.url, PromptTokenizer(tmp_path), ("tiny",), 64, {})
    assert not app.state.gateway.tracing.enabled and app.middleware == []
    taken: list[QueuedRequest] = []
    with TestClient(app) as http:
        worker = fake_worker(client, CHUNKS, taken)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 3},
                      headers={"traceparent": TRACEPARENT})
        worker.join()
    assert r.status_code == 200 and [qr.traceparent for qr in taken] == [TRACEPARENT]
    client.close()
