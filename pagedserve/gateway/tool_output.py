"""A chat choice's output as tool calls: `message.tool_calls` in one body, `delta.tool_calls`
in a stream.

- `auto`: the tool parser plugin finds the calls in the text; text that could still begin a
  call is held back until it cannot (`ToolCallStream`), and a call is streamed once whole.
- `required`: the output is a JSON array of `{"name", "arguments"}` (the grammar saw to it);
  `ToolArrayScanner` reads it as it arrives and streams each call's arguments as they come.
- a named function: the output is the arguments; each piece is streamed as it comes.

The first `delta.tool_calls` chunk of each call carries its index, id, type and name (and
`arguments: ""`), the next ones fragments of its arguments. A choice that called a tool
and stopped ends with finish_reason `tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pagedserve.common.contracts import ParsedToolCall, ToolParser
from pagedserve.gateway.tool_calls import ToolPlan


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolArrayScanner:
    """An incremental reader of `[{"name": ..., "arguments": {...}}, ...]`: string- and
    escape-aware depth tracking, no full parse. `feed` gives (call index, name or None,
    argument text) events; a call's arguments are held until its name is known."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.index = -1  # the call being read
        self.expect_key = False
        self.key: str | None = None
        self.string: list[str] | None = None  # a key or the name, being read
        self.reading = ""  # "key", "name" or ""
        self.in_arguments = False
        self.names: dict[int, str] = {}
        self.pending: dict[int, list[str]] = {}  # arguments read before the name

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        out: list[tuple[int, str | None, str]] = []
        fragment: list[str] = []

        def flush() -> None:
            if fragment and self.index >= 0:
                if self.index in self.names:
                    out.append((self.index, None, "".join(fragment)))
                else:
                    self.pending.setdefault(self.index, []).extend(fragment)
            fragment.clear()

        for ch in text:
            if self.in_arguments:
                fragment.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    self._string_end(out, flush)
                    continue
                if self.string is not None:
                    self.string.append(ch)
                continue
            if ch == '"':
                self.in_string = True
                if self.depth == 2 and self.expect_key:
                    self.reading, self.string = "key", []
                elif self.depth == 2 and self.key == "name":
                    self.reading, self.string = "name", []
            elif ch in "{[":
                if self.depth == 2 and not self.expect_key and self.key == "arguments" and not self.in_arguments:
                    self.in_arguments = True
                    fragment.append(ch)
                self.depth += 1
                if self.depth == 2:
                    flush()
                    self.index += 1
                    self.expect_key, self.key = True, None
            elif ch in "}]":
                self.depth -= 1
                if self.in_arguments and self.depth == 2:
                    self.in_arguments = False
            elif ch == ":" and self.depth == 2:
                self.expect_key = False
            elif ch == "," and self.depth == 2:
                self.expect_key, self.key = True, None
        flush()
        return out

    def _string_end(self, out: list[tuple[int, str | None, str]], flush) -> None:
        text, reading = "".join(self.string or ()), self.reading
        self.string, self.reading = None, ""
        if reading == "key":
            self.key = _unescape(text)
        elif reading == "name":
            flush()
            self.names[self.index] = name = _unescape(text)
            out.append((self.index, name, ""))
            if pending := self.pending.pop(self.index, None):
                out.append((self.index, None, "".join(pending)))


def _unescape(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


class ToolOutput:
    """One choice's text, turned into content and tool calls."""

    def __init__(self, plan: ToolPlan, parser: ToolParser):
        self.plan = plan
        self.stream = parser.stream() if plan.mode == "auto" else None
        self.scanner = ToolArrayScanner() if plan.mode == "required" else None
        self.ids: list[str] = []
        self.arguments: list[list[str]] = []
        self.names: list[str] = []
        self.content: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas for a new piece of text (each a chunk's `delta`)."""
        if self.plan.mode == "named":
            deltas = []
            if not self.called:
                self._start(self.plan.named or "")
                deltas.append(self._open(0, self.plan.named or ""))
            if text:
                self.arguments[0].append(text)
                deltas.append(self._args(0, text))
            return deltas
        if self.scanner is not None:
            deltas = []
            for index, name, fragment in self.scanner.feed(text):
                if name is not None:
                    self._start(name)
                    deltas.append(self._open(index, name))
                if fragment:
                    self.arguments[index].append(fragment)
                    deltas.append(self._args(index, fragment))
            return deltas
        assert self.stream is not None
        return self._events(self.stream.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back when the output ends."""
        return self._events(self.stream.finish()) if self.stream is not None else []

    def message(self, text: str) -> dict[str, Any]:
        """The whole `message` of a choice, from its whole text."""
        self.feed(text)
        self.finish()
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() else None}
        if self.plan.mode == "auto" and not self.called:
            message["content"] = text  # no call: the text, as written
        if self.called:
            message["tool_calls"] = [self._call(i) for i in range(len(self.ids))]
        return message

    def _events(self, events) -> list[dict[str, Any]]:
        deltas = []
        for event in events:
            if event.call is not None:
                deltas += self._whole(event.call)
            elif event.text:
                self.content.append(event.text)
                deltas.append({"content": event.text})
        return deltas

    def _whole(self, call: ParsedToolCall) -> list[dict[str, Any]]:
        index = len(self.ids)
        self._start(call.name)
        self.arguments[index].append(call.arguments)
        return [self._open(index, call.name), self._args(index, call.arguments)]

    def _start(self, name: str) -> None:
        self.ids.append(call_id())
        self.names.append(name)
        self.arguments.append([])

    def _open(self, index: int, name: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    @staticmethod
    def _args(index: int, fragment: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}

    def _call(self, index: int) -> dict[str, Any]:
        return {"id": self.ids[index], "type": "function",
                "function": {"name": self.names[index], "arguments": "".join(self.arguments[index])}}
