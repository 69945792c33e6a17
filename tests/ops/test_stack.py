"""The compose stack for real (Docker): the images built, `--profile cpu` up with two CPU
workers and a tiny model, a completion through the gateway, its trace from the gateway to
the worker at an OTLP receiver, the counters on the gateway's /metrics and a worker's port,
Prometheus scraping the gateway, the prefix cache service and both workers;
then a worker killed mid-stream and Redis stopped and started.

The local twins: tests/ops/test_compose_file.py (the file), test_images.py (what the images
hold), and the traces' and metrics' own in-process tests.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time

import httpx
import pytest
from stack import ComposeStack

from tiny_models import build_checkpoint

pytestmark = pytest.mark.docker

NUM_WORKERS = 2
WORKER_METRICS_PORT = 9400  # compose.yaml's PAGEDSERVE_WORKER_METRICS_PORT
#: a context long enough that one greedy request runs for seconds on one CPU thread
MAX_POSITIONS = 4096


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("compose-model")
    build_checkpoint("llama", model_dir, max_position_embeddings=MAX_POSITIONS)
    # the containers run as a user of their own: the checkpoint must be readable by all
    for path in [model_dir, *model_dir.parents[:2], *model_dir.iterdir()]:
        path.chmod(path.stat().st_mode | 0o555 if path.is_dir() else 0o644)
    stack = ComposeStack(model_dir, NUM_WORKERS)
    stack.build()
    try:
        stack.up()
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.down()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _chat(stack: ComposeStack, traceparent: str | None = None, max_tokens: int = 6) -> dict:
    headers = {"traceparent": traceparent} if traceparent else {}
    reply = httpx.post(stack.url + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "/models", "messages": [{"role": "user", "content": "Hello world"}],
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_ready_counts_both_workers_and_a_chat_completion_is_answered(stack):
    assert httpx.get(stack.url + "/ready", timeout=10).json() == {"status": "ready", "workers": NUM_WORKERS}
    body = _chat(stack)
    assert body["object"] == "chat.completion"
    assert body["model"] == "/models"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6
    # the gateway's and every worker's health checks pass; no GPU worker was started
    assert stack.containers("worker") == []
    containers = stack.containers("gateway") + stack.containers("worker-cpu")
    assert len(containers) == 1 + NUM_WORKERS
    end = time.monotonic() + 60  # a check runs every 5 s
    while (health := _health(containers)) != ["healthy"] * len(containers) and time.monotonic() < end:
        time.sleep(1)
    assert health == ["healthy"] * len(containers)
    print(f"compose up to /ready 200: {stack.up_seconds:.1f} s; to both workers: {stack.all_workers_seconds:.1f} s")


def _health(containers: list[str]) -> list[str]:
    return [subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", c], capture_output=True, text=True,
                           check=True).stdout.strip() for c in containers]


def _spans_of(stack: ComposeStack, trace_id: str, until: set[str], deadline_s: float = 30) -> list[dict]:
    """The receiver's spans of `trace_id` (and the step spans linked to it), polled until
    every name in `until` has arrived."""
    end = time.monotonic() + deadline_s
    spans: list[dict] = []
    while time.monotonic() < end:
        try:
            every = httpx.get(stack.receiver_url + "/spans", timeout=5).json()
        except httpx.HTTPError as exc:
            raise AssertionError(f"the OTLP receiver does not answer: {exc}\n{stack.logs()}") from exc
        spans = [s for s in every if s["trace_id"] == trace_id or any(link[0] == trace_id for link in s["links"])]
        if until <= {s["name"] for s in spans}:
            return spans
        time.sleep(0.5)
    raise AssertionError(f"spans of trace {trace_id} never all arrived: got {sorted(s['name'] for s in spans)}")


def test_one_trace_runs_from_the_gateway_to_the_worker(stack):
    traceparent, trace_id, client_span_id = _traceparent()
    body = _chat(stack, traceparent, max_tokens=5)
    names = {"POST /v1/chat/completions", "pagedserve.queue", "pagedserve.request", "pagedserve.engine.step"}
    spans = _spans_of(stack, trace_id, names)
    (server,) = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    (queue,) = [s for s in spans if s["name"] == "pagedserve.queue"]
    (request,) = [s for s in spans if s["name"] == "pagedserve.request"]
    steps = [s for s in spans if s["name"] == "pagedserve.engine.step"]
    assert (server["service_name"], server["kind"], server["trace_id"], server["parent_span_id"]) == (
        "pagedserve-gateway", 2, trace_id, client_span_id)
    usage = body["usage"]
    assert {k: server["attributes"].get(k) for k in (
        "http.request.method", "http.route", "http.response.status_code", "gen_ai.operation.name",
        "gen_ai.request.model", "gen_ai.request.max_tokens", "gen_ai.request.temperature",
        "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons")} == {
        "http.request.method": "POST", "http.route": "/v1/chat/completions", "http.response.status_code": 200,
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "/models", "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.0, "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": 5, "gen_ai.response.finish_reasons": ["length"]}
    for child in (queue, request):  # one trace: the worker's spans are children of the gateway's
        assert (child["service_name"], child["trace_id"], child["parent_span_id"]) == (
            "pagedserve-worker", trace_id, server["span_id"])
    assert request["attributes"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert request["attributes"]["pagedserve.worker.id"].split("-")[0] in {
        c[:12] for c in stack.containers("worker-cpu")}
    # steps are not children of the request: they link to it (a prefill, then 4 decodes at least)
    assert steps and all(s["trace_id"] != trace_id and s["parent_span_id"] is None for s in steps)
    assert all([trace_id, request["span_id"]] in s["links"] for s in steps)
    assert len(steps) >= 5


def _metrics(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _total(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples.items() if sample == name and wanted <= sample_labels)


def _gateway_metrics(stack: ComposeStack) -> dict:
    reply = httpx.get(stack.url + "/metrics", timeout=10)
    assert reply.status_code == 200, f"GET /metrics: {reply.status_code}"
    return _metrics(reply.text)


def _worker_metrics(stack: ComposeStack) -> list[dict]:
    """Each worker's metrics, read inside its container (the port is not published: scaled)."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{WORKER_METRICS_PORT}/metrics').read().decode())"
    return [_metrics(stack.exec_python(c, code)) for c in stack.containers("worker-cpu")]


def _prometheus(stack: ComposeStack, path: str, **params: str) -> dict:
    reply = httpx.get(stack.prometheus_url + path, params=params, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["data"]


def test_prometheus_scrapes_the_gateway_the_prefix_cache_and_every_worker(stack):
    """ops/prometheus.yml as compose runs it: the gateway, the prefix cache service, and each
    scaled worker found by DNS."""
    _chat(stack)
    end = time.monotonic() + 90  # DNS discovery refreshes every 15 s, scrapes every 5 s
    while True:
        targets = _prometheus(stack, "/api/v1/targets")["activeTargets"]
        up = sorted((t["labels"]["job"], t["health"]) for t in targets)
        if up == [("pagedserve-gateway", "up"), ("pagedserve-prefix-cache", "up")] + [
                ("pagedserve-worker", "up")] * NUM_WORKERS:
            break
        assert time.monotonic() < end, f"targets never all up: {up}\n{stack.logs()}"
        time.sleep(1)
    end = time.monotonic() + 30  # the request's counters reach Prometheus at the next scrapes
    while True:
        result = _prometheus(stack, "/api/v1/query", query="count(pagedserve:num_requests_running)")["result"]
        alive = _prometheus(stack, "/api/v1/query", query="max(pagedserve:workers_alive)")["result"]
        if result and alive and (result[0]["value"][1], alive[0]["value"][1]) == (str(NUM_WORKERS), str(NUM_WORKERS)):
            break
        assert time.monotonic() < end, f"queries: {result}, {alive}"
        time.sleep(1)


def test_the_counters_of_one_completion_on_the_gateway_and_the_workers(stack):
    gateway_before, workers_before = _gateway_metrics(stack), _worker_metrics(stack)
    body = _chat(stack, max_tokens=7)
    gateway_after = _gateway_metrics(stack)
    route = {"route": "/v1/chat/completions", "status_code": "200"}
    assert _total(gateway_after, "pagedserve:http_requests_total", **route) - _total(
        gateway_before, "pagedserve:http_requests_total", **route) == 1
    assert _total(gateway_after, "pagedserve:workers_alive") == NUM_WORKERS
    # the gateway refreshes its queue gauge every 2 s (gateway/app.py's _watch_workers): a
    # refresh taken while the request waited can still show it until the next one
    end = time.monotonic() + 10
    while _total(gateway_after, "pagedserve:queue_depth") != 0 and time.monotonic() < end:
        time.sleep(0.5)
        gateway_after = _gateway_metrics(stack)
    assert _total(gateway_after, "pagedserve:queue_depth") == 0
    # the worker counts its request when it ends, after the gateway's answer: poll briefly
    end = time.monotonic() + 10
    while True:
        workers_after = _worker_metrics(stack)
        done = sum(_total(w, "pagedserve:request_success_total") for w in workers_after) - sum(
            _total(w, "pagedserve:request_success_total") for w in workers_before)
        if done >= 1 or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert done == 1

    def delta(name: str, **labels: str) -> float:
        return sum(_total(w, name, **labels) for w in workers_after) - sum(_total(w, name, **labels) for w in workers_before)

    assert delta("pagedserve:request_success_total", finished_reason="length") == 1
    assert delta("pagedserve:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("pagedserve:generation_tokens_total") == 7
    assert delta("pagedserve:e2e_request_latency_seconds_count") == 1
    assert delta("pagedserve:time_to_first_token_seconds_count") == 1


def test_redis_stopped_gives_503_and_started_again_gives_200(stack):
    stack.compose("stop", "redis")
    try:
        ready = httpx.get(stack.url + "/ready", timeout=30)
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "redis_unavailable"
        reply = httpx.post(stack.url + "/v1/completions", timeout=60,
                           json={"model": "/models", "prompt": "Hello", "max_tokens": 3})
        assert reply.status_code == 503, reply.text
    finally:
        stack.compose("start", "redis")
    assert stack.wait_ready(deadline_s=60, workers=NUM_WORKERS) == {"status": "ready", "workers": NUM_WORKERS}
    assert _chat(stack)["usage"]["completion_tokens"] == 6


def _stream_completion(stack: ComposeStack, body: dict, first_chunk: threading.Event, events: list[dict]) -> None:
    with httpx.stream("POST", stack.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append({"done": True} if data == "[DONE]" else json.loads(data))
            first_chunk.set()


#: run in a worker container: the consumer of every pending request entry, in whichever
#: request stream the queue keeps it (shared, tenant or routed to a worker), one per line
_PENDING_CONSUMERS = """
import os, redis
from pagedserve.common import queue_protocol as q
r = redis.Redis.from_url(os.environ["PAGEDSERVE_REDIS_URL"])
for stream in q.request_streams(r.smembers(q.TENANTS)):
    if r.exists(stream):
        for entry in r.xpending_range(stream, q.GROUP, "-", "+", 10):
            print(stream, entry["consumer"].decode())
"""


def _worker_running(stack: ComposeStack) -> str:
    """The container of the worker whose consumer holds the one pending request."""
    workers = stack.containers("worker-cpu")
    pending = [line.split() for line in stack.exec_python(workers[0], _PENDING_CONSUMERS).splitlines()]
    assert len(pending) == 1, f"one request runs, pending entries: {pending}"
    ((_, consumer),) = pending
    (container,) = [c for c in workers if consumer.startswith(c[:12] + "-")]
    return container


def test_a_worker_killed_mid_stream_and_the_request_still_finishes_whole(stack):
    body = {"model": "/models", "prompt": "The capital of France is", "max_tokens": 3000, "temperature": 0.0,
            "ignore_eos": True}
    reference = httpx.post(stack.url + "/v1/completions", json=body, timeout=300).json()
    assert reference["usage"]["completion_tokens"] == 3000
    first_chunk, events = threading.Event(), []
    reader = threading.Thread(target=_stream_completion, args=(stack, body, first_chunk, events))
    reader.start()
    assert first_chunk.wait(60)
    victim = _worker_running(stack)
    subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
    killed_at = len(events)
    reader.join(300)
    assert not reader.is_alive()
    assert events[-1] == {"done": True}
    assert killed_at < len(events) - 2  # the kill came before the end: tokens followed it
    chunks = events[:-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference["choices"][0]["text"]
    assert len(stack.containers("worker-cpu")) == NUM_WORKERS - 1
