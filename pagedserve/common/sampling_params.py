"""How to sample one request: the OpenAI parameters plus vLLM's common extras."""

from __future__ import annotations

import math

import msgspec

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.structured_outputs import StructuredOutputsParams

#: Upper bound on `n` and on `logprobs` unless the engine is configured otherwise.
MAX_N = 16
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, kw_only=True):
    """Sampling parameters of one request; validated on construction.

    temperature 0 means greedy. `max_tokens=None` means "up to the context length".
    """

    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0  # drop tokens below min_p * p(best token)
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtracted once if the token was generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per time the token was generated
    seed: int | None = None  # same seed, same tokens, whatever shares the batch
    max_tokens: int | None = 16
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens
    stop: str | list[str] | None = None  # stop strings, not included in the output
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities per generated token
    skip_special_tokens: bool = True
    #: the constraint the output must satisfy (JSON schema, regex, choice, grammar); None: free text
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, max_n: int = MAX_N) -> None:
        """Raise `InvalidParameterError` naming the first field that is out of range."""

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParameterError(param, message)

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_num(value) -> bool:
            return (is_int(value) or isinstance(value, float)) and math.isfinite(value)

        check(is_int(self.n) and 1 <= self.n <= max_n, "n", f"must be an integer in [1, {max_n}], got {self.n!r}")
        check(is_num(self.temperature) and self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature!r}")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", f"must be -1, 0 or positive, got {self.top_k!r}")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        check(is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        check(self.seed is None or is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        stop = self.stop
        check(
            stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)),
            "stop", f"must be a string or a list of strings, got {type(stop).__name__}",
        )
        check(not self.stop_strings or all(self.stop_strings), "stop", "stop strings must not be empty")
        ids = self.stop_token_ids
        check(ids is None or (isinstance(ids, list) and all(is_int(t) and t >= 0 for t in ids)), "stop_token_ids", "must be a list of non-negative integers")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
