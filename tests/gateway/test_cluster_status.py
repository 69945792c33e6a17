"""The console's local twin, without a browser: `GET /v1/cluster` holds exact counts after N
requests (workers from their heartbeats, the queue's counters, the gateway's answers and
rejections), needs the API key when keys are set, and the console's files are served with
the strict Content-Security-Policy (and not at all with `console=False`)."""

from __future__ import annotations

import re
import threading
import time

import pytest
import redis
from litestar.testing import TestClient

from pagedserve.common import queue_protocol as q
from pagedserve.common.outputs import CompletionDelta
from pagedserve.common.queue_protocol import Chunk, WorkerInfo, decode_request, encode
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.common.worker_activity import WorkerActivity
from pagedserve.gateway.app import create_app
from pagedserve.gateway.console import CONTENT_SECURITY_POLICY, STATIC
from pagedserve.gateway.tokenizer import PromptTokenizer

from serve_helpers import write_reply
from tiny_models import build_tokenizer

KEY = "sk-console"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture()
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


def _announce(client, worker_id: str, **fields) -> None:
    """A worker's heartbeat, as its heartbeat script writes it (live for a minute)."""
    info = WorkerInfo(worker_id=worker_id, model="tiny", max_model_len=64, pid=100, host="h1", max_num_seqs=8, **fields)
    client.zadd(q.WORKERS, {worker_id: time.time() + 60})
    client.set(q.worker_key(worker_id), encode(info))


def _answer_everything(client, stop: threading.Event) -> threading.Thread:
    """Answer each request admitted (wherever it was routed) with two tokens, as a worker
    would, leaving its entry in place (so the queue's counters keep counting it)."""
    answered: set[str] = set()

    def run():
        while not stop.is_set():
            for stream in client.smembers(q.TENANTS):
                for _, fields in client.xrange(stream):
                    request = decode_request(fields[q.REQUEST_FIELD])
                    if request.request_id in answered:
                        continue
                    answered.add(request.request_id)
                    chunk = Chunk(attempt=1, done=True, deltas=[
                        CompletionDelta(index=0, start=0, token_ids=[5, 6], text="ab", finish_reason="length")])
                    write_reply(client, request, chunk)
            time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_cluster_counts_are_exact_after_n_requests(redis_server, redis_client, tokenizer_dir):
    activity = WorkerActivity(started_at=time.time() - 30, restarts=2, generated_tokens=700, prefix_queries=400,
                              prefix_hits=100, first_tokens=10, ttft_seconds=1.5, finished=9)
    _announce(redis_client, "w-a", num_running=3, num_waiting=1, num_free_blocks=30, num_blocks=40,
              num_taken_over=4, num_stolen=5, num_cancelled=6, activity=activity)
    _announce(redis_client, "w-b", num_blocks=40, num_free_blocks=40)
    config = ServeConfig(max_queued_requests=50, max_queued_tokens=10_000, router="least-loaded")
    app = create_app(config, redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {KEY: "t1"})
    stop = threading.Event()
    n = 7
    with TestClient(app) as http:
        answerer = _answer_everything(redis_client, stop)
        try:
            for _ in range(n):
                response = http.post("/v1/completions", json=BODY, headers=AUTH)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == "ab"
        finally:
            stop.set()
            answerer.join()
        assert http.post("/v1/completions", json=BODY).status_code == 401  # no key
        assert http.get("/v1/cluster").status_code == 401  # the status needs a key too

        status = http.get("/v1/cluster", headers=AUTH)
        assert status.status_code == 200
        body = status.json()
    assert body["model"] == "tiny"
    assert body["workers_alive"] == 2
    workers = {w["worker_id"]: w for w in body["workers"]}
    assert set(workers) == {"w-a", "w-b"}
    a = workers["w-a"]
    assert (a["alive"], a["num_running"], a["num_waiting"], a["max_num_seqs"]) == (True, 3, 1, 8)
    assert (a["kv_cache_usage"], a["num_blocks"], a["prefix_hit_rate"]) == (0.25, 40, 0.25)
    assert (a["generated_tokens"], a["finished_requests"], a["restarts"]) == (700, 9, 2)
    assert (a["taken_over"], a["stolen"], a["cancelled"]) == (4, 5, 6)
    assert 29 <= a["uptime_seconds"] <= 60
    assert workers["w-b"]["prefix_hit_rate"] is None and workers["w-b"]["kv_cache_usage"] == 0.0
    # every request was admitted and none taken by a worker (the fake one leaves its entries)
    assert body["queue"] == {"depth": n, "tokens": 3 * n, "max_requests": 50, "max_tokens": 10_000}
    assert sum(w["queued_for_it"] for w in body["workers"]) == n
    gateway = body["gateway"]
    assert gateway["requests"]["/v1/completions"] == {"200": n, "401": 1}
    assert gateway["requests"]["/v1/cluster"] == {"401": 1}
    assert gateway["routed"] == {"cache": 0, "load": n, "shared": 0}
    assert (gateway["rejected_429"], gateway["rejected_503"], gateway["rejections"]) == (0, 0, {})
    assert body["prefix_cache"] is None


def test_rejections_are_counted_by_status(redis_server, redis_client, tokenizer_dir):
    """One 503 with no worker, then two 429s once one request fills the queue."""
    app = create_app(ServeConfig(max_queued_requests=1), redis_server.url, PromptTokenizer(tokenizer_dir),
                     ("tiny",), 64, {})
    with TestClient(app) as http:
        assert http.post("/v1/completions", json=BODY).status_code == 503
        _announce(redis_client, "w-a")
        first = threading.Thread(target=lambda: http.post("/v1/completions", json={**BODY, "max_tokens": 1}))
        first.start()
        deadline = time.monotonic() + 10
        while int(redis_client.get(q.QUEUED) or 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [http.post("/v1/completions", json=BODY).status_code for _ in range(2)] == [429, 429]
        body = http.get("/v1/cluster").json()
        redis_client.delete(q.WORKERS)
        for key in redis_client.scan_iter(q.admitted_key("*")):
            redis_client.delete(key)  # the first request ends (lost) without waiting for its deadline
        first.join(timeout=30)
    assert (body["gateway"]["rejected_429"], body["gateway"]["rejected_503"]) == (2, 1)
    assert body["gateway"]["rejections"] == {"queue_full": 2, "service_unavailable": 1}
    assert body["queue"]["depth"] == 1 and body["workers_alive"] == 1


def test_console_files_carry_the_csp(redis_server, tokenizer_dir):
    app = create_app(ServeConfig(), redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {})
    with TestClient(app) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "connect-src 'self'" in CONTENT_SECURITY_POLICY
        assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
        for path in sorted(STATIC.iterdir()):
            if path.name == "index.html":
                continue
            answer = http.get(f"/console/{path.name}")
            assert answer.status_code == 200, path.name
            assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert answer.headers["x-content-type-options"] == "nosniff"
            assert answer.content == path.read_bytes()
        assert http.get("/console/..%2Fconsole.py").status_code == 404
        assert http.get("/console/missing.js").status_code == 404
        schema = http.get("/docs/openapi.json").json()
        assert "/v1/cluster" in schema["paths"] and "/" not in schema["paths"]
    off = create_app(ServeConfig(console=False), redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {})
    with TestClient(off) as http:
        assert http.get("/").status_code == 404
        assert http.get("/console/console.js").status_code == 404
        assert http.get("/v1/cluster").status_code == 200  # the status stays: the page is only its consumer


def test_page_has_no_inline_script_and_no_other_origin():
    """What the CSP enforces in a browser, checked on the files: no inline script or style,
    no handler attributes, no URL of another origin, model output set as text only."""
    html = (STATIC / "index.html").read_text()
    assert re.findall(r"<script[^>]*>", html) == ['<script type="module" src="/console/console.js">']
    assert re.search(r"\son[a-z]+\s*=", html) is None  # no handler attributes
    assert "<style" not in html and "style=" not in html
    for path in STATIC.iterdir():
        text = path.read_text()
        assert "http://" not in text.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in text, path.name
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "eval(" not in text, path.name


def test_redis_away_is_a_503(tokenizer_dir):
    from serve_helpers import free_port

    app = create_app(ServeConfig(), f"redis://127.0.0.1:{free_port()}/0", PromptTokenizer(tokenizer_dir), ("tiny",),
                     64, {})
    with TestClient(app) as http:
        answer = http.get("/v1/cluster")
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "service_unavailable"


def test_rates_and_chart_points_follow_the_heartbeats(redis_server, redis_client, tokenizer_dir):
    """Two heartbeats 1.2 s apart: the worker's tokens/s is their difference over the time
    between the reads, and the first tokens between them show in one chart point as their
    mean TTFT, however often the page asked in between."""
    _announce(redis_client, "w-a", activity=WorkerActivity(generated_tokens=100))
    app = create_app(ServeConfig(), redis_server.url, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {})
    with TestClient(app) as http:
        assert http.get("/v1/cluster").json()["workers"][0]["tokens_per_second"] == 0.0  # one read: no rate yet
        time.sleep(1.2)
        _announce(redis_client, "w-a", activity=WorkerActivity(generated_tokens=340, first_tokens=4, ttft_seconds=2.0))
        first = http.get("/v1/cluster").json()
        for _ in range(5):  # the page polling meanwhile
            http.get("/v1/cluster")
        time.sleep(2.5)  # a chart point of the background sampler
        last = http.get("/v1/cluster").json()
    assert 240 / 3.0 < first["workers"][0]["tokens_per_second"] <= 240 / 1.2
    assert [p["ttft_seconds"] for p in last["history"] if p["ttft_seconds"] is not None] == [0.5]
    assert all(p["queue_depth"] == 0 and p["running"] == 0 for p in last["history"])
