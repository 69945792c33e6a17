"""The grammar in the step: masks before the sampler, matchers advance after it.

`ModelRunner.sample` calls `mask_logits` before the sampler plugin and `advance` after it,
only when some sequence has a grammar (`StructuredOutputManager.states`): a step without a
structured row does no work here.

- **Masks.** Each structured row that samples gets one row of the manager's preallocated
  bitmask: plain rows are filled together by the backend (in parallel), and the k + 1 rows of
  a verification one after another, each after the drafts before it (the matcher accepts
  them for the fill and rolls them back). `apply_bitmask` turns every disallowed id's logit
  to -inf, so penalties, temperature and top-k/p see constrained logits.
- **Forced tokens.** When the grammar allows one continuation only (`forced_tokens()`), that
  is the step's token, whatever was sampled: with `structured_output_jump_forward` every
  forced token is appended in this step (the next step computes their K/V), else the first
  one alone, so the ids are the same either way. After a sampled token, jump-forward also
  appends the tokens forced from there. A request that wants logprobs never takes forced
  tokens (they have no sampled logprobs): it samples every token under the mask.
- **Advance, fail closed.** Each matcher accepts its sequence's new tokens; a token it
  rejects, or a matcher error, fails the request (no token of that step is appended). A
  completed grammar sets `Request.grammar_end`: the scheduler stops the sequence there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.common.contracts import GrammarMatcher, SampledLogprobs, ScheduledRequest
from pagedserve.engine.grammar_manager import GrammarState, StructuredOutputManager


@dataclass(slots=True)
class GrammarStep:
    """One step's structured entries (by index in `SchedulerOutput.scheduled`)."""

    states: dict[int, GrammarState] = field(default_factory=dict)
    forced: dict[int, list[int]] = field(default_factory=dict)  # entries whose token the grammar forces
    failed: set[int] = field(default_factory=set)


def mask_logits(manager: StructuredOutputManager, logits: torch.Tensor, entries: list[ScheduledRequest],
                sample_entries: list[int]) -> GrammarStep | None:
    """Mask the structured rows of `logits` in place; None when no row is structured."""
    states = manager.states
    step: GrammarStep | None = None
    batch_rows: list[tuple[GrammarMatcher, int]] = []  # (matcher, bitmask row), filled together
    logit_rows: list[int] = []  # bitmask row b masks logits row logit_rows[b]
    row_entries: list[int] = []  # and belongs to entry row_entries[b]
    r = 0
    while r < len(sample_entries):
        i = sample_entries[r]
        entry = entries[i]
        num_rows = 1 + len(entry.spec_token_ids)
        state = states.get(entry.request.request_id)
        if state is None:
            r += num_rows
            continue
        if step is None:
            step = GrammarStep()
        step.states[i] = state
        matcher = state.matcher
        forced = matcher.forced_tokens() if state.jump_forward else []
        if forced:  # the sample is not used: no mask
            step.forced[i] = forced
        elif num_rows == 1:
            batch_rows.append((matcher, len(logit_rows)))
            logit_rows.append(r)
            row_entries.append(i)
        else:
            _fill_verification(manager, matcher, entry.spec_token_ids, r, logit_rows)
            row_entries += [i] * num_rows
        r += num_rows
    if step is None or not logit_rows:
        return step
    bitmask = manager.bitmask
    backend = manager.backend
    if batch_rows:
        backend.fill_bitmasks(batch_rows, bitmask)
    for i, state in step.states.items():
        if state.matcher.error:
            step.failed.add(i)
            manager.fail(entries[i].request, f"structured_outputs: {state.matcher.error}")
    if step.failed:  # a failed row's tokens are dropped: let it sample anything rather than nothing
        for b, i in enumerate(row_entries):
            if i in step.failed:
                bitmask[b] = -1
    backend.apply_bitmask(logits, bitmask, logit_rows)
    return step


def _fill_verification(manager: StructuredOutputManager, matcher: GrammarMatcher, drafts: list[int], first_row: int,
                       logit_rows: list[int]) -> None:
    """Rows first_row .. first_row + k: row j masked as after drafts[:j]. Past a draft the
    grammar rejects, rows repeat the last mask (their samples are discarded by `verify`)."""
    bitmask = manager.bitmask
    valid = matcher.count_valid(drafts)
    accepted = 0
    for j in range(len(drafts) + 1):
        row = len(logit_rows)
        logit_rows.append(first_row + j)
        if j <= valid:
            matcher.fill_bitmask(bitmask, row)
            if j < valid and matcher.accept_tokens([drafts[j]]):
                accepted += 1
        else:
            bitmask[row] = bitmask[row - 1]
    matcher.rollback(accepted)


def advance(manager: StructuredOutputManager, step: GrammarStep, entries: list[ScheduledRequest],
            sampled: list[list[int]], logprobs: list[list[SampledLogprobs] | None] | None) -> list[int] | None:
    """Each structured entry's matcher accepts its tokens (forced ones replace the sample, and
    jump-forward appends those forced after it). Returns the forced tokens appended per entry
    beyond one per step (`RunnerOutput.num_forced`), or None if none."""
    jump = manager.jump_forward
    counters = manager.counters
    num_forced: list[int] | None = None
    for i, state in step.states.items():
        request = entries[i].request
        if i in step.failed:
            sampled[i] = []
            continue
        matcher = state.matcher
        forced = step.forced.get(i)
        extra = 0
        if forced:
            tokens = forced if jump else forced[:1]
            counters.num_forced_tokens += len(tokens)
            extra = len(tokens) - 1
        else:
            tokens = sampled[i]
        if not tokens:
            continue
        accepted = _accept(matcher, tokens)
        if accepted < 0:
            _reject(manager, request, matcher, tokens, sampled, logprobs, i)
            continue
        tokens = tokens[:accepted]  # none after the grammar completed (a verification's last sample: EOS)
        if jump and not forced and state.jump_forward and not matcher.is_finished:
            more = matcher.forced_tokens()
            if more:
                if not matcher.accept_tokens(more):
                    _reject(manager, request, matcher, more, sampled, logprobs, i)
                    continue
                tokens = tokens + more
                extra = len(more)
                counters.num_forced_tokens += len(more)
        if extra:
            counters.num_steps_saved += extra
            if num_forced is None:
                num_forced = [0] * len(entries)
            num_forced[i] = extra
        sampled[i] = tokens
        state.num_extra = extra
        state.num_tokens = request.num_tokens + len(tokens)
        if matcher.is_finished:
            request.grammar_end = state.num_tokens
    return num_forced


def _accept(matcher: GrammarMatcher, tokens: list[int]) -> int:
    """Advance over `tokens` up to the one that completes the grammar: how many were taken,
    or -1 if the grammar rejected one."""
    if len(tokens) == 1:
        return 1 if matcher.accept_tokens(tokens) else -1
    for n, token in enumerate(tokens):
        if not matcher.accept_tokens([token]):
            return -1
        if matcher.is_finished:
            return n + 1
    return len(tokens)


def _reject(manager: StructuredOutputManager, request, matcher: GrammarMatcher, tokens: list[int],
            sampled: list[list[int]], logprobs: list[list[SampledLogprobs] | None] | None, i: int) -> None:
    manager.fail(request, f"structured_outputs: the grammar rejected token(s) {tokens}: {matcher.error or 'rejected'}")
    sampled[i] = []
    if logprobs is not None:
        logprobs[i] = None
