"""Structured output and tool calls end to end: `pagedserve serve` (one CPU worker, a tiny
random model) driven by the official openai SDK and by LangChain's ChatOpenAI, unchanged.

A random model says nothing sensible, but the grammar makes every constrained answer valid:
each is checked against its JSON Schema. In `auto` mode it never calls a tool by itself, so
those tests check the exact shape of a text answer (the parse path has its unit tests in
test_structured_requests.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve.common.redis_server import EmbeddedRedis

from serve_helpers import LiveServer
from tiny_models import build_checkpoint

KEY = "sk-test-a"
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=1000)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("so-llama"), max_position_embeddings=4096)
    with EmbeddedRedis() as redis_server:  # as test_live_server.py runs it
        live = LiveServer(model_dir, redis_server.url, "--num-workers", "1", "--max-num-seqs", "4")
        try:
            yield live.wait_ready()
        finally:
            live.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _model(client) -> str:
    return client.models.list().data[0].id


def _check_call(call, name: str, schema: dict) -> None:
    assert CALL_ID.match(call.id) and call.type == "function" and call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), schema)


def _streamed(client, **request) -> tuple[str, list[dict], str | None]:
    """content, calls ({id, name, arguments}) and finish_reason of a streamed answer."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:  # a call's first chunk: index, id, type, name, ""
                assert piece.index not in calls and piece.type == "function" and piece.function.arguments == ""
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                calls[piece.index]["arguments"] += piece.function.arguments
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_parse_returns_a_valid_model(client):
    reply = client.chat.completions.parse(model=_model(client), messages=ASK, response_format=City, max_tokens=128,
                                          temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


def test_completions_with_a_regex_and_a_choice(client):
    model = _model(client)
    text = client.completions.create(model=model, prompt="x", max_tokens=16, extra_body={
        "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}).choices[0].text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)
    answer = client.chat.completions.create(model=model, messages=ASK, max_tokens=8,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert answer.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_calls_gives_exactly_one_call(client, stream):
    request = dict(model=_model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                   parallel_tool_calls=False, max_tokens=96, temperature=0)
    if stream:
        content, calls, finish = _streamed(client, **request)
        assert (content, len(calls), finish) == ("", 1, "tool_calls")
        assert CALL_ID.match(calls[0]["id"]) and calls[0]["name"] in ("get_weather", "get_time")
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS if calls[0]["name"] == "get_weather" else TIME["function"]["parameters"])
        return
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call, call.function.name, PARAMS if call.function.name == "get_weather" else TIME["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function(client, stream):
    request = dict(model=_model(client), messages=ASK, tools=[WEATHER, TIME], max_tokens=64, temperature=0,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        content, calls, finish = _streamed(client, **request)
        assert (content, [c["name"] for c in calls], finish) == ("", ["get_weather"], "tool_calls")
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS)
        return
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], "get_weather", PARAMS)


def test_auto_without_a_call_is_text_streamed_or_not(client):
    request = dict(model=_model(client), messages=ASK, tools=[WEATHER], max_tokens=24, temperature=0)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    content, calls, finish = _streamed(client, **request)
    assert (content, calls, finish) == (choice.message.content, [], choice.finish_reason)


def test_a_follow_up_turn_with_a_tool_result(client):
    first = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER], max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    reply = client.chat.completions.create(model=_model(client), messages=messages, tools=[WEATHER], max_tokens=8)
    assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].finish_reason in ("stop", "length")


def test_langchain_runs_unchanged(server, client):
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=_model(client), base_url=server.base_url + "/v1", api_key=KEY, max_tokens=128,
                     temperature=0, max_retries=0)
    city = llm.with_structured_output(City).invoke("Name a city.")  # response_format json_schema
    assert isinstance(city, City)
    # a named tool; strict, as LangChain then closes the schema (additionalProperties: false):
    # an open one lets a random model add keys until max_tokens
    city = llm.with_structured_output(City, method="function_calling", strict=True).invoke("Name a city.")
    assert isinstance(city, City)

    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    message = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")  # auto: text from a random model
    assert isinstance(message, AIMessage) and message.tool_calls == [] and isinstance(message.content, str)
