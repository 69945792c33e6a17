"""Request fields → the one `StructuredOutputsParams` the engine gets; tools → the forced
schema; the hermes parser; the tool-call output of one choice, whole and streamed. No server."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import msgspec
import pytest

from pagedserve.common.contracts import GrammarError, ParsedToolCall
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.structured_outputs import StructuredOutputsParams as SOP
from pagedserve.gateway.chat_rendering import chat_inputs
from pagedserve.gateway.grammar_check import GrammarChecker
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.gateway.tool_calls import ToolPlan, tool_plan
from pagedserve.gateway.tool_output import ToolArrayScanner, ToolOutput
from pagedserve.plugins.hermes_tool_parser import HermesToolParser

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": MSGS, **fields}, ChatCompletionRequest)


def constraint(**fields):
    request = chat(**fields)
    return request.output_constraint(request.tool_plan(8))


def test_response_format_and_structured_outputs_give_exactly_this_spec():
    assert constraint() == (None, "")
    assert constraint(response_format={"type": "text"}) == (None, "")
    assert constraint(response_format={"type": "json_object"}) == (SOP(json_object=True), "response_format")
    assert constraint(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": False}}) \
        == (SOP(json=SCHEMA), "response_format")
    assert constraint(structured_outputs={"regex": "[a-z]+"}) == (SOP(regex="[a-z]+"), "structured_outputs")
    assert constraint(structured_outputs={"choice": ["yes", "no"]}) == (SOP(choice=["yes", "no"]), "structured_outputs")
    assert constraint(structured_outputs={"grammar": "start: \"a\""}) == (SOP(grammar='start: "a"'), "structured_outputs")
    assert constraint(structured_outputs={"json": SCHEMA}) == (SOP(json=SCHEMA), "structured_outputs")
    assert constraint(guided_json=SCHEMA) == (SOP(json=SCHEMA), "guided_json")
    assert constraint(guided_regex="a+") == (SOP(regex="a+"), "guided_regex")
    assert constraint(guided_choice=["a", "b"]) == (SOP(choice=["a", "b"]), "guided_choice")
    assert constraint(guided_grammar='start: "x"') == (SOP(grammar='start: "x"'), "guided_grammar")
    completion = msgspec.convert({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}, CompletionRequest)
    spec, field = completion.output_constraint()
    assert (spec, field) == (SOP(json_object=True), "response_format")
    assert completion.sampling_params(spec).structured_outputs == SOP(json_object=True)


def test_tools_give_exactly_this_spec():
    assert constraint(tools=[WEATHER]) == (None, "")  # auto: free text, parsed afterwards
    assert constraint(tools=[WEATHER], tool_choice="none") == (None, "")
    assert constraint(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}) \
        == (SOP(json=SCHEMA), "tools")
    assert constraint(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}) \
        == (SOP(json={"type": "object", "properties": {}}), "tools")
    branch = lambda name, i: {"type": "object", "properties": {"name": {"const": name},  # noqa: E731
                                                               "arguments": {"$ref": f"#/$defs/__tool{i}"}},
                              "required": ["name", "arguments"], "additionalProperties": False}
    expected = {"type": "array", "items": {"anyOf": [branch("get_weather", 0), branch("get_time", 1)]}, "minItems": 1,
                "$defs": {"__tool0": SCHEMA, "__tool1": {"type": "object", "properties": {}}}}
    assert constraint(tools=[WEATHER, TIME], tool_choice="required") == (SOP(json=expected), "tools")
    assert constraint(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False) \
        == (SOP(json={**expected, "maxItems": 1}), "tools")


def test_required_schema_keeps_each_tools_references_and_validates_calls():
    nested = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tool = {"type": "function", "function": {"name": "go", "parameters": nested}}
    spec = ToolPlan("required", [tool, WEATHER]).constraint()
    assert spec is not None and isinstance(spec.json, dict)
    assert spec.json["$defs"]["__tool0"]["properties"]["where"] == {"$ref": "#/$defs/__tool0/$defs/Place"}
    jsonschema.validate([{"name": "go", "arguments": {"where": {"city": "Paris"}}}], spec.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "arguments": {"where": {}}}], spec.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"where": {"city": "x"}}}], spec.json)


def test_tool_plan_checks():
    def refused(**fields) -> tuple[str | None, str]:
        with pytest.raises(InvalidParameterError) as info:
            tool_plan(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel"), 2)
        return info.value.param, info.value.message

    assert refused(tool_choice="auto")[0] == "tool_choice"
    assert refused(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}) \
        == ("tool_choice", "tool_choice: names the function 'nope', which is not in `tools`")
    assert refused(tools=[WEATHER, TIME, {**TIME, "function": {"name": "x"}}])[0] == "tools"
    assert refused(tools=[{"type": "function", "function": {"name": "bad name"}}])[0] == "tools[0].function.name"
    assert refused(tools=[WEATHER, WEATHER])[0] == "tools[1].function.name"
    assert refused(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}])[0] == "tools[0].function.parameters"
    assert refused(tools=[WEATHER], tool_choice="sometimes")[0] == "tool_choice"
    assert tool_plan(None, "none", None, 2).mode == "none"


# -- the hermes parser -----------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_parse():
    parser = HermesToolParser()
    plain = parser.parse("Just text.")
    assert (plain.content, plain.calls) == ("Just text.", [])
    one = parser.parse("Let me look.\n" + CALL)
    assert (one.content, one.calls) == ("Let me look.", [ParsedToolCall("get_weather", '{"city": "Paris"}')])
    two = parser.parse(CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert (two.content, [c.arguments for c in two.calls]) == (None, ['{"city": "Paris"}', '{"city": "Rome"}'])
    bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>"
    assert (parser.parse(bad).content, parser.parse(bad).calls) == (bad, [])
    unclosed = parser.parse(CALL.removesuffix("</tool_call>"))  # stopped at the closing tag
    assert unclosed.calls == [ParsedToolCall("get_weather", '{"city": "Paris"}')]


def test_hermes_stream_holds_back_what_could_begin_a_call():
    parser = HermesToolParser()
    text = "Sure. " + CALL + " and <tool nothing"
    stream = parser.stream()
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert "".join(e.text for e in events) == "Sure.  and <tool nothing"
    assert [e.call for e in events if e.call] == [ParsedToolCall("get_weather", '{"city": "Paris"}')]
    stream = parser.stream()
    assert [e.text for e in stream.feed("a <tool_")] == ["a "]  # "<tool_" held
    assert stream.finish()[0].text == "<tool_"
    stream = parser.stream()
    malformed = "<tool_call>{oops}</tool_call>"
    assert "".join(e.text for e in stream.feed(malformed) + stream.finish()) == malformed


def test_hermes_formats_earlier_turns_and_the_system_prompt():
    parser = HermesToolParser()
    assert parser.format_calls([ParsedToolCall("f", '{"a": 1}')]) == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert parser.format_tool_result("22 C") == "<tool_response>\n22 C\n</tool_response>"
    prompt = parser.system_prompt([WEATHER])
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt


def test_chat_inputs_for_a_plain_chatml_template():
    parser = HermesToolParser()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}]
    rendered, tools = chat_inputs(messages, ToolPlan("auto", [WEATHER]), parser, False, False)
    assert tools is None
    assert rendered[0] == {"role": "system", "content": "Be brief.\n\n" + parser.system_prompt([WEATHER])}
    assert rendered[2] == {"role": "assistant", "content": CALL}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n22 C\n</tool_response>"}
    rendered, _ = chat_inputs(messages[1:2], ToolPlan("none", [WEATHER]), parser, False, True)
    assert rendered == messages[1:2]  # none: no tools offered
    rendered, tools = chat_inputs(messages, ToolPlan("auto", [WEATHER]), parser, True, True)
    assert (rendered, tools) == (messages, [WEATHER])  # the template renders them itself


# -- one choice's output -------------------------------------------------------------------------------
def _stream(output: ToolOutput, text: str, step: int = 3) -> list[dict]:
    deltas = [d for i in range(0, len(text), step) for d in output.feed(text[i:i + step])]
    return deltas + output.finish()


def _assemble(deltas: list[dict]) -> list[dict]:
    calls: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in piece:
                assert call["id"] is None and piece["type"] == "function" and piece["function"]["arguments"] == ""
                call["id"], call["name"] = piece["id"], piece["function"]["name"]
            else:
                assert call["id"] is not None  # a call's first chunk carries its id and name
            call["arguments"] += piece["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_required_output_streams_arguments_as_they_arrive():
    text = '[{"name": "get_weather", "arguments": {"city": "Pa\\"r{is]"}}, {"name": "get_time", "arguments": {}}]'
    calls = _assemble(_stream(ToolOutput(ToolPlan("required", [WEATHER, TIME]), HermesToolParser()), text, step=2))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": 'Pa"r{is]'}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    whole = ToolOutput(ToolPlan("required", [WEATHER, TIME]), HermesToolParser()).message(text)
    assert whole["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == \
        [("get_weather", '{"city": "Pa\\"r{is]"}'), ("get_time", "{}")]
    # arguments written before the name are held until it comes
    scanner = ToolArrayScanner()
    assert scanner.feed('[{"arguments": {"a": 1}, "name": "f"}]') == [(0, "f", ""), (0, None, '{"a": 1}')]


def test_named_and_auto_outputs():
    named = ToolOutput(ToolPlan("named", [WEATHER], named="get_weather"), HermesToolParser())
    deltas = _stream(named, '{"city": "Paris"}')
    assert _assemble(deltas)[0]["name"] == "get_weather"
    assert _assemble(deltas)[0]["arguments"] == '{"city": "Paris"}'
    assert named.finish_reason("stop") == "tool_calls" and named.finish_reason("length") == "length"
    auto = ToolOutput(ToolPlan("auto", [WEATHER]), HermesToolParser())
    deltas = _stream(auto, "Checking.\n" + CALL)
    assert "".join(d.get("content", "") for d in deltas) == "Checking.\n"
    assert [(c["name"], c["arguments"]) for c in _assemble(deltas)] == [("get_weather", '{"city": "Paris"}')]
    plain = ToolOutput(ToolPlan("auto", [WEATHER]), HermesToolParser())
    assert plain.message("No call here.") == {"role": "assistant", "content": "No call here."}
    assert plain.finish_reason("stop") == "stop"


# -- the grammar checker ---------------------------------------------------------------------------
class _CountingBackend:
    def __init__(self):
        self.compiled: list[str] = []

    def compile(self, spec):
        self.compiled.append(spec.kind)
        if spec.regex == "(":
            raise GrammarError('invalid regex: unclosed group')
        return object()


def test_grammar_checker_caches_good_and_bad_specs():
    backend = _CountingBackend()
    checker = GrammarChecker(lambda: backend, max_chars=20, compile_timeout=5.0)

    async def scenario():
        for _ in range(3):
            await checker.check(SOP(regex="a+"), "structured_outputs")
            with pytest.raises(InvalidParameterError) as info:
                await checker.check(SOP(regex="("), "response_format")
            assert (info.value.param, info.value.message) == ("response_format", "response_format: invalid regex: unclosed group")
        with pytest.raises(InvalidParameterError, match="has 21 characters; this server takes at most 20"):
            await checker.check(SOP(regex="a" * 21), "structured_outputs")

    asyncio.run(scenario())
    checker.close()
    assert backend.compiled == ["regex", "regex"]  # each spec compiled once; the long one never
