"""The sampler's side of a step: per-row settings in (`SamplingMetadata`), per-entry
logprobs out. `SamplingInputs` keeps one step's settings for the next while the rows are the
same requests and nothing in them depends on the tokens so far.

A row is one position of one sequence: a decode samples one row; a step that verifies k
draft tokens samples k + 1 rows of the same sequence, row j as if the first j drafts had
been appended (its penalties count them, `min_tokens` counts them, and a seeded row draws
the noise of that output position).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.common.contracts import Request, SampledLogprobs, SamplerOutput, SamplingMetadata

_MASK64 = 2**64 - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded sequence's draw at output `position` (splitmix64 of both): the
    token at a position never depends on how many draws came before it."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sampling_metadata(requests: Sequence[Request], vocab_size: int, device: torch.device,
                      drafts: Sequence[Sequence[int]] | None = None) -> SamplingMetadata:
    """The settings of the rows to sample, one per request (`drafts[row]`: the draft tokens
    that row's position comes after); a column every row leaves at its default is None, so
    the sampler skips that stage."""
    params = [r.sampling_params for r in requests]
    ahead = drafts or [()] * len(requests)

    def column(values, default, dtype=torch.float32):
        if all(v == default for v in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)

    # a top_k beyond the vocabulary cuts nothing (and would overflow an int64 column)
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    needs_history = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
    needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
    banned = {}
    generators = {}
    for row, (r, p, d) in enumerate(zip(requests, params, ahead)):
        num_output = r.num_output_tokens + len(d)
        if num_output < p.min_tokens:
            stop_ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stop_ids |= r.eos_token_ids
            if stop_ids:
                banned[row] = sorted(stop_ids)
        if r.seed is not None:
            generators[row] = torch.Generator(device=device).manual_seed(position_seed(r.seed, num_output))
    wants_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=column([p.temperature for p in params], 0.0),
        top_k=column(top_k, vocab_size, torch.long),
        top_p=column([p.top_p for p in params], 1.0),
        min_p=column([p.min_p for p in params], 0.0),
        generators=generators,
        repetition_penalty=column([p.repetition_penalty for p in params], 1.0),
        presence_penalty=column([p.presence_penalty for p in params], 0.0),
        frequency_penalty=column([p.frequency_penalty for p in params], 0.0),
        prompt_token_ids=[r.prompt_token_ids for r in requests] if needs_prompt else [[] for _ in requests],
        output_token_ids=[r.output_token_ids + list(d) for r, d in zip(requests, ahead)] if needs_history
        else [[] for _ in requests],
        banned_token_ids=banned,
        max_num_logprobs=max(wants_logprobs) if wants_logprobs else None,
    )


class SamplingInputs:
    """The `SamplingMetadata` of the latest step, reused while it still holds.

    A decode step that only moves every row one position on has the same temperatures,
    top-k/p and logprob counts as the step before: building them again costs more than the
    step's own sampling at batch 1. Settings that change as tokens arrive (penalties read the
    tokens so far; `min_tokens` bans EOS for a while; a seed draws per position) are rebuilt
    every step, as is any step whose rows are other request objects, in another order, or
    rows that verify drafts.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._requests: list[Request] = []  # the rows the kept metadata was built for (held: no id reuse)
        self._metadata: SamplingMetadata | None = None
        self.num_built = 0  # how often the metadata was built rather than reused

    def for_rows(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None) -> SamplingMetadata:
        kept = self._metadata
        if kept is not None and drafts is None and len(requests) == len(self._requests) and \
                all(a is b for a, b in zip(requests, self._requests)):
            return kept
        metadata = sampling_metadata(requests, self.vocab_size, self.device, drafts)
        self.num_built += 1
        static = drafts is None and not metadata.banned_token_ids and not metadata.generators and not any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.min_tokens
            for p in (r.sampling_params for r in requests))
        self._requests, self._metadata = (list(requests), metadata) if static else ([], None)
        return metadata


def sampled_logprobs(result: SamplerOutput, requests: Sequence[Request], sample_entries: Sequence[int],
                     num_entries: int) -> list[list[SampledLogprobs] | None] | None:
    """Per scheduled entry, the logprobs of each row it sampled (top-N cut to its own N),
    in row order; None for an entry that asked for none."""
    if result.logprobs is None:
        return None
    out: list[list[SampledLogprobs] | None] = [None] * num_entries
    sampled_lp = result.logprobs.tolist()
    top_ids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
    top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    for row, (i, request) in enumerate(zip(sample_entries, requests)):
        n = request.sampling_params.logprobs
        if n is None:
            continue
        entry = out[i]
        if entry is None:
            entry = out[i] = []
        entry.append(SampledLogprobs(
            sampled_lp[row],
            top_ids[row][:n] if top_ids else [],
            top_lp[row][:n] if top_lp else [],
        ))
    return out
