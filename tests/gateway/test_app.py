"""The gateway without workers: admission bounds, 503 with no live worker, and the context
check, against a real Redis the test owns (no model weights, no torch in the gateway)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from pagedserve.common import queue_protocol as q
from pagedserve.common.errors import QueueFullError, ServiceUnavailableError
from pagedserve.common.queue_protocol import (
    Chunk,
    CompletionDelta,
    QueuedRequest,
    WireError,
    decode_request,
)
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.tokenizer import PromptTokenizer

from serve_helpers import fake_worker
from tiny_models import build_tokenizer


def _container_redis_image() -> str:
    """PAGEDSERVE_TEST_REDIS_IMAGE, else the public redis:7.4; on a machine that reaches no
    registry (its base image local/debian:bookworm exists), local/redis:bookworm from Debian's
    redis-server, built by ops/build-local.sh when missing."""
    if image := os.environ.get("PAGEDSERVE_TEST_REDIS_IMAGE"):
        return image

    def exists(name: str) -> bool:
        return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0

    if not exists("local/debian:bookworm"):
        return "redis:7.4"
    # nor can testcontainers' reaper image be pulled there (read when testcontainers is imported)
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    if not exists("local/redis:bookworm"):
        subprocess.run([str(Path(__file__).parents[2] / "ops" / "build-local.sh"), "redis"], check=True,
                       capture_output=True, timeout=600)
    return "local/redis:bookworm"


class _ContainerRedis:
    """Redis in a container (testcontainers), where a Docker engine exists."""

    def __enter__(self):
        image = _container_redis_image()
        from testcontainers.redis import RedisContainer

        self.container = RedisContainer(image).start()
        port = self.container.get_exposed_port(6379)
        self.url = f"redis://{self.container.get_container_host_ip()}:{port}/0"
        return self

    def __exit__(self, *exc):
        self.container.stop()


@pytest.fixture(scope="module", params=["local", pytest.param("container", marks=pytest.mark.docker)])
def redis_server(request):
    """The same tests on a redis-server pagedserve starts, and in a container where Docker is."""
    with (EmbeddedRedis() if request.param == "local" else _ContainerRedis()) as server:
        yield server


@pytest.fixture()
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


def _queued(i: int, num_tokens: int) -> QueuedRequest:
    return QueuedRequest(request_id=f"r{i}", prompt_token_ids=list(range(1, num_tokens + 1)),
                         params=SamplingParams(max_tokens=4), deadline=time.time() + 60)


def _beat(redis_client, worker_id: str = "w1") -> None:
    redis_client.zadd(q.WORKERS, {worker_id: time.time() + 60})


def test_admission_bounds_requests_and_tokens(redis_server, redis_client):
    config = ServeConfig(max_queued_requests=3, max_queued_tokens=100)

    async def scenario():
        queue = QueueClient(redis_server.url, config)
        try:
            with pytest.raises(ServiceUnavailableError):  # no live worker
                await queue.submit(_queued(0, 10))
            _beat(redis_client)
            await queue.submit(_queued(1, 60))
            with pytest.raises(QueueFullError):  # 60 + 50 tokens > 100
                await queue.submit(_queued(2, 50))
            await queue.submit(_queued(3, 40))  # exactly 100
            with pytest.raises(QueueFullError):
                await queue.submit(_queued(4, 1))
            redis_client.set(q.QUEUED_TOKENS, 0)  # as if a worker took their tokens
            await queue.submit(_queued(5, 1))  # the third request
            with pytest.raises(QueueFullError):  # a fourth is one too many
                await queue.submit(_queued(6, 1))
        finally:
            await queue.close()

    asyncio.run(scenario())
    assert int(redis_client.get(q.QUEUED)) == 3
    entries = redis_client.xrange(q.REQUESTS)
    assert [decode_request(fields[q.REQUEST_FIELD]).request_id for _, fields in entries] == ["r1", "r3", "r5"]
    assert [int(fields[q.PROMPT_TOKENS_FIELD]) for _, fields in entries] == [60, 40, 1]


def test_oversized_request_is_let_into_an_empty_queue(redis_server, redis_client):
    _beat(redis_client)

    async def scenario():
        queue = QueueClient(redis_server.url, ServeConfig(max_queued_tokens=10))
        try:
            await queue.submit(_queued(1, 50))  # alone it could never run otherwise
            with pytest.raises(QueueFullError):
                await queue.submit(_queued(2, 1))
        finally:
            await queue.close()

    asyncio.run(scenario())


def test_http_errors_without_workers(redis_server, redis_client, tokenizer_dir):
    app = create_app(ServeConfig(max_body_bytes=2000, max_tokens_limit=32, max_prompt_tokens=40), redis_server.url,
                     PromptTokenizer(tokenizer_dir), ("tiny",), 64, {})
    with TestClient(app) as http:
        def error(path: str, body) -> tuple[int, str | None, str | None]:
            r = http.post(path, json=body) if not isinstance(body, bytes) else http.post(path, content=body)
            e = r.json()["error"]
            return r.status_code, e["code"], e["param"]

        ok = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        assert error("/v1/completions", ok) == (503, "service_unavailable", None)
        assert http.get("/ready").status_code == 503
        assert error("/v1/completions", {**ok, "max_tokens": 33}) == (400, "invalid_parameter", "max_tokens")
        assert error("/v1/completions", {**ok, "prompt": list(range(1, 42))}) == (400, "invalid_parameter", "prompt")
        assert error("/v1/completions", {**ok, "prompt": [1, 2, 999]}) == (400, "invalid_parameter", "prompt")
        assert error("/v1/completions", {**ok, "prompt": [[1], "x"]}) == (400, "invalid_parameter", "prompt")
        assert error("/v1/completions", {**ok, "prompt": list(range(1, 36)), "max_tokens": 32}) == (400, "context_length_exceeded", "prompt")
        assert error("/v1/completions", {**ok, "echo": True}) == (400, "invalid_parameter", "echo")
        # one request cannot take the gateway or a worker: prompts, prompts × n, stop lists
        assert error("/v1/completions", {**ok, "prompt": ["a"] * 65}) == (400, "invalid_parameter", "prompt")
        assert error("/v1/completions", {**ok, "prompt": ["a"] * 16, "n": 9}) == (400, "invalid_parameter", "n")
        assert error("/v1/completions", {**ok, "stop": ["s"] * 17}) == (400, "invalid_parameter", "stop")
        assert error("/v1/completions", {**ok, "stop": ["s" * 257]}) == (400, "invalid_parameter", "stop")
        assert error("/v1/completions", {**ok, "stop_token_ids": [1] * 65}) == (400, "invalid_parameter", "stop_token_ids")
        assert error("/v1/completions", {**ok, "prompt": ["a"] * 16, "n": 8, "stop": ["s"] * 16})[0] == 503  # at the limits
        assert error("/v1/completions", {**ok, "logit_bias": {"5": 1.0}}) == (400, "invalid_parameter", "logit_bias")
        assert error("/v1/completions", {"prompt": "x"}) == (400, "invalid_parameter", "model")
        assert error("/v1/completions", b"x" * 3000)[0] == 413
        assert error("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) \
            == (400, "invalid_parameter", "messages[0].content")
        assert error("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "tools": [{"type": "function"}]}) == (400, "invalid_parameter", "tools[0]")
        _beat(redis_client)
        assert http.get("/ready").status_code == 503  # a beat, but no worker info: not a live worker
        assert http.get("/v1/nothing").status_code == 404
    # nothing was queued by any of it
    assert redis_client.xlen(q.REQUESTS) == 0 and int(redis_client.get(q.QUEUED) or 0) == 0


def test_api_keys(redis_server, redis_client, tokenizer_dir):
    app = create_app(ServeConfig(), redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {"sk-1": "t1"})
    with TestClient(app) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer sk-2"}).json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers={"Authorization": "Bearer sk-1"}).json()["data"][0]["id"] == "tiny"
        assert http.get("/health").status_code == 200  # probes need no key


def test_tenant_is_the_cache_salt_and_unanswered_requests_time_out(redis_server, redis_client, tokenizer_dir):
    """A worker beats but never answers: the request ends with a timeout, and what was queued
    carries the caller's tenant as its prefix-cache salt."""
    config = ServeConfig(request_timeout=1.0)
    app = create_app(config, redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {"sk-1": "t1", "sk-2": "t2"})
    _beat(redis_client)
    started = time.time()
    with TestClient(app) as http:
        for key in ("sk-1", "sk-2"):
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2},
                          headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    ended = time.time()
    # each tenant's requests wait in its own stream
    entries = redis_client.xrange(q.requests_key("t1")) + redis_client.xrange(q.requests_key("t2"))
    queued = [decode_request(fields[q.REQUEST_FIELD]) for _, fields in entries]
    assert [r.cache_salt for r in queued] == ["t1", "t2"] and [r.tenant for r in queued] == ["t1", "t2"]
    assert redis_client.xlen(q.REQUESTS) == 0
    assert {m.decode() for m in redis_client.smembers(q.TENANTS)} == {q.requests_key("t1"), q.requests_key("t2")}
    assert [r.prompt_token_ids for r in queued] == [[1, 2, 3], [1, 2, 3]]
    assert all(started + 1.0 <= r.deadline <= ended for r in queued)  # admission time + request_timeout


def test_drain_refuses_new_requests_and_ends_running_ones_in_time(redis_server, redis_client, tokenizer_dir):
    app = create_app(ServeConfig(drain_timeout=0.5), redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {})
    _beat(redis_client)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
    with TestClient(app) as http:
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=body)))
        waiting.start()
        deadline = time.monotonic() + 10
        while redis_client.xlen(q.REQUESTS) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        app.state.gateway.begin_drain()  # what SIGTERM does
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert http.get("/ready").status_code == 503
        waiting.join(timeout=10)
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "shutting_down"
    # the abandoned request was cancelled for the workers
    [(_, fields)] = redis_client.xrange(q.REQUESTS)
    assert redis_client.exists(q.cancelled_key(decode_request(fields[q.REQUEST_FIELD]).request_id)) == 1


def test_an_error_after_some_tokens(redis_server, redis_client, tokenizer_dir):
    """Not streamed: the whole answer is the error. Streamed: the tokens, then an error event."""
    app = create_app(ServeConfig(), redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {})
    _beat(redis_client)
    chunks = [Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=0, token_ids=[5, 6], text="ab")]),
              Chunk(attempt=1, done=True, error=WireError(message="engine step failed", code="engine_error"))]
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8}
    with TestClient(app) as http:
        worker = fake_worker(redis_client, chunks)
        r = http.post("/v1/completions", json=body)
        worker.join()
        assert r.status_code == 500 and r.json()["error"] == {"message": "engine step failed", "type": "server_error",
                                                              "param": None, "code": "engine_error"}
        worker = fake_worker(redis_client, chunks)
        r = http.post("/v1/completions", json={**body, "stream": True})
        worker.join()
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert [e if e == "[DONE]" else list(json.loads(e)) for e in events] == [
        ["id", "object", "created", "model", "choices"], ["error"], "[DONE]"]
    assert json.loads(events[0])["choices"][0]["text"] == "ab"
    assert json.loads(events[1])["error"]["code"] == "engine_error"


def test_admission_is_idempotent_and_survives_a_redis_restart():
    """A pooled connection that a restart closed is retried on a new one; a retried admission
    of the same request queues nothing more."""
    import redis

    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)

        async def scenario():
            queue = QueueClient(server.url, ServeConfig())
            try:
                _beat(client)
                await queue.submit(_queued(1, 5))
                await queue.submit(_queued(1, 5))  # the same request id again
                assert client.xlen(q.REQUESTS) == 1 and int(client.get(q.QUEUED)) == 1
                server.stop()
                server.start()  # same port, empty; the queue's pooled connection is now dead
                _beat(client)
                await queue.submit(_queued(2, 5))
                assert [decode_request(f[q.REQUEST_FIELD]).request_id for _, f in client.xrange(q.REQUESTS)] == ["r2"]
            finally:
                await queue.close()

        try:
            asyncio.run(scenario())
        finally:
            client.close()


def test_a_null_max_tokens_is_capped_by_the_limit():
    from types import SimpleNamespace

    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.gateway.validation import check_admission

    state = SimpleNamespace(drain_deadline=None, config=ServeConfig(max_tokens_limit=32), max_model_len=64, vocab_size=320)
    assert check_admission(state, [[1, 2, 3]], SamplingParams(max_tokens=None)).max_tokens == 32
    assert check_admission(state, [[1, 2, 3]], SamplingParams(max_tokens=5)).max_tokens == 5
    # null still means "up to the context" for a long prompt: the worker stops at the context
    assert check_admission(state, [list(range(1, 50))], SamplingParams(max_tokens=None)).max_tokens == 32
    unlimited = SimpleNamespace(drain_deadline=None, config=ServeConfig(), max_model_len=64, vocab_size=320)
    assert check_admission(unlimited, [[1, 2, 3]], SamplingParams(max_tokens=None)).max_tokens is None


def test_tenant_limits_give_429_naming_the_limit(redis_server, redis_client, tokenizer_dir):
    """Each tenant has its own bounds (the keys file's, else the config's); the 429 says which."""
    from pagedserve.common.errors import TenantLimitError
    from pagedserve.gateway.auth import TenantLimits

    config = ServeConfig(tenant_max_requests=3, tenant_max_queued_tokens=1000)
    _beat(redis_client)

    def tenant_request(i: int, tenant: str, num_tokens: int = 5) -> QueuedRequest:
        return QueuedRequest(request_id=f"{tenant}-{i}", prompt_token_ids=[1] * num_tokens, tenant=tenant,
                             params=SamplingParams(max_tokens=4), deadline=time.time() + 60)

    async def scenario():
        queue = QueueClient(redis_server.url, config)
        try:
            await queue.submit(tenant_request(0, "a"), max_requests=2)
            await queue.submit(tenant_request(1, "a"), max_requests=2)
            with pytest.raises(TenantLimitError) as limited:
                await queue.submit(tenant_request(2, "a"), max_requests=2)
            assert limited.value.code == "tenant_requests_limit" and limited.value.status_code == 429
            for i in range(3):  # another tenant is not held back by a's limit; the default applies
                await queue.submit(tenant_request(i, "b"))
            with pytest.raises(TenantLimitError, match="3 requests in flight"):
                await queue.submit(tenant_request(3, "b"))
            await queue.submit(tenant_request(0, "c", 600))
            with pytest.raises(TenantLimitError) as limited:
                await queue.submit(tenant_request(1, "c", 600))
            assert limited.value.code == "tenant_tokens_limit"
        finally:
            await queue.close()

    asyncio.run(scenario())
    assert [redis_client.xlen(q.requests_key(t)) for t in "abc"] == [2, 3, 1]
    assert {k.decode(): int(v) for k, v in redis_client.hgetall(q.TENANT_TOKENS).items()} == {
        q.requests_key("a"): 10, q.requests_key("b"): 15, q.requests_key("c"): 600}
    # over HTTP: the keys file's limit for t1, in OpenAI's shape
    app = create_app(config, redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {"sk-1": "a"},
                     tenant_limits={"a": TenantLimits(max_requests=2)})
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2},
                      headers={"Authorization": "Bearer sk-1"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "tenant_requests_limit" and r.json()["error"]["type"] == "rate_limit_error"


def test_counters_are_reconciled_with_the_streams(redis_server, redis_client):
    """Whatever the counters say, reconciling sets them to the entries no worker has read."""
    _beat(redis_client)

    async def scenario():
        queue = QueueClient(redis_server.url, ServeConfig())
        try:
            for i, (tenant, tokens) in enumerate([("a", 5), ("a", 7), ("b", 11)]):
                await queue.submit(QueuedRequest(request_id=f"r{i}", prompt_token_ids=[1] * tokens, tenant=tenant,
                                                 params=SamplingParams(max_tokens=4), deadline=time.time() + 60))
            await queue.submit(QueuedRequest(request_id="gone", prompt_token_ids=[1] * 3, tenant="c",
                                             params=SamplingParams(max_tokens=4), deadline=time.time() + 60))
            # a worker reads a's first entry and dies before counting it; c's entry is finished
            redis_client.xreadgroup(q.GROUP, "w1", {q.requests_key("a"): ">"}, count=1)
            [(entry_id, _)] = redis_client.xrange(q.requests_key("c"))
            redis_client.xdel(q.requests_key("c"), entry_id)
            redis_client.set(q.QUEUED, 99)
            redis_client.set(q.QUEUED_TOKENS, -4)
            return await queue.reconcile()
        finally:
            await queue.close()

    assert asyncio.run(scenario()) == (2, 18)
    assert int(redis_client.get(q.QUEUED)) == 2 and int(redis_client.get(q.QUEUED_TOKENS)) == 18
    assert {k.decode(): int(v) for k, v in redis_client.hgetall(q.TENANT_TOKENS).items()} == {
        q.requests_key("a"): 7, q.requests_key("b"): 11}
    # the empty stream of c left the tenants set; a's running entry keeps a in it
    assert {m.decode() for m in redis_client.smembers(q.TENANTS)} == {q.requests_key("a"), q.requests_key("b")}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_lost_by_redis_fails_fast_with_503(redis_server, redis_client, tokenizer_dir, stream):
    """Redis restarted without the queued request: no worker will ever answer, and the
    gateway says so within seconds instead of waiting for the request timeout."""
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=1.0, request_timeout=60)
    app = create_app(config, redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {})
    _beat(redis_client)
    answers = []
    with TestClient(app) as http:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "stream": stream}
        waiting = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=body)))
        started = time.monotonic()
        waiting.start()
        deadline = time.monotonic() + 10
        while redis_client.xlen(q.REQUESTS) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        [(_, fields)] = redis_client.xrange(q.REQUESTS)
        request_id = decode_request(fields[q.REQUEST_FIELD]).request_id
        redis_client.delete(q.REQUESTS, q.admitted_key(request_id))  # what a restart without it leaves
        waiting.join(timeout=30)
    assert not waiting.is_alive() and time.monotonic() - started < 30  # not the 60 s request timeout
    # streamed or not, nothing had been sent yet: the error keeps its HTTP status
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "request_lost"
    assert answers[0].headers["retry-after"] == "1"
