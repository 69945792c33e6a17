"""Schemathesis against the gateway's own OpenAPI schema: whatever a client sends, the answer
is never a 5xx, and every error carries OpenAI's shape.

The gateway runs in process (schemathesis' ASGI transport) over a Redis the test owns, with a
real worker in a thread (a tiny random model, a 64-token context) so that valid requests run
to completion too. The schema is given the served model's name as an enum: valid requests
ask for it, invalid ones for anything. Generation is derandomized, so a run is repeatable;
PAGEDSERVE_FUZZ_EXAMPLES=N runs N examples per operation and mode, at random, to explore.

The server's limits are the defaults `serve` has (no --max-tokens-limit: a null max_tokens
means "up to the context"), except fewer prompts and completions per request, to stay quick.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode

from pagedserve import LLM
from pagedserve.common import queue_protocol as q
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.tokenizer import PromptTokenizer
from pagedserve.worker.service import WorkerService

MODEL = "tiny"
CONFIG = ServeConfig(max_prompts_per_request=4, max_choices_per_request=8, request_timeout=60.0,
                     heartbeat_interval=0.2, worker_timeout=2.0, drain_timeout=2.0)
#: examples per operation and mode
EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "0")) or 300


@pytest.fixture(scope="module")
def gateway(tiny_checkpoint):
    """The gateway app, with one live worker behind it."""
    model_dir = tiny_checkpoint("llama-gqa")
    with EmbeddedRedis() as server:
        engine = LLM(str(model_dir), kv_cache_memory=1 << 22, max_model_len=64, attention_backend="torch").engine
        worker = WorkerService(engine, CONFIG, server.url)
        thread = threading.Thread(target=worker.run, name="fuzz-worker", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not worker.queue.redis.zscore(q.WORKERS, worker.worker_id):
            assert time.monotonic() < deadline, "the worker never beat"
            time.sleep(0.05)
        app = create_app(CONFIG, server.url, PromptTokenizer(model_dir), (MODEL,), engine.max_model_len, {},
                         vocab_size=engine.hf_config.vocab_size)
        try:
            yield app
        finally:
            from schemathesis.python import asgi

            asgi.shutdown_lifespans()  # the app's shutdown (schemathesis started it), while Redis is up
            worker.drain()
            thread.join(timeout=30)


@pytest.fixture(scope="module")
def api_schema(gateway):
    raw = copy.deepcopy(gateway.openapi_schema.to_schema())
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        raw["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    # the roles the gateway takes (the schema says only "a string"), so valid chats are generated too
    raw["components"]["schemas"]["ChatMessage"]["properties"]["role"] = {
        "type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]}
    # failures show the request as sent (by default fields named like "*token*" are masked)
    config = SchemathesisConfig.from_dict({"output": {"sanitization": {"enabled": False}}})
    schema = schemathesis.openapi.from_dict(raw, config=config)
    schema.app = gateway  # requests go to the app in process
    return schema


def openai_error_shape(ctx, response, case):
    """An error body is {"error": {"message": str, "type": str, "param": str|null, "code": str|null}}."""
    if response.status_code < 400:
        return None
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, f"not an OpenAI error: {body!r}"
    assert isinstance(error["message"], str) and error["message"], f"no message: {body!r}"
    assert isinstance(error["type"], str), f"type not a string: {body!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"param not a string: {body!r}"
    assert error["code"] is None or isinstance(error["code"], str), f"code not a string: {body!r}"
    return None


@pytest.mark.parametrize(("method", "path", "mode"), [
    ("POST", "/v1/completions", GenerationMode.POSITIVE),
    ("POST", "/v1/completions", GenerationMode.NEGATIVE),
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE),
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE),
    ("GET", "/v1/models", GenerationMode.POSITIVE),
    ("GET", "/health", GenerationMode.POSITIVE),
    ("GET", "/ready", GenerationMode.POSITIVE),
])
def test_fuzz_api(api_schema, method, path, mode):
    operation = api_schema[path][method]
    statuses: Counter[int] = Counter()
    codes: Counter[str | None] = Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="PAGEDSERVE_FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call_and_validate(checks=[not_a_server_error, openai_error_shape])
        statuses[response.status_code] += 1
        if response.status_code >= 400:
            codes[response.json()["error"]["code"]] += 1

    fuzz()
    print(f"{method} {path} {mode.value}: statuses {dict(statuses)}, error codes {dict(codes)}")
    if mode is GenerationMode.POSITIVE and path.startswith("/v1/") and method == "POST":
        assert statuses[200] > 0, "no valid request got through: the fuzzing did not reach the worker"


#: The smallest requests that get a 5xx: a seed beyond 64 bits, found by the fuzzing above
#: and by schemathesis' own runner (`st run`) on the same schema, then the same fault in every
#: other integer field that reaches the queue unbounded. Each passes validation and fails
#: msgpack encoding at admission (OverflowError in queue_protocol.encode): a 500. Now each is
#: a 400 naming its field (the body's integer scan, and SamplingParams' own bounds).
FOUND = {
    "seed beyond 64 bits": ("/v1/completions", {"prompt": "a", "max_tokens": 1, "seed": 2**64}),
    "negative seed beyond 64 bits": ("/v1/completions", {"prompt": "a", "max_tokens": 1, "seed": -2**63 - 1}),
    "chat seed beyond 64 bits": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                          "max_tokens": 1, "seed": 2**64}),
    "top_k beyond 64 bits": ("/v1/completions", {"prompt": "a", "max_tokens": 1, "top_k": 2**64}),
    "stop token id beyond 64 bits": ("/v1/completions", {"prompt": "a", "max_tokens": 1, "stop_token_ids": [2**64]}),
    "min_tokens beyond 64 bits, max_tokens null": ("/v1/completions", {"prompt": "a", "max_tokens": None,
                                                                         "min_tokens": 2**64}),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_requests_the_fuzzing_found_answer_without_a_5xx(api_schema, name):
    path, body = FOUND[name]
    response = api_schema[path]["POST"].Case(body={"model": MODEL, **body}, media_type="application/json").call()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_parameter" and error["param"] in body, error
