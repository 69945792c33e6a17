"""Results of a request, as the engine hands them out.

Each engine step gives a `RequestDelta` per request it changed: only what is new (tokens,
text, logprobs), made once by the worker's output processor. The worker forwards the
`CompletionDelta`s unchanged to the gateway; `LLM.generate` keeps the final delta's
`RequestOutput`, the whole result.
"""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True):
    """One token's log-probability, with the token's text."""

    token_id: int
    logprob: float
    token: str  # decoded text of this single token


class Logprobs(msgspec.Struct):
    """Log-probability of the sampled token and the top-N alternatives at one position."""

    sampled: TokenLogprob
    top: list[TokenLogprob]  # best first; empty when top-N is 0


class CompletionOutput(msgspec.Struct):
    """One of the n completions of a request."""

    index: int  # which of the n completions this is
    text: str  # the full text so far (stop string removed)
    token_ids: list[int]  # every generated token id so far
    finish_reason: str | None = None  # "stop", "length", "abort", "error", or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[Logprobs] | None = None  # one entry per generated token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct):
    """When things happened to a request, in time.monotonic() seconds of the worker."""

    arrival_time: float  # added to the engine
    first_token_time: float | None = None  # its first output token was sampled
    finished_time: float | None = None  # its last completion ended
    num_preemptions: int = 0  # the most times one of its sequences was preempted (its KV dropped and recomputed)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class RequestOutput(msgspec.Struct):
    """Everything a caller sees of one request."""

    request_id: str
    prompt: str | None  # the prompt text, when the request was given text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why the request failed, when the engine could not serve it
    metrics: RequestMetrics | None = None


class CompletionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one step added to one completion; `start` is the index of its first token.

    The queue carries it as is: the gateway accepts a delta only where it continues its
    completion exactly (`start`), so a resumed request repeats and loses nothing.
    """

    index: int  # which of the n completions
    start: int  # completion-token index of token_ids[0] (tokens of this completion before it)
    token_ids: list[int] = []  # the new token ids
    text: str = ""  # the text they add (may be empty: a partial character, a held-back stop)
    logprobs: list[Logprobs] | None = None  # one per new token, when asked
    finish_reason: str | None = None  # "stop" | "length", on the completion's last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class RequestDelta(msgspec.Struct, kw_only=True):
    """What one engine step changed in one request."""

    request_id: str
    deltas: list[CompletionDelta]  # the completions that changed, each at most once
    finished: bool = False  # every completion has ended (or the request failed)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why the request failed, when the engine could not serve it
    output: RequestOutput | None = None  # the whole result; only on the finished delta
