"""Every bad structured-output or tool request is a 400 naming its parameter, before anything
is queued (no worker runs: a request that passes every check gets the 503 of an empty
cluster). The grammar backend is the real one (llguidance) on the tiny test tokenizer."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from pagedserve.common import queue_protocol as q
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.tokenizer import PromptTokenizer

from tiny_models import build_tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


def _http(redis_url, tokenizer_dir, **engine):
    config = ServeConfig(max_tools=2)
    limits = EngineConfig(max_structured_output_chars=400, **engine)
    return TestClient(create_app(config, redis_url, PromptTokenizer(tokenizer_dir), ("tiny",), 4096, {}, engine=limits))


@pytest.fixture(scope="module")
def http(redis_url, tokenizer_dir):
    with _http(redis_url, tokenizer_dir) as client:
        yield client


def _answer(http, body, path="/v1/chat/completions") -> tuple[int, str | None, str]:
    r = http.post(path, json=body)
    error = r.json()["error"]
    return r.status_code, error["param"], error["message"]


BAD = [
    # (body changes, param, words the message must hold)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}},
     "response_format", "Invalid type: banana"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", 'Unimplemented keys: ["uniqueItems"]'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON Schema object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * 400}}}}, "response_format", "this server takes at most 400"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", 'unknown name: "foo"'),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "set exactly one"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs", "json_schema"),
    ({"guided_regex": "(", "guided_choice": ["a"]}, "guided_choice", "only one output constraint"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "only one output constraint per request; response_format is set too"),
    ({"response_format": {"type": "json_object"}, "tools": [TOOL], "tool_choice": "required"}, "tools",
     "only one output constraint"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names the function 'nope', which is not in `tools`"),
    ({"tools": [TOOL] * 3}, "tools", "has 3 tools; this server takes at most 2"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
      "tool_choice": "required"}, "tools", 'Unimplemented keys: ["uniqueItems"]'),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only an assistant message"),
]


@pytest.mark.parametrize(("change", "param", "words"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_structured_requests_are_400_naming_the_parameter(http, change, param, words):
    status, got_param, message = _answer(http, {**CHAT, **change})
    assert (status, got_param) == (400, param), message
    assert words in message


def test_completions_take_the_same_constraints(http):
    ok = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    assert _answer(http, {**ok, "structured_outputs": {"regex": "a(b"}}, "/v1/completions")[:2] == (400, "structured_outputs")
    assert _answer(http, {**ok, "guided_json": SCHEMA}, "/v1/completions")[0] == 503  # valid: reaches admission


def test_good_requests_pass_every_check(http, redis_url):
    for change in ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
                   {"structured_outputs": {"choice": ["yes", "no"]}},
                   {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
                   {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                   {"tools": [TOOL]},
                   {"messages": [{"role": "user", "content": "w?"},
                                 {"role": "assistant", "content": None, "tool_calls": [
                                     {"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}], "tools": [TOOL]}):
        assert _answer(http, {**CHAT, **change})[:2] == (503, None), change  # no live worker
    import redis

    assert redis.Redis.from_url(redis_url).xlen(q.REQUESTS) == 0


def test_a_compile_over_the_timeout_is_refused(redis_url, tokenizer_dir):
    import time

    from pagedserve.gateway.grammar_check import GrammarChecker

    class SlowBackend:  # a compile that outlives the timeout, whatever the machine's speed
        def compile(self, spec):
            time.sleep(1.0)

    with _http(redis_url, tokenizer_dir) as http:
        http.app.state.gateway.grammar = GrammarChecker(SlowBackend, 400, compile_timeout=0.05)
        status, param, message = _answer(http, {**CHAT, "structured_outputs": {"regex": "[0-9]{1,50}x"}})
    assert (status, param) == (400, "structured_outputs")
    assert "took longer than 0.05 s" in message


def test_the_checker_works_again_after_its_lifespan_closed_it():
    """An app's lifespan may shut down and start again (an ASGI test harness does): `close`
    stops the checker's threads and cancels the compiles still queued; a request waiting on
    one compiles its spec again, and later checks start new threads."""
    import asyncio
    import threading

    from pagedserve.common.contracts import GrammarError
    from pagedserve.common.structured_outputs import StructuredOutputsParams
    from pagedserve.gateway.grammar_check import GrammarChecker

    release = threading.Event()
    calls = []

    class Backend:
        def compile(self, spec):
            calls.append(spec.regex)
            if spec.regex == "slow":
                release.wait(10)
            if spec.regex == "a(b":
                raise GrammarError("unbalanced parenthesis")

    checker = GrammarChecker(Backend, 400, compile_timeout=30, threads=1)

    async def check(regex: str) -> str:
        try:
            await checker.check(StructuredOutputsParams(regex=regex), "structured_outputs")
            return "ok"
        except Exception as exc:  # noqa: BLE001 - the refusal is what is asserted
            return f"{type(exc).__name__}: {exc}"

    async def scenario() -> list[str]:
        slow = asyncio.create_task(check("slow"))  # the only thread compiles it until released
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(check("queued"))  # waits behind it
        await asyncio.sleep(0.1)
        checker.close()  # the lifespan's shutdown: "queued" is cancelled before it ran
        release.set()
        return [await slow, await queued, await check("queued"), await check("a(b")]

    answers = asyncio.run(scenario())
    assert answers[:3] == ["ok", "ok", "ok"]
    assert answers[3].startswith("InvalidParameterError") and "unbalanced parenthesis" in answers[3]
    assert calls == ["slow", "queued", "a(b"]  # "queued" compiled once, on the new threads, then cached
    checker.close()
