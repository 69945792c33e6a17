"""`ResponseBuilder`: OpenAI response bodies and SSE chunks from the requests' folded outputs.

Choice k of a request with several prompts is completion `k % n` of prompt `k // n`, as in
OpenAI's API. Usage counts each prompt once and every generated token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from pagedserve.common.output_log import OutputLog
from pagedserve.common.outputs import Logprobs
from pagedserve.common.queue_protocol import CompletionDelta, WireError
from pagedserve.gateway.tool_output import ToolOutput

_json = msgspec.json.Encoder()

#: characters JSON lets through raw that line readers (Python's str.splitlines, so httpx's
#: aiter_lines) take for line ends: escaped in events, so no client splits one in two
_LINE_BREAKS_IN_JSON = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` on a single line, whatever the text holds."""
    data = _json.encode(body)
    for raw, escaped in _LINE_BREAKS_IN_JSON:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


class ResponseBuilder:
    def __init__(self, kind: str, model: str, n: int, num_prompts: int, include_usage: bool, logprobs: int | None,
                 tool_output: Callable[[], ToolOutput] | None = None):
        """`tool_output`: a chat whose choices may hold tool calls makes one per choice."""
        assert kind in ("chat", "completion"), kind
        self.kind = kind
        self.model = model
        self.n = n
        self.include_usage = include_usage
        self.want_logprobs = logprobs is not None
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_lengths: list[int] = []
        self.logs: list[OutputLog | None] = [None] * num_prompts
        self.done: list[bool] = [False] * num_prompts  # per prompt: its last deltas were added
        num_choices = n * num_prompts
        self.texts: list[list[str]] = [[] for _ in range(num_choices)]
        self.logprobs: list[list[Logprobs]] = [[] for _ in range(num_choices)]
        self.num_chars: list[int] = [0] * num_choices  # text offsets, for completion logprobs
        self.finish_reasons: list[str | None] = [None] * num_choices
        self.error: WireError | None = None
        self._pending: list[tuple[int, CompletionDelta]] = []  # not yet streamed
        self._role_sent: set[int] = set()
        self.tools: list[ToolOutput] | None = [tool_output() for _ in range(num_choices)] if tool_output else None

    # -- folding -----------------------------------------------------------------------------
    def add(self, prompt_index: int, deltas: list[CompletionDelta], log: OutputLog, last: bool) -> None:
        """Fold in a prompt's new deltas; `last`: they are its last (its log may be ahead of them)."""
        self.logs[prompt_index] = log
        self.done[prompt_index] = last
        for d in deltas:
            choice = prompt_index * self.n + d.index
            self._pending.append((choice, d))
            self.texts[choice].append(d.text)
            if d.logprobs:
                self.logprobs[choice].extend(d.logprobs)
            if d.finish_reason is not None:
                self.finish_reasons[choice] = d.finish_reason
        if last and log.error is not None and self.error is None:
            self.error = log.error

    def all_done(self) -> bool:
        return all(self.done)

    def has_content(self) -> bool:
        return any(self._pending) or any(any(pieces) for pieces in self.texts)

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_lengths)
        completion = sum(log.num_generated_tokens for log in self.logs if log is not None)
        cached = sum(log.num_cached_tokens for log in self.logs if log is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- one body ----------------------------------------------------------------------------
    def final_body(self) -> dict[str, Any]:
        choices = []
        for k, pieces in enumerate(self.texts):
            text = "".join(pieces)
            lp = self._logprobs(k, self.logprobs[k], 0) if self.want_logprobs else None
            if self.kind == "chat" and self.tools is not None:
                tools = self.tools[k]
                choices.append({"index": k, "message": tools.message(text), "logprobs": lp,
                                "finish_reason": tools.finish_reason(self.finish_reasons[k])})
            elif self.kind == "chat":
                choices.append({"index": k, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": self.finish_reasons[k]})
            else:
                choices.append({"index": k, "text": text, "logprobs": lp, "finish_reason": self.finish_reasons[k]})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    # -- server-sent events ----------------------------------------------------------------------
    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return sse_event(body)

    def stream_chunks(self) -> Iterator[bytes]:
        """SSE events for everything folded in since the last call."""
        pending, self._pending = self._pending, []
        for k, d in pending:
            if self.kind == "chat" and k not in self._role_sent:
                self._role_sent.add(k)
                yield self._event([{"index": k, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])
            lp = None
            if self.want_logprobs and d.logprobs:
                lp = self._logprobs(k, d.logprobs, self.num_chars[k])
            self.num_chars[k] += len(d.text)
            if self.tools is not None:
                yield from self._tool_chunks(k, d, lp)
                continue
            if d.text or lp is not None:
                if self.kind == "chat":
                    yield self._event([{"index": k, "delta": {"content": d.text}, "logprobs": lp, "finish_reason": None}])
                else:
                    yield self._event([{"index": k, "text": d.text, "logprobs": lp, "finish_reason": None}])
            if d.finish_reason is not None:
                if self.kind == "chat":
                    yield self._event([{"index": k, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}])
                else:
                    yield self._event([{"index": k, "text": "", "logprobs": None, "finish_reason": d.finish_reason}])

    def _tool_chunks(self, k: int, d: CompletionDelta, lp: dict[str, Any] | None) -> Iterator[bytes]:
        """A chat choice's chunks when its text may hold tool calls (`tool_output`)."""
        assert self.tools is not None
        tools = self.tools[k]
        deltas = tools.feed(d.text)
        if d.finish_reason is not None:
            deltas += tools.finish()
        if lp is not None and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            yield self._event([{"index": k, "delta": delta, "logprobs": lp if i == 0 else None, "finish_reason": None}])
        if d.finish_reason is not None:
            yield self._event([{"index": k, "delta": {}, "logprobs": None,
                                "finish_reason": tools.finish_reason(d.finish_reason)}])

    def stream_end(self) -> Iterator[bytes]:
        if self.error is not None:
            yield self.error_event(self.error)
        elif self.include_usage:
            yield self._event([], self.usage())
        yield b"data: [DONE]\n\n"

    @staticmethod
    def error_event(error: WireError) -> bytes:
        body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
        return sse_event(body)

    # -- logprobs ----------------------------------------------------------------------------
    def _logprobs(self, choice: int, entries: list[Logprobs], text_offset: int) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [
                {"token": e.sampled.token, "logprob": e.sampled.logprob, "bytes": list(e.sampled.token.encode()),
                 "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in e.top]}
                for e in entries
            ]}
        offsets = []
        for e in entries:
            offsets.append(text_offset)
            text_offset += len(e.sampled.token)
        return {"tokens": [e.sampled.token for e in entries],
                "token_logprobs": [e.sampled.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
                "text_offset": offsets}
