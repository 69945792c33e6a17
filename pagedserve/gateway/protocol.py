"""The OpenAI request bodies the gateway accepts, and how they become `SamplingParams`.

Fields follow OpenAI's API; `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids` and `skip_special_tokens` are the extras vLLM users expect.
`cache_salt` is vLLM's: requests share cached prompt blocks only with requests of the same
salt (and the same tenant). Unknown fields are ignored (clients send many); fields we cannot
honour are refused.

Bounds that need the server's configuration (sizes, counts) are checked in `validation`;
the body's nesting and integer sizes, before it is parsed, in `json_limits`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.common.structured_outputs import StructuredOutputsParams
from pagedserve.gateway.structured_requests import (
    from_guided,
    from_response_format,
    from_structured_outputs,
    one_constraint,
)
from pagedserve.gateway.tool_calls import ToolPlan, tool_plan

#: The roles a chat message may have. `developer` is OpenAI's newer name for `system`.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """What completions and chat share."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # isolates prefix-cache reuse to requests with the same salt
    # output constraints (structured_requests.py): at most one per request
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: Any = None  # vLLM's older fields
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def output_constraint(self, plan: ToolPlan | None = None) -> tuple[StructuredOutputsParams | None, str]:
        """The one constraint on the output, and the field that set it (named in its errors)."""
        guided, guided_field = from_guided({"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                                            "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar})
        return one_constraint([("response_format", from_response_format(self.response_format)),
                               ("structured_outputs", from_structured_outputs(self.structured_outputs)),
                               (guided_field or "guided_json", guided),
                               ("tools", plan.constraint() if plan is not None else None)])

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         structured: StructuredOutputsParams | None = None) -> SamplingParams:
        if self.logit_bias:  # refused before anything looks at its entries
            raise InvalidParameterError("logit_bias", "is not supported")
        return SamplingParams(structured_outputs=structured,
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions"""

    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        if self.echo:
            raise InvalidParameterError("echo", "is not supported")
        if self.suffix:
            raise InvalidParameterError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameterError("best_of", "is not supported (other than equal to n)")
        return self._sampling_params(self.max_tokens, self.logprobs, structured)

    @property
    def num_prompts(self) -> int:
        """How many prompts `prompts()` will give, without checking or copying them: a string
        or one list of token ids is one; a list of strings or of token lists, its length."""
        p = self.prompt
        return len(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else 1

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidParameterError("prompt", "must not be empty")
        if all(_is_token(t) for t in p):
            return [list(p)]
        if all(isinstance(t, str) for t in p):
            return list(p)
        if all(isinstance(t, list) and t and all(_is_token(x) for x in t) for t in p):
            return [list(t) for t in p]
        raise InvalidParameterError("prompt", "must be a string, a list of strings, a list of token ids, or a list of lists of token ids")


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def as_template_input(self, i: int) -> dict[str, Any]:
        if self.role not in CHAT_ROLES:
            raise InvalidParameterError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {self.role[:32]!r}")
        content = self.content
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidParameterError(f"messages[{i}].content", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        role = "system" if self.role == "developer" else self.role  # templates know `system`
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidParameterError(f"messages[{i}].tool_calls", "only an assistant message has tool calls")
            message["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{k}]")
                                     for k, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions"""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    def tool_plan(self, max_tools: int) -> ToolPlan:
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, max_tools)

    def sampling_params(self, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, structured)

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidParameterError("messages", "must not be empty")
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _template_tool_call(call: Any, where: str) -> dict[str, Any]:
    """An earlier call as chat templates read it: the arguments an object where they parse."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments", ""), str):
        raise InvalidParameterError(where, "must be {\"id\", \"type\": \"function\", \"function\": "
                                           "{\"name\", \"arguments\": <JSON text>}}")
    text = function.get("arguments") or "{}"
    try:
        arguments: Any = json.loads(text)
    except ValueError:
        arguments = text
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
