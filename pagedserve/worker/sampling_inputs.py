"""The sampler's side of a step: per-row settings in (`SamplingMetadata`), per-entry
logprobs out (`SampledLogprobs`). `SamplingInputs` keeps one step's settings for the next
while the rows are the same requests and nothing in them depends on the tokens so far."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.common.contracts import Request, SampledLogprobs, SamplerOutput, SamplingMetadata


def sampling_metadata(requests: Sequence[Request], vocab_size: int, device: torch.device) -> SamplingMetadata:
    """The settings of the rows to sample, one per request; a column every row leaves at its
    default is None, so the sampler skips that stage."""
    params = [r.sampling_params for r in requests]

    def column(values, default, dtype=torch.float32):
        if all(v == default for v in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)

    # a top_k beyond the vocabulary cuts nothing (and would overflow an int64 column)
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    needs_history = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
    needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
    banned = {}
    for row, (r, p) in enumerate(zip(requests, params)):
        if r.num_output_tokens < p.min_tokens:
            stop_ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stop_ids |= r.eos_token_ids
            if stop_ids:
                banned[row] = sorted(stop_ids)
    wants_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=column([p.temperature for p in params], 0.0),
        top_k=column(top_k, vocab_size, torch.long),
        top_p=column([p.top_p for p in params], 1.0),
        min_p=column([p.min_p for p in params], 0.0),
        generators={row: r.generator for row, r in enumerate(requests) if r.generator is not None},
        repetition_penalty=column([p.repetition_penalty for p in params], 1.0),
        presence_penalty=column([p.presence_penalty for p in params], 0.0),
        frequency_penalty=column([p.frequency_penalty for p in params], 0.0),
        prompt_token_ids=[r.prompt_token_ids for r in requests] if needs_prompt else [[] for _ in requests],
        output_token_ids=[r.output_token_ids for r in requests] if needs_history else [[] for _ in requests],
        banned_token_ids=banned,
        max_num_logprobs=max(wants_logprobs) if wants_logprobs else None,
    )


class SamplingInputs:
    """The `SamplingMetadata` of the latest step, reused while it still holds.

    A decode step that only moves every row one position on has the same temperatures,
    top-k/p, generators and logprob counts as the step before: building them again costs
    more than the step's own sampling at batch 1. Settings that change as tokens arrive
    (penalties read the tokens so far; `min_tokens` bans EOS for a while) are rebuilt
    every step, as is any step whose rows are other request objects, in another order.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._requests: list[Request] = []  # the rows the kept metadata was built for (held: no id reuse)
        self._metadata: SamplingMetadata | None = None
        self.num_built = 0  # how often the metadata was built rather than reused

    def for_rows(self, requests: Sequence[Request]) -> SamplingMetadata:
        kept = self._metadata
        if kept is not None and len(requests) == len(self._requests) and \
                all(a is b for a, b in zip(requests, self._requests)):
            return kept
        metadata = sampling_metadata(requests, self.vocab_size, self.device)
        self.num_built += 1
        static = not metadata.banned_token_ids and not any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.min_tokens
            for p in (r.sampling_params for r in requests))
        self._requests, self._metadata = (list(requests), metadata) if static else ([], None)
        return metadata


def sampled_logprobs(result: SamplerOutput, requests: Sequence[Request], sample_entries: Sequence[int],
                     num_entries: int) -> list[SampledLogprobs | None] | None:
    """Per scheduled entry, the logprobs its request asked for (top-N cut to its own N)."""
    if result.logprobs is None:
        return None
    out: list[SampledLogprobs | None] = [None] * num_entries
    sampled_lp = result.logprobs.tolist()
    top_ids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
    top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    for row, (i, request) in enumerate(zip(sample_entries, requests)):
        n = request.sampling_params.logprobs
        if n is None:
            continue
        out[i] = SampledLogprobs(
            sampled_lp[row],
            top_ids[row][:n] if top_ids else [],
            top_lp[row][:n] if top_lp else [],
        )
    return out
