"""Traces of `pagedserve serve` as a process (the local twin of the compose check): pointed by
OTEL_EXPORTER_OTLP_ENDPOINT at tests/otlp_receiver.py (http/protobuf), one chat completion
gives the gateway's server span, the worker's queue, request and step spans, all in the
client's trace except the step spans (roots of their own, linked to the request span), with
each process's service.name and the GenAI attributes. Pointed at a closed port, completions
are answered as before and the workers keep stepping."""

from __future__ import annotations

import httpx
import pytest

from otlp_receiver import HTTP_PROTOBUF, OtlpReceiver
from serve_helpers import LiveServer, free_port
from tiny_models import build_checkpoint

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
HEADERS = {"Authorization": "Bearer sk-test-a", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("traced-llama"))


def _serve(model_dir, monkeypatch, endpoint: str) -> LiveServer:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", HTTP_PROTOBUF)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # milliseconds: the spans leave soon after they end
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    return LiveServer(model_dir, None, "--num-workers", "1", "--served-model-name", "tiny")


def test_one_completion_is_one_trace_across_gateway_and_worker(model_dir, monkeypatch):
    with OtlpReceiver(HTTP_PROTOBUF) as receiver:
        server = _serve(model_dir, monkeypatch, receiver.endpoint)
        try:
            server.wait_ready()
            r = httpx.post(server.base_url + "/v1/chat/completions", json=BODY, headers=HEADERS, timeout=60)
            assert r.status_code == 200
            answer = r.json()
            spans = receiver.wait_for(lambda got: {"POST /v1/chat/completions", "pagedserve.request"}
                                      <= {s.name for s in got})
        finally:
            server.stop()
        spans = receiver.spans  # with the steps the workers sent as they drained
    [gateway] = [s for s in spans if s.name == "POST /v1/chat/completions"]
    [queue] = [s for s in spans if s.name == "pagedserve.queue"]
    [request] = [s for s in spans if s.name == "pagedserve.request"]
    steps = [s for s in spans if s.name == "pagedserve.engine.step"]
    assert (gateway.service_name, queue.service_name, request.service_name) == \
        ("pagedserve-gateway", "pagedserve-worker", "pagedserve-worker")
    assert {s.trace_id for s in (gateway, queue, request)} == {TRACE_ID}
    assert gateway.parent_span_id == CLIENT_SPAN and gateway.kind == 2  # SERVER
    assert queue.parent_span_id == request.parent_span_id == gateway.span_id
    assert gateway.start_ns <= queue.start_ns <= queue.end_ns <= request.start_ns <= request.end_ns <= gateway.end_ns
    usage = answer["usage"]
    assert (usage["completion_tokens"], answer["choices"][0]["finish_reason"]) == (5, "length")
    expected = {"gen_ai.request.max_tokens": 5, "gen_ai.request.temperature": 0.0,
                "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": 5,
                "gen_ai.usage.cache_read.input_tokens": 0, "gen_ai.response.finish_reasons": ["length"]}
    assert {k: gateway.attributes[k] for k in expected} == expected
    assert {k: request.attributes[k] for k in expected} == expected
    assert (gateway.attributes["gen_ai.operation.name"], gateway.attributes["gen_ai.request.model"],
            gateway.attributes["http.response.status_code"]) == ("chat", "tiny", 200)
    assert request.attributes["pagedserve.preemptions"] == 0 and request.attributes["pagedserve.time_to_first_token"] > 0
    worker_id = request.attributes["pagedserve.worker.id"]
    # Five tokens: five steps, each a root of its own trace linked to the request span.
    assert len(steps) == 5
    assert all(s.parent_span_id is None and s.links == ((TRACE_ID, request.span_id),) for s in steps)
    assert {s.attributes["pagedserve.worker.id"] for s in steps} == {worker_id}
    assert not [s for s in spans if s.parent_span_id == request.span_id]


def test_a_collector_that_is_down_changes_nothing(model_dir, monkeypatch):
    server = _serve(model_dir, monkeypatch, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    try:
        server.wait_ready()
        for _ in range(3):
            r = httpx.post(server.base_url + "/v1/chat/completions", json=BODY, headers=HEADERS, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        assert server.stop() == 0
