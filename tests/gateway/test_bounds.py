"""Bounded inputs and HTTP hardening at the gateway: each bad input is a 400 (or 401, 408)
in OpenAI's shape naming its field, and never a 500 or a hang.

The app runs in process (as in test_app.py). Requests that pass every check go on to
admission, which, with no live worker (or no reachable Redis), answers 503: that 503 is how a
test sees that a body was accepted. The HTTP-server limits run uvicorn itself on a free port.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time

import pytest
import uvicorn
from litestar.testing import TestClient

from pagedserve.common import queue_protocol as q
from pagedserve.common.errors import PagedServeError
from pagedserve.common.queue_protocol import decode_request
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.json_limits import check_json_body
from pagedserve.gateway.server import uvicorn_config
from pagedserve.gateway.tokenizer import PromptTokenizer

from tiny_models import build_tokenizer

NO_REDIS = "redis://127.0.0.1:1/0"  # refused at once: admission answers 503
OK = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


def _app(tokenizer_dir, api_keys=None, redis_url=NO_REDIS, tokenizer=None, max_n=16, **config):
    return create_app(ServeConfig(**config), redis_url, tokenizer or PromptTokenizer(tokenizer_dir), ("tiny",), 64,
                      api_keys or {}, max_n=max_n)


def _answer(http, body, path: str | None = None, headers=None) -> tuple[int, str | None, str | None]:
    """(status, error code, error param) of one POST; a dict body is sent as JSON."""
    path = path or ("/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions")
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})
    error = r.json()["error"]
    return r.status_code, error["code"], error["param"]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture()
def http(tokenizer_dir):
    with TestClient(_app(tokenizer_dir)) as client:
        yield client


# -- 1, 2: logit_bias, top_k, n, best_of, logprobs ---------------------------------------------
def test_a_huge_logit_bias_is_refused_before_tokenizing(tokenizer_dir):
    class CountingTokenizer(PromptTokenizer):
        calls = 0

        def encode(self, text):
            CountingTokenizer.calls += 1
            return super().encode(text)

    app = _app(tokenizer_dir, tokenizer=CountingTokenizer(tokenizer_dir), max_body_bytes=4 << 20)
    with TestClient(app) as http:
        huge = {str(i): 1.0 for i in range(200_000)}
        assert _answer(http, {**OK, "logit_bias": huge}) == (400, "invalid_parameter", "logit_bias")
        assert _answer(http, {**CHAT, "logit_bias": {"5": 1.0}}) == (400, "invalid_parameter", "logit_bias")
        assert _answer(http, {**OK, "logit_bias": {}})[0] == 503  # empty: nothing to refuse
    assert CountingTokenizer.calls == 1  # only the accepted request was tokenized


def test_top_k(http):
    assert _answer(http, {**OK, "top_k": -2}) == (400, "invalid_parameter", "top_k")
    assert _answer(http, {**OK, "top_k": 2**63}) == (400, "invalid_parameter", "top_k")
    assert _answer(http, {**OK, "top_k": 1.5}) == (400, "invalid_parameter", "top_k")
    for ok in (-1, 0, 1, 2**63 - 1):  # the worker clamps a top_k beyond the vocabulary
        assert _answer(http, {**OK, "top_k": ok})[0] == 503


def test_n_and_best_of(tokenizer_dir, http):
    assert _answer(http, {**OK, "n": 17}) == (400, "invalid_parameter", "n")
    assert _answer(http, {**OK, "n": 0}) == (400, "invalid_parameter", "n")
    assert _answer(http, {**OK, "n": 16})[0] == 503
    assert _answer(http, {**OK, "best_of": 2}) == (400, "invalid_parameter", "best_of")
    assert _answer(http, {**OK, "n": 2, "best_of": 2})[0] == 503
    # the workers' --max-n, when smaller, is the gateway's bound too
    with TestClient(_app(tokenizer_dir, max_n=4)) as small:
        assert _answer(small, {**OK, "n": 5}) == (400, "invalid_parameter", "n")
        assert _answer(small, {**OK, "n": 4})[0] == 503


def test_logprobs_bounds(http):
    assert _answer(http, {**OK, "logprobs": 21}) == (400, "invalid_parameter", "logprobs")
    assert _answer(http, {**OK, "logprobs": -1}) == (400, "invalid_parameter", "logprobs")
    assert _answer(http, {**OK, "logprobs": 20})[0] == 503
    assert _answer(http, {**CHAT, "logprobs": True, "top_logprobs": 21}) == (400, "invalid_parameter", "top_logprobs")
    assert _answer(http, {**CHAT, "logprobs": True, "top_logprobs": -1}) == (400, "invalid_parameter", "top_logprobs")
    assert _answer(http, {**CHAT, "top_logprobs": 2}) == (400, "invalid_parameter", "top_logprobs")  # needs logprobs
    assert _answer(http, {**CHAT, "logprobs": True, "top_logprobs": 20})[0] == 503


# -- 3: integers beyond 64 bits ------------------------------------------------------------------
@pytest.mark.parametrize(("field", "body"), [
    ("seed", {**OK, "seed": 2**70}),
    ("seed", {**OK, "seed": -(2**63) - 1}),
    ("max_tokens", {**OK, "max_tokens": 10**30}),
    ("prompt", {**OK, "prompt": [1, 2**64]}),
    ("prompt", {**OK, "prompt": [[1], [2, -(2**64)]]}),
    ("min_tokens", {**OK, "max_tokens": None, "min_tokens": 2**70}),
    ("stop_token_ids", {**OK, "stop_token_ids": [2**64]}),
    ("n", {**OK, "n": 2**70}),
    ("tool_choice", {**CHAT, "tool_choice": 2**70}),
    ("messages", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "n": 2**64}]}]}),
    ("response_format", {**CHAT, "response_format": {"type": "text", "x": [2**100]}}),
    ("something_unknown", {**OK, "something_unknown": {"a": 10**40}}),
])
def test_integers_beyond_64_bits(http, field, body):
    assert _answer(http, body) == (400, "invalid_parameter", field)


def test_integers_within_64_bits_and_long_floats_pass(http):
    assert _answer(http, {**OK, "seed": 2**63 - 1})[0] == 503
    assert _answer(http, {**OK, "seed": -(2**63)})[0] == 503
    assert _answer(http, {**OK, "prompt": "12345678901234567890123456789"})[0] == 503  # digits in a string
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0.50000000000000000000001}'
    assert _answer(http, body)[0] == 503
    # a float beyond a double is msgspec's to refuse
    assert _answer(http, b'{"model": "tiny", "prompt": "hi", "temperature": 1e123456789012345678901}') == (400, "invalid_request", None)


# -- 4: nesting depth ------------------------------------------------------------------------------
def test_deep_nesting_is_a_400_not_a_recursion_error(http):
    assert _answer(http, f'{{"model": "tiny", "prompt": {_nested(10_000)}}}'.encode()) == (400, "invalid_parameter", "prompt")
    deep = json.loads(_nested(40))
    assert _answer(http, {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "d": deep}]}]}) \
        == (400, "invalid_parameter", "messages")
    for field in ("tools", "tool_choice", "response_format"):
        assert _answer(http, {**CHAT, field: {"a": deep}}) == (400, "invalid_parameter", field)
    # strings holding brackets nest nothing
    assert _answer(http, {**OK, "prompt": "[" * 40, "user": "]{\"[" * 100})[0] == 503
    # a body that is not an object names no field
    assert _answer(http, _nested(5000).encode()) == (400, "invalid_request", None)


def test_max_json_depth_is_configurable(tokenizer_dir):
    with TestClient(_app(tokenizer_dir, max_json_depth=4)) as http:
        # the body's own object is the first level
        assert _answer(http, {**OK, "prompt": [[1, 2]], "x": [[[1]]]})[0] == 503  # 4 levels
        assert _answer(http, {**OK, "prompt": [[1, 2]], "x": {"a": [[]]}})[0] == 503  # 4 levels
        assert _answer(http, {**OK, "prompt": [[1, 2]], "x": [[[[1]]]]}) == (400, "invalid_parameter", "x")  # 5 levels


def test_json_scan_edge_cases():
    def refused(body: bytes, depth: int = 3) -> tuple[str | None, str] | None:
        try:
            check_json_body(body, depth)
        except PagedServeError as e:
            return e.param, e.message
        return None

    assert refused(b'{"a": "\\"[[[[[[", "b": [[1]]}') is None  # an escaped quote does not end the string
    assert refused(b'{"a": "\\\\", "b": [[[[1]]]]}')[0] == "b"  # an escaped backslash does not escape the quote
    assert refused(b'{"[[[[": [[[1]]]}')[0] == "[[[["  # a key with brackets, named whole
    assert refused(b'{"a\\"b": [[[1]]]}')[0] == 'a"b'
    for fine in (b'{"a": 1.00000000000000000000001}', b'{"a": 1e12345678901234567890}', b'{"a": 2E-12345678901234567890}',
                 b'{"a": 9223372036854775807, "b": -9223372036854775808, "c": 1000000000000000000}'):
        assert refused(fine) is None, fine
    assert refused(b'{"a": 9223372036854775808}')[0] == "a"
    assert refused(b'{"a": [0, {"b": -9223372036854775809}]}')[0] == "a"
    assert refused(b"99999999999999999999") == (None, "the request body holds an integer outside the 64-bit range "
                                                      "[-9223372036854775808, 9223372036854775807]")


# -- 5: chat roles and message count ----------------------------------------------------------------
def test_chat_roles_and_message_count(tokenizer_dir):
    with TestClient(_app(tokenizer_dir, max_chat_messages=3)) as http:
        bad_role = {**CHAT, "messages": [{"role": "system", "content": "x"}, {"role": "wizard", "content": "hi"}]}
        assert _answer(http, bad_role) == (400, "invalid_parameter", "messages[1].role")
        assert _answer(http, {**CHAT, "messages": [{"role": "function", "content": "x"}]}) == (400, "invalid_parameter", "messages[0].role")
        for role in ("system", "developer", "user", "assistant", "tool"):
            assert _answer(http, {**CHAT, "messages": [{"role": role, "content": "x"}]})[0] == 503
        four = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 4}
        assert _answer(http, four) == (400, "invalid_parameter", "messages")
        assert _answer(http, {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 3})[0] == 503


# -- 7: authentication before the body is read ------------------------------------------------------
def test_authentication_comes_before_the_body(tokenizer_dir):
    app = _app(tokenizer_dir, api_keys={"sk-1": "t1"}, max_body_bytes=2000)
    key = {"Authorization": "Bearer sk-1"}
    with TestClient(app) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert _answer(http, b"{not json", path) == (401, "invalid_api_key", None)
            assert _answer(http, b"x" * 5000, path) == (401, "invalid_api_key", None)  # not 413: never read
            assert _answer(http, f'{{"prompt": {_nested(10_000)}}}'.encode(), path) == (401, "invalid_api_key", None)
            assert _answer(http, b"{not json", path, {"Authorization": "Bearer sk-2"}) == (401, "invalid_api_key", None)
            # with the key, the body is read and judged
            assert _answer(http, b"{not json", path, key) == (400, "invalid_request", None)
            assert _answer(http, b"x" * 5000, path, key)[0] == 413
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=key).status_code == 200
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 503  # open, and not ready without workers
        assert http.get("/docs/openapi.json").status_code == 200


# -- 8: tokenization off the event loop --------------------------------------------------------------
def test_tokenization_runs_off_the_event_loop_and_is_bounded(tokenizer_dir):
    """While a tokenization is stuck, /health is answered; with one tokenizer thread, a second
    tokenization waits for the first."""

    class StuckTokenizer(PromptTokenizer):
        def __init__(self, path):
            super().__init__(path)
            self.started, self.release = threading.Event(), threading.Event()
            self.lock = threading.Lock()
            self.running = self.most_running = self.finished = 0

        def encode(self, text):
            with self.lock:
                self.running += 1
                self.most_running = max(self.most_running, self.running)
            self.started.set()
            self.release.wait(timeout=20)  # bounds the hang if the test fails
            with self.lock:
                self.running -= 1
                self.finished += 1
            return super().encode(text)

    tokenizer = StuckTokenizer(tokenizer_dir)
    with TestClient(_app(tokenizer_dir, tokenizer=tokenizer, tokenizer_threads=1)) as http:
        answers: list[int] = []
        requests = [threading.Thread(target=lambda: answers.append(_answer(http, OK)[0])) for _ in range(2)]
        for t in requests:
            t.start()
        assert tokenizer.started.wait(timeout=20)
        assert http.get("/health").status_code == 200
        assert tokenizer.finished == 0 and tokenizer.running == 1  # answered while the first was stuck
        tokenizer.release.set()
        for t in requests:
            t.join(timeout=30)
    assert answers == [503, 503] and tokenizer.most_running == 1


# -- 10: cache_salt -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


def test_cache_salt_joins_the_tenant(tokenizer_dir, redis_server):
    """What reaches the worker as the prefix-cache salt: the tenant, the request's cache_salt,
    both (unambiguously), or nothing. A worker beats but never answers: each request times out."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.zadd(q.WORKERS, {"w1": time.time() + 60})
    app = _app(tokenizer_dir, api_keys={"sk-1": "t1"}, redis_url=redis_server.url, request_timeout=0.3,
               max_cache_salt_length=8)
    open_app = _app(tokenizer_dir, redis_url=redis_server.url, request_timeout=0.3)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
    key = {"Authorization": "Bearer sk-1"}
    try:
        with TestClient(app) as http:
            assert _answer(http, {**body, "cache_salt": "x" * 9}, headers=key) == (400, "invalid_parameter", "cache_salt")
            assert _answer(http, {**body, "cache_salt": ""}, headers=key) == (400, "invalid_parameter", "cache_salt")
            assert _answer(http, {**body, "cache_salt": 5}, headers=key) == (400, "invalid_parameter", "cache_salt")
            assert _answer(http, body, headers=key)[0] == 504
            assert _answer(http, {**body, "cache_salt": "s1"}, headers=key)[0] == 504
            assert _answer(http, {**CHAT, "cache_salt": "s2"}, headers=key)[0] == 504
        with TestClient(open_app) as http:
            assert _answer(http, body)[0] == 504
            assert _answer(http, {**body, "cache_salt": "s1"})[0] == 504
        entries = client.xrange(q.requests_key("t1")) + client.xrange(q.REQUESTS)  # t1's stream, then no tenant's
        salts = [decode_request(fields[q.REQUEST_FIELD]).cache_salt for _, fields in entries]
        assert salts == ["t1", '["t1","s1"]', '["t1","s2"]', None, '[null,"s1"]']
    finally:
        client.close()


def test_developer_is_rendered_as_system(tokenizer_dir, redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.zadd(q.WORKERS, {"w1": time.time() + 60})
    try:
        with TestClient(_app(tokenizer_dir, redis_url=redis_server.url, request_timeout=0.3)) as http:
            for role in ("developer", "system"):
                assert _answer(http, {**CHAT, "messages": [{"role": role, "content": "Be brief."}]})[0] == 504
        developer, system = [decode_request(f[q.REQUEST_FIELD]).prompt_token_ids for _, f in client.xrange(q.REQUESTS)]
        assert developer == system == PromptTokenizer(tokenizer_dir).encode_chat([{"role": "system", "content": "Be brief."}])
    finally:
        client.close()


# -- 9: the HTTP server: connections, keep-alive, slow clients -----------------------------------------
@contextlib.contextmanager
def _uvicorn(tokenizer_dir, **limits):
    """uvicorn serving the gateway as `pagedserve gateway` does, on a free port; yields the port."""
    config = ServeConfig(port=0, log_level="warning", **limits)
    server = uvicorn.Server(uvicorn_config(create_app(config, NO_REDIS, PromptTokenizer(tokenizer_dir), ("tiny",), 64, {}), config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture()
def live_gateway(tokenizer_dir):
    """With short timeouts on requests."""
    with _uvicorn(tokenizer_dir, header_timeout=0.5, body_timeout=0.5) as port:
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)  # the timeout bounds a hang


def _read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_stalled_headers_and_bodies_are_cut(live_gateway):
    stalls = {
        "nothing": b"",
        "half a header line": b"GET /health HTTP/1.1\r\nHo",
        "half a body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"model\":",
    }
    for what, sent in stalls.items():
        with _connect(live_gateway) as sock:
            sock.sendall(sent)
            response = _read_until_closed(sock)  # the server closes the connection
        assert _status(response) == 408, what
        error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout", what


def test_a_dribbled_header_is_cut_at_its_deadline(live_gateway):
    """One byte every 50 ms never lets the deadline reset: the whole header is due in time."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 400 + b"\r\n\r\n"
    with _connect(live_gateway) as sock:
        sent = 0
        while sent < len(request):
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                break
            try:
                sock.sendall(request[sent:sent + 1])
            except OSError:  # already closed
                break
            sent += 1
        response = _read_until_closed(sock)
    assert sent < len(request) and _status(response) == 408


def test_keep_alive_and_connection_limit(tokenizer_dir):
    with _uvicorn(tokenizer_dir, keep_alive_timeout=1, max_connections=4) as port:
        with _connect(port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            response = _read_until_closed(sock)  # answered, then closed once idle for keep_alive_timeout
        assert _status(response) == 200
        idle = [_connect(port) for _ in range(4)]
        try:
            with _connect(port) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                refused = _read_until_closed(sock)
                assert _status(refused) == 503 and b"retry-after: 1" in refused  # beyond max_connections
                body = json.loads(refused.split(b"\r\n\r\n", 1)[1])
                assert body["error"]["code"] == "too_many_connections" and set(body["error"]) == {
                    "message", "type", "param", "code"}
            # the refusal is counted like the app's own 503s (asked on a connection within the limit)
            idle[0].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            metrics = _read_until_closed(idle[0]).decode()
            assert 'pagedserve:requests_rejected_total{reason="too_many_connections",status_code="503"} 1.0' in metrics
            assert 'pagedserve:http_requests_total{route="other",status_code="503"} 1.0' in metrics
        finally:
            for sock in idle:
                sock.close()
