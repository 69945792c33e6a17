"""A chat request's tools: the checks on `tools`, `tool_choice` and `parallel_tool_calls`,
and what each `tool_choice` asks of the output.

- `none` (the default without tools): the tools are not offered; plain text.
- `auto` (the default with tools): the model may answer or call; the calls are parsed out
  of its text by the `--tool-call-parser` plugin (`gateway/tool_output.py`).
- `required`: the output is constrained to a JSON array of `{"name", "arguments"}` objects,
  one branch per tool (`anyOf`, each name a `const`, its arguments that tool's parameters),
  at least one item, and at most one when `parallel_tool_calls` is false.
- a named function: the output is constrained to that function's parameters: it *is* the
  arguments.

Only JSON Schema crosses to the engine, whatever the grammar backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.structured_outputs import StructuredOutputsParams

#: OpenAI's rule for a function's name
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: a function without `parameters` takes none
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"type": "function", "function": {...}}, checked
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls

    @property
    def offered(self) -> list[dict[str, Any]]:
        """The tools the prompt lists: none for `none`."""
        return [] if self.mode == "none" else self.tools

    def constraint(self) -> StructuredOutputsParams | None:
        """The JSON Schema a forced tool_choice puts on the output; None for none and auto."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.named))
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        branches = []
        for i, tool in enumerate(self.tools):
            function = tool["function"]
            ref = f"__tool{i}"
            # each tool's parameters move under $defs, their own `#...` references with them
            defs[ref] = _rebase_refs(self._parameters(function["name"]), f"#/$defs/{ref}")
            branches.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                              "arguments": {"$ref": f"#/$defs/{ref}"}},
                             "required": ["name", "arguments"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1, "$defs": defs}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def _parameters(self, name: str | None) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or _NO_PARAMETERS


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#/...") made relative to `base` instead of the root."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            else:
                out[key] = _rebase_refs(value, base)
        return out
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def check_tools(tools: Any, max_tools: int) -> list[dict[str, Any]]:
    """The tools, each `{"type": "function", "function": {"name", "description"?, "parameters"?}}`."""
    if not isinstance(tools, list):
        raise InvalidParameterError("tools", "must be a list of {\"type\": \"function\", \"function\": {...}} entries")
    if len(tools) > max_tools:
        raise InvalidParameterError("tools", f"has {len(tools)} tools; this server takes at most {max_tools} (--max-tools)")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidParameterError(where, "must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidParameterError(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores or dashes")
        if name in names:
            raise InvalidParameterError(f"{where}.function.name", f"{name!r} names two tools")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise InvalidParameterError(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidParameterError(f"{where}.function.parameters", "must be a JSON Schema object")
    return tools


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, max_tools: int) -> ToolPlan:
    """Check the tool fields of a chat request and say what they ask of the output."""
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if not tools:  # None or []
        if tool_choice not in (None, "none"):
            raise InvalidParameterError("tool_choice", "needs `tools`: no tools were given")
        return ToolPlan("none", parallel=parallel)
    checked = check_tools(tools, max_tools)
    if tool_choice is None:
        return ToolPlan("auto", checked, parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidParameterError("tool_choice", f"must be none, auto, required or a function; got {tool_choice[:32]!r}")
        return ToolPlan(tool_choice, checked, parallel=parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise InvalidParameterError("tool_choice", "must be none, auto, required or {\"type\": \"function\", "
                                                   "\"function\": {\"name\": ...}}")
    name = function["name"]
    if all(t["function"]["name"] != name for t in checked):
        raise InvalidParameterError("tool_choice", f"names the function {name[:64]!r}, which is not in `tools`")
    return ToolPlan("named", checked, named=name, parallel=parallel)
