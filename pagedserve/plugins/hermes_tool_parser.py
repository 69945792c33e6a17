"""The built-in tool-call parser, `hermes`: calls written as NousResearch's Hermes 2 Pro
models write them (and Qwen2.5's template asks for), one JSON object per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The system prompt is Hermes 2 Pro's, which llama.cpp also gives a model whose template does
not render tools. Tool results are read back inside `<tool_response>` tags.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pagedserve.common.contracts import (
    ParsedOutput,
    ParsedToolCall,
    ToolCallEvent,
    ToolCallStream,
    ToolParser,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def _call_of(body: str) -> ParsedToolCall | None:
    """The call a tag's body holds, or None when it is not `{"name": str, "arguments": object}`."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that begins `tag` (it may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolStream(ToolCallStream):
    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[ToolCallEvent]:
        self._buffer += text
        events: list[ToolCallEvent] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _held_prefix(self._buffer, OPEN)
                    cut = len(self._buffer) - keep
                    if cut:
                        events.append(ToolCallEvent(text=self._buffer[:cut]))
                    self._buffer = self._buffer[cut:]
                    return events
                if start:
                    events.append(ToolCallEvent(text=self._buffer[:start]))
                self._buffer = self._buffer[start + len(OPEN):]
                self._in_call = True
            end = self._buffer.find(CLOSE)
            if end < 0:
                return events
            events.append(self._event(self._buffer[:end], closed=True))
            self._buffer = self._buffer[end + len(CLOSE):]
            self._in_call = False

    def finish(self) -> list[ToolCallEvent]:
        rest, self._buffer = self._buffer, ""
        if self._in_call:  # an unclosed last call: complete when generation stopped at CLOSE
            self._in_call = False
            return [self._event(rest, closed=False)]
        return [ToolCallEvent(text=rest)] if rest else []

    @staticmethod
    def _event(body: str, closed: bool) -> ToolCallEvent:
        call = _call_of(body)
        if call is not None:
            return ToolCallEvent(call=call)
        return ToolCallEvent(text=OPEN + body + (CLOSE if closed else ""))


class HermesToolParser(ToolParser):
    name = "hermes"
    call_end = CLOSE

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("You are a function calling AI model. You are provided with function signatures within "
                "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
                "Don't make assumptions about what values to plug into functions. Here are the available tools: "
                f"<tools>\n{listed}\n</tools>\n"
                "For each function call return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags as follows:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>')

    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        return "\n".join(f'{OPEN}\n{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}\n{CLOSE}'
                         for c in calls)

    def format_tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ParsedToolCall] = []
        pieces: list[str] = []
        pos = 0
        for match in _CALL.finditer(text):
            call = _call_of(match.group(1))
            if call is None:
                continue  # stays text
            pieces.append(text[pos:match.start()])
            calls.append(call)
            pos = match.end()
        if not calls:
            return ParsedOutput(text, [])  # plain text, as written
        pieces.append(text[pos:])
        content = "".join(pieces).strip()
        return ParsedOutput(content or None, calls)

    def stream(self) -> ToolCallStream:
        return HermesToolStream()
