"""The tool-call parser's contract: how a model that was offered tools writes a call, and how
the gateway finds the calls in what it wrote (`tool_choice: auto`).

A parser plugin (entry-point group `pagedserve.tool_parsers`, `--tool-call-parser`) is built
once per gateway by `factory()`. It owns one text format both ways: the system prompt that
tells a model without a tool-aware chat template what the tools are and how to call them,
the text of an earlier turn's calls and tool results, and the parsing of new calls, whole
(`parse`) or as the text streams (`stream`).

Forced calls (`tool_choice: required` or a named function) need no parser: their output is
constrained to JSON, and the gateway reads it as JSON.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.contracts.version import API_VERSION


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(slots=True)
class ParsedOutput:
    """The text around the calls (None when only whitespace) and the calls, in order."""

    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    """One piece of a streamed output: text, or a complete call (index counts calls from 0)."""

    text: str = ""
    call: ParsedToolCall | None = None


class ToolCallStream(ABC):
    """The parser's state for one streamed output."""

    @abstractmethod
    def feed(self, text: str) -> list[ToolCallEvent]:
        """What can be told of the output so far: text that can no longer begin a call, and
        calls once complete. Text that could still begin one is held back."""

    @abstractmethod
    def finish(self) -> list[ToolCallEvent]:
        """The output ended: whatever was held back, as text if it never became a call."""


class ToolParser(ABC):
    API_VERSION = API_VERSION

    #: its name in `--tool-call-parser`
    name: str = ""
    #: the text that ends one call: with `parallel_tool_calls: false` it is a stop string, so
    #: generation ends after the first call (None: the format has no closing marker)
    call_end: str | None = None

    @abstractmethod
    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The instructions listing `tools` (OpenAI's `{"type": "function", "function": ...}`
        entries) and the call format, for a chat template that does not render tools."""

    @abstractmethod
    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        """An earlier assistant turn's calls, as the model would have written them."""

    @abstractmethod
    def format_tool_result(self, content: str) -> str:
        """A tool message's content, as the model expects to read it."""

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The calls in a whole output; text that is not a well-formed call stays text."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one output."""
