"""`Request`: one sequence the engine generates (one of the n completions of a caller's request).

The scheduler owns its status and progress; the KV cache manager keeps its blocks, by
`request_id`, and never writes here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.common.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the context length
    FINISHED_ABORTED = 5  # abort() or a deadline

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


@dataclass(slots=True, eq=False)
class Request:
    """A sequence: its tokens and how many of them have K/V in the cache."""

    request_id: str  # unique per sequence ("<user id>" or "<user id>#<index>" for n > 1)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # the model's EOS ids (ignored with ignore_eos)
    max_tokens: int  # resolved: min(max_tokens, max_model_len - prompt length)
    parent_id: str | None = None  # the caller's request this is a sequence of
    index: int = 0  # which of the n completions
    fork_from: Request | None = None  # sibling whose prompt blocks this one shares
    arrival_time: float = field(default_factory=time.monotonic)
    #: prompt then output token ids; the first `num_computed_tokens` have K/V in the cache
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    cache_salt: str | None = None  # tenant salt: requests with different salts share no block
    tenant: str | None = None  # whose share of the engine it uses (fair schedulers balance tenants)
    stop_reason: str | int | None = None
    #: the request's seed (+ its index among the n); its draws are keyed by (seed, output
    #: position), so a seeded sequence gives the same tokens however its steps are batched,
    #: resumed or speculated. None: the sampler's own generator
    seed: int | None = None
    first_token_time: float | None = None
    #: draft tokens proposed for the next step (speculative decoding): set by the engine after
    #: a step, verified by the next one if the scheduler takes them; never part of token_ids
    spec_token_ids: list[int] = field(default_factory=list)
    #: structured output (engine/grammar_manager.py): False while the sequence's grammar
    #: compiles. The engine sets it; a scheduler computes such a sequence's prompt but not the
    #: chunk that ends it (that chunk samples, and sampling needs the grammar)
    grammar_ready: bool = True
    #: structured output: the length of `token_ids` at which the grammar completed (the engine
    #: sets it when a step's tokens finish the grammar); `stop_status` stops the sequence there
    grammar_end: int | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def stop_status(self, token: int) -> RequestStatus | None:
        """The final status that `token`, just appended, gives this sequence, or None.

        The rules every scheduler applies: a completed grammar stops it (`grammar_end`); past `min_tokens`, an EOS id (unless ignore_eos)
        or a stop token id (kept as `stop_reason`) stops it; `max_tokens` ends it. Stop
        strings are the output processor's: they need the text.
        """
        params = self.sampling_params
        if self.grammar_end is not None and self.num_tokens >= self.grammar_end:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing but EOS may follow
        if self.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
