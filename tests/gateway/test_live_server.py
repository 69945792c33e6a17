"""The server as a user runs it: `pagedserve serve` (two CPU workers, a tiny model) against a
Redis the test owns, driven over real HTTP by the official `openai` client and by httpx.

The tests run in file order; the last ones take a worker down, restart Redis and drain."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common import queue_protocol as q
from pagedserve.common.redis_server import EmbeddedRedis

from serve_helpers import LiveServer
from tiny_models import build_checkpoint

KEY = "sk-test-a"
STREAM = q.requests_key("tenant-a")  # where KEY's requests wait (serve_helpers.API_KEYS), unless routed


def _streams(server) -> list[str]:
    """KEY's tenant stream and the streams routed to a worker that hold its requests."""
    routed = [s.decode() for s in server.redis.smembers(q.TENANTS) if q.routed_owner(s.decode())]
    return [STREAM, *(s for s in routed if q.tenant_stream_of(s) == STREAM)]


def _in_flight(server) -> int:
    """KEY's requests in flight (queued or running), in every stream."""
    return sum(server.redis.xlen(s) for s in _streams(server))
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A long context, so one request can run long enough to be interrupted.
    return build_checkpoint("llama", tmp_path_factory.mktemp("live-llama"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def server(model_dir, redis_server):
    live = LiveServer(model_dir, redis_server.url, "--num-workers", "2", "--max-num-seqs", "2",
                      "--max-queued-requests", "2", "--heartbeat-interval", "0.5", "--worker-timeout", "5",
                      "--max-body-bytes", "200000", "--drain-timeout", "60")
    try:
        yield live.wait_ready()
    finally:
        live.stop()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), attention_backend="torch")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _greedy(llm, prompt, max_tokens: int, **extra) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)
    return llm.generate([prompt], params)[0].outputs[0].text


def _sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            if data == "[DONE]":
                return
            yield json.loads(data)


def test_ready_and_models(server, client):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/ready").json() == {"status": "ready", "workers": 2}
    assert [m.id for m in client.models.list().data] == [server.model]
    schema = httpx.get(server.base_url + "/docs/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


def test_completion_matches_in_process_engine(server, client, llm):
    expected = _greedy(llm, PROMPT, 24)
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(llm.engine.tokenize(PROMPT))
    assert out.usage.completion_tokens == 24
    # token ids and several prompts at once: one choice per prompt, in order
    ids = [5, 17, 33, 101, 7]
    out = client.completions.create(model=server.model, prompt=[ids, [9, 9, 9]], max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == _greedy(llm, ids, 6)
    assert out.choices[1].text == _greedy(llm, [9, 9, 9], 6)
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == 12


def test_chat_streamed_and_not(server, client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.apply_chat_template(messages)
    expected = _greedy(llm, prompt, 16)
    out = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(prompt)

    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])

    out = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5 == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy takes the best


def test_n2_seeded_stream_and_logprobs(server, client):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, n=2,
                  logprobs=3, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 20
    for choice in full.choices:
        assert len(choice.logprobs.tokens) == 10
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
    # the same seed gives the same completions, streamed or not
    assert texts == {0: full.choices[0].text, 1: full.choices[1].text}


def test_stop_string(server, client, llm):
    expected = _greedy(llm, PROMPT, 24)
    stop = expected[8:11]
    cut = expected.index(stop)
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected[:cut]
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == expected[:cut]


def test_bench_serve_client_against_the_live_server(server):
    """`pagedserve bench serve`'s client, on a handful of requests (issue #5)."""
    import asyncio

    from pagedserve.bench.request_stats import summarize
    from pagedserve.bench.serve import run_benchmark

    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 17, [100, 200]]
    output_lens = [8, 12, 5, 9]
    records, duration = asyncio.run(run_benchmark(server.base_url, prompts, output_lens, max_concurrency=2,
                                                  api_key=KEY, progress=False))
    summary = summarize(records, duration, {"ttft": 60_000})
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (4, 0, 34)
    assert [r.output_tokens for r in records] == output_lens
    assert summary["goodput"] == pytest.approx(4 / duration)
    assert 0 < summary["ttft"]["median_ms"] <= summary["e2e"]["median_ms"]


def _error(response: httpx.Response) -> tuple[int, str | None, str | None]:
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return response.status_code, body["code"], body["param"]


def test_errors(server):
    url = server.base_url + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    assert _error(httpx.post(url, json=ok)) == (401, "invalid_api_key", None)
    assert _error(httpx.post(url, json=ok, headers={"Authorization": "Bearer wrong"})) == (401, "invalid_api_key", None)
    assert _error(httpx.post(url, content=b"{not json", headers={**auth, "content-type": "application/json"}))[0] == 400
    assert _error(httpx.post(url, json={**ok, "temperature": -1}, headers=auth)) == (400, "invalid_parameter", "temperature")
    assert _error(httpx.post(url, json={**ok, "top_p": 1.5}, headers=auth)) == (400, "invalid_parameter", "top_p")
    assert _error(httpx.post(url, json={**ok, "max_tokens": 0}, headers=auth)) == (400, "invalid_parameter", "max_tokens")
    assert _error(httpx.post(url, json={**ok, "n": 99}, headers=auth)) == (400, "invalid_parameter", "n")
    assert _error(httpx.post(url, json={**ok, "stop": 5}, headers=auth)) == (400, "invalid_parameter", "stop")
    assert _error(httpx.post(url, json={**ok, "temperature": "hot"}, headers=auth)) == (400, "invalid_parameter", "temperature")
    assert _error(httpx.post(url, json={**ok, "model": "gpt-4"}, headers=auth)) == (404, "model_not_found", "model")
    long = httpx.post(url, json={**ok, "prompt": list(range(1, 300)) * 14}, headers=auth)
    assert _error(long) == (400, "context_length_exceeded", "prompt")
    assert "4096" in long.json()["error"]["message"] and "4186" in long.json()["error"]["message"]
    big = httpx.post(url, json={**ok, "prompt": "x" * 300_000}, headers=auth)
    assert big.status_code == 413 and big.json()["error"]["message"]
    chat = httpx.post(server.base_url + "/v1/chat/completions", json={"model": server.model, "messages": []}, headers=auth)
    assert _error(chat) == (400, "invalid_parameter", "messages")


def _running_request_owner(server, timeout: float = 30.0):
    """(worker info, entry id) of the one request a worker is running."""
    def find():
        pending = [p for s in _streams(server) if server.redis.exists(s)
                   for p in server.redis.xpending_range(s, q.GROUP, "-", "+", 10)]
        if len(pending) != 1:
            return None
        owner = pending[0]["consumer"].decode()
        infos = [w for w in server.workers() if w.worker_id == owner]
        return (infos[0], pending[0]["message_id"].decode()) if infos else None
    return server.wait_for(find, timeout, "a running request")


def _all_idle(server) -> bool:
    workers = server.workers()
    return bool(workers) and all(w.num_running == 0 and w.num_free_blocks == w.num_blocks for w in workers)


def test_cancellation_frees_blocks(server):
    before = sum(w.num_cancelled for w in server.workers())
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", server.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        events = _sse_events(response)
        next(events), next(events)
        _running_request_owner(server)
    # leaving the block closed the connection mid-stream
    server.wait_for(lambda: sum(w.num_cancelled for w in server.workers()) == before + 1, what="the abort")
    server.wait_for(lambda: _all_idle(server), what="every block back in the pool")
    # a non-streamed request is cancelled too when its client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    server.wait_for(lambda: sum(w.num_cancelled for w in server.workers()) == before + 2, what="the second abort")
    server.wait_for(lambda: _all_idle(server), what="every block back in the pool")


def test_200_streams_cancelled_mid_stream_leak_nothing(server):
    """The vLLM advisory pattern: clients that leave mid-stream, over and over. Afterwards no
    KV block, running request, queue entry or output stream is left, and the next request
    is served. Latency before and after is printed (figures, not a timed assertion)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    short = {"model": server.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    long = {**short, "max_tokens": 3000, "stream": True}
    before_cancelled = sum(w.num_cancelled for w in server.workers())

    def timed_request() -> float:
        started = time.perf_counter()
        r = httpx.post(server.base_url + "/v1/completions", json=short, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        return time.perf_counter() - started

    timed_request()  # warm
    before = sorted(timed_request() for _ in range(5))[2]
    with httpx.Client(timeout=60) as http:
        for _ in range(200):
            with http.stream("POST", server.base_url + "/v1/completions", json=long, headers=headers) as response:
                assert response.status_code == 200
                events = _sse_events(response)
                next(events), next(events)  # two chunks, then the client goes away
    server.wait_for(lambda: sum(w.num_cancelled for w in server.workers()) == before_cancelled + 200,
                    timeout=120, what="200 aborts")
    server.wait_for(lambda: _all_idle(server), what="every block back in the pool")
    after = sorted(timed_request() for _ in range(5))[2]
    print(f"\nmedian latency of a 16-token request: {before * 1000:.0f} ms before, {after * 1000:.0f} ms after "
          f"200 cancelled streams ({after / before:.2f}x)")
    assert _in_flight(server) == 0 and int(server.redis.get(q.QUEUED) or 0) == 0
    assert list(server.redis.scan_iter("pagedserve:out:*")) == []


def test_queue_full_gives_429(server):
    """2 workers × 2 running + 2 queued fill the server; the next request gets 429."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    stop = threading.Event()
    statuses: list[int] = []

    def hold():
        with httpx.Client(timeout=120) as http, \
                http.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers) as response:
            statuses.append(response.status_code)
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    def running() -> int:
        return sum(w.num_running for w in server.workers())

    threads = [threading.Thread(target=hold) for _ in range(6)]
    try:
        for i, t in enumerate(threads):  # one at a time: each is admitted before the next
            t.start()
            if i < 4:
                server.wait_for(lambda i=i: running() == i + 1, what=f"{i + 1} running")
            else:
                server.wait_for(lambda i=i: int(server.redis.get(q.QUEUED) or 0) == i - 3, what=f"{i - 3} queued")
        assert running() == 4
        refused = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers)
        assert _error(refused) == (429, "queue_full", None)
        assert refused.headers["retry-after"] == "1"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert statuses == [200] * 6  # the two queued ones answer once the others leave
    # a worker's heartbeat can report it idle a moment before the same pass acknowledges the
    # entries it ended: wait for the acknowledgements too
    server.wait_for(lambda: _all_idle(server) and int(server.redis.get(q.QUEUED) or 0) == 0
                    and _in_flight(server) == 0, what="an idle server with every entry acknowledged")


def test_kill_9_worker_mid_stream(server, llm):
    """The request moves to the other worker and completes: no token twice, none missing."""
    max_tokens = 1500
    expected = _greedy(llm, PROMPT, max_tokens)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    text, tokens, usage = "", 0, None
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", server.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        events = _sse_events(response)
        for event in events:
            if event["choices"]:
                text += event["choices"][0]["text"]
                tokens += len((event["choices"][0]["logprobs"] or {"tokens": []})["tokens"])
            if tokens >= 5:
                break
        victim, _ = _running_request_owner(server)
        os.kill(victim.pid, signal.SIGKILL)
        for event in events:
            if event.get("usage"):
                usage = event["usage"]
            if event["choices"]:
                text += event["choices"][0]["text"]
                tokens += len((event["choices"][0]["logprobs"] or {"tokens": []})["tokens"])
    assert tokens == max_tokens
    assert usage["completion_tokens"] == max_tokens
    assert text == expected
    # the survivor took it over (the launcher also starts a worker in place of the victim);
    # the workers' announcements trail by a heartbeat
    server.wait_for(lambda: sum(w.num_taken_over for w in server.workers() if w.pid != victim.pid) == 1,
                    what="the takeover announced")
    server.wait_for(lambda: _all_idle(server), what="every worker idle")
    assert _in_flight(server) == 0


def test_redis_restart(server, client, redis_server):
    redis_server.stop()
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4)
    assert failed.value.status_code == 503
    redis_server.start()  # the same port, empty
    server.wait_for(lambda: httpx.get(server.base_url + "/ready").status_code == 200, what="ready again")
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


def test_a_running_request_survives_a_redis_restart(server, redis_server, llm):
    """Redis restarts empty while a stream runs: its worker renews the request's marker and
    keeps writing, so the gateway goes on reading it (not a 503 for a lost request)."""
    max_tokens = 1500
    expected = _greedy(llm, PROMPT, max_tokens)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, error = "", None
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", server.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        events = _sse_events(response)
        text += next(events)["choices"][0]["text"]
        redis_server.stop()
        redis_server.start()  # the same port, empty: the entry, the marker and unread chunks are gone
        for event in events:
            if "error" in event:
                error = event["error"]
            elif event["choices"]:
                text += event["choices"][0]["text"]
    if error is not None:  # chunks written before the restart and not yet read were lost with it
        assert error["code"] == "request_lost" and expected.startswith(text)
    else:
        assert text == expected
    server.wait_for(lambda: httpx.get(server.base_url + "/ready").status_code == 200, what="ready again")


def test_sigterm_drains(server, llm):
    """Running requests finish after SIGTERM; the server then exits cleanly."""
    expected = _greedy(llm, PROMPT, 300)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text = ""
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", server.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200, response.read()
        events = _sse_events(response)
        text += next(events)["choices"][0]["text"]
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.base_url + "/health", timeout=2)
        for event in events:
            if event["choices"]:
                text += event["choices"][0]["text"]
    assert text == expected
    assert server.process.wait(timeout=60) == 0
