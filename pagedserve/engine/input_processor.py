"""`InputProcessor`: a caller's request in, validated sequences out.

It tokenizes text prompts, checks token ids and the context length, resolves `max_tokens`,
and fans a request out into its n sequences (a seeded request's sequence i draws with seed + i;
siblings share the prompt's KV blocks). A request resumed from another worker starts each sequence
after the tokens the client already has.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.common.contracts import Request
from pagedserve.common.errors import InvalidParameterError, check_context
from pagedserve.common.sampling_params import SamplingParams


@dataclass(slots=True)
class ResumedCompletion:
    """What a client already has of one completion, when its request moves to another worker.

    The engine continues from these tokens (recomputing their KV) instead of starting over,
    so the client sees neither a repeated nor a missing token, sampled or greedy.
    """

    token_ids: list[int]  # generated tokens already sent
    num_chars: int  # characters of text already sent
    finish_reason: str | None = None  # set when this completion had already ended


@dataclass(slots=True)
class NewRequest:
    """A caller's request, validated and fanned out."""

    request_id: str
    prompt: str | None  # the prompt text, when the caller gave text
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Request | None]  # per completion; None: it had ended before a resume
    resume: list[ResumedCompletion] | None  # per completion, when resumed
    arrival_time: float


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_n: int,
                 eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_n = max_n
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                cache_salt: str | None = None, resume: list[ResumedCompletion] | None = None,
                tenant: str | None = None) -> NewRequest:
        """Raises a typed error on bad input (`InvalidParameterError`, `ContextLengthExceededError`)."""
        params.validate(max_n=self.max_n)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, token_id_list(prompt, self.vocab_size, "prompt")
        if params.stop_token_ids:
            token_id_list(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        if not token_ids:
            raise InvalidParameterError("prompt", "the prompt is empty")
        check_context(len(token_ids), self.max_model_len)  # max_tokens beyond the context is clamped
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if resume is not None and len(resume) != params.n:
            raise InvalidParameterError("resume", f"needs one entry per completion ({params.n})")

        sequences: list[Request | None] = []
        first: Request | None = None
        for index in range(params.n):
            prior = resume[index] if resume is not None else None
            if prior is not None and prior.finish_reason is not None:
                sequences.append(None)  # nothing left to generate for this one
                continue
            seed = None if params.seed is None else (params.seed + index) % 2**64  # any int: negative or huge
            seq = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}", prompt_token_ids=token_ids,
                sampling_params=params, eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
                parent_id=request_id, index=index, fork_from=first, seed=seed, cache_salt=cache_salt,
                tenant=tenant,
            )
            if prior is not None:
                # Resumed siblings differ past the prompt: the prefix cache shares what they can.
                seq.fork_from = None
                seq.token_ids.extend(prior.token_ids)
            first = first or seq
            sequences.append(seq)
        assert any(sequences), "every completion had already ended: nothing to resume"
        return NewRequest(request_id, text, token_ids, params, sequences, resume, time.monotonic())


def token_id_list(values: Sequence, vocab_size: int, param: str) -> list[int]:
    """Token ids as plain ints (numpy integers welcome); a typed error if any is not a token."""
    try:
        ids = [operator.index(t) for t in values if not isinstance(t, bool)]
    except TypeError:
        ids = []
    if len(ids) != len(values) or not all(0 <= t < vocab_size for t in ids):
        raise InvalidParameterError(param, f"token ids must be integers in [0, {vocab_size})")
    return ids
