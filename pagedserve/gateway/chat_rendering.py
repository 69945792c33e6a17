"""A chat with tools, as the model's chat template can render it.

A template that renders tools itself (its source uses `tools`, as Qwen2.5's and Hermes 2
Pro's do) gets them as `tools=`, and an assistant's earlier calls as `tool_calls` (the
arguments as an object). A template that does not (SmolLM2's plain ChatML, the default
model's) gets what llama.cpp gives such models, in the tool parser's text format (hermes):

- a system message listing the tools and the call format, after the caller's own system
  message when there is one;
- an assistant's earlier calls written into its content as the model would have written
  them (`<tool_call>...</tool_call>`);
- a tool result wrapped in `<tool_response>` tags, in a `tool` turn when the template knows
  that role, else in a `user` turn.

`tool_choice: none` offers no tools: the prompt is the chat alone.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.common.contracts import ParsedToolCall, ToolParser
from pagedserve.gateway.tool_calls import ToolPlan


def chat_inputs(messages: list[dict[str, Any]], plan: ToolPlan, parser: ToolParser, template_uses_tools: bool,
                template_knows_tool_role: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to render and the `tools` to pass the template (None: none)."""
    if template_uses_tools:
        return messages, plan.offered or None
    rendered = [_as_text(m, parser, template_knows_tool_role) for m in messages]
    if plan.offered:
        prompt = parser.system_prompt(plan.offered)
        if rendered and rendered[0]["role"] == "system":
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content']}\n\n{prompt}" if first["content"] else prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _as_text(message: dict[str, Any], parser: ToolParser, knows_tool_role: bool) -> dict[str, Any]:
    """A message whose tool calls or tool result are written into its content."""
    if message["role"] == "tool":
        out = {k: v for k, v in message.items() if k != "tool_call_id"}
        out["role"] = "tool" if knows_tool_role else "user"
        out["content"] = parser.format_tool_result(message["content"])
        return out
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    written = parser.format_calls([ParsedToolCall(c["function"]["name"], _arguments_text(c["function"]["arguments"]))
                                   for c in calls])
    out["content"] = f"{message['content']}\n{written}" if message["content"] else written
    return out


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
