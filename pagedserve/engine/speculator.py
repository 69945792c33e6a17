"""Speculative decoding: drafts proposed after a step, verified by the next one.

    step N:   ... → process outputs → Speculator.propose: request.spec_token_ids = drafts
    step N+1: schedule (1 + drafts tokens for a decoding request) → run: the target computes
              every draft position in one forward pass and samples each (model_runner.sample)
              → verify: keep the drafts while they equal the target's samples, then the
              target's own token → update: the rejected drafts' K/V does not count

Why this is exact. Row j of a verification is sampled from the target's distribution given
the sequence plus drafts[:j], with the sampler's own processing (temperature, top-k/p,
min-p, penalties, min_tokens) and fresh noise (a seeded row draws the noise of its output
position). The output keeps samples[0..a] where a is the first row whose sample differs from
its draft (or all k + 1 rows). Each kept sample is conditioned on exactly the tokens before
it, so the output has the target's distribution, token for token: it is the standard
accept/reject rule for a proposal q that is a point mass on the draft (accept d with
probability p(d), else draw from p with d removed, renormalised), realised by one draw
from p. Greedy rows give exactly greedy decoding; seeded rows give the same tokens as
without speculation.

Adaptivity (`Speculator.propose`): no drafts in a step where more than
`speculative_max_batch` sequences run (verification rows then cost more than they save),
and a sequence whose drafts were mostly rejected pauses proposing for a while (twice as long
each time a try after a pause fails again, up to 16 times `speculative_pause_steps`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.common.contracts import (
    ProposerPlugin,
    Request,
    RequestStatus,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagedserve.common.engine_config import EngineConfig

logger = logging.getLogger(__name__)


def verify(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verification yields: `sampled[j]` was drawn from the target after
    `drafts[:j]` (len(sampled) == len(drafts) + 1). The drafts are kept while each equals the
    target's draw at its position; then comes the target's draw where they first differ
    (or the extra token after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return list(sampled[: accepted + 1])


def draft_prefixes(entries: Sequence[ScheduledRequest], sample_entries: Sequence[int]) -> list[list[int]]:
    """Per sampled row, the drafts its position comes after: [] for a plain row, and
    drafts[:j] for the j-th row of an entry that verifies drafts."""
    seen: dict[int, int] = {}
    out = []
    for i in sample_entries:
        j = seen.get(i, 0)
        seen[i] = j + 1
        out.append(list(entries[i].spec_token_ids[:j]))
    return out


@dataclass(slots=True)
class _Acceptance:
    """A sequence's recent drafts, for pausing proposals that do not pay."""

    rate: float = 1.0  # moving average of the accepted share of its drafts
    num_verified: int = 0  # verifications so far
    paused_steps: int = 0  # steps left without proposals
    num_pauses: int = 0  # pauses in a row (each try after a pause failed again): the next is longer


@dataclass(slots=True)
class SpecDecodeCounters:
    """Totals since the engine started (the worker's metrics read their changes)."""

    num_proposed: int = 0  # draft tokens proposed (a sequence that ends or is preempted first verifies none)
    num_drafts: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, accepted
    num_verifications: int = 0  # sequences' steps that verified drafts
    num_paused: int = 0  # times a sequence paused proposing (low acceptance)
    num_steps_off: int = 0  # steps with no proposals because the batch was too large

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verification (the tokens a step gains over plain decoding)."""
        return self.num_accepted / self.num_verifications if self.num_verifications else 0.0


class Speculator:
    """Proposes each decoding sequence's drafts after a step and counts what the next
    step's verification accepted."""

    #: moving-average weight of the newest verification
    EMA = 0.3
    #: verifications before a sequence's rate is trusted enough to pause it
    MIN_VERIFICATIONS = 3
    #: a sequence paused n times in a row pauses pause_steps · 2^(n-1) steps, at most this many times pause_steps
    MAX_PAUSE_FACTOR = 16

    def __init__(self, config: EngineConfig, proposer: ProposerPlugin, name: str):
        self.proposer = proposer
        self.name = name  # the proposer's plugin name, for the counters
        self.num_tokens = config.speculative_tokens()
        self.max_batch = config.speculative_max_batch
        self.min_acceptance = config.speculative_min_acceptance
        self.pause_steps = config.speculative_pause_steps
        self.counters = SpecDecodeCounters()
        self._acceptance: dict[str, _Acceptance] = {}

    def record(self, scheduled: SchedulerOutput, ran: RunnerOutput) -> tuple[int, int, int]:
        """Count the step's verifications; returns (verifications, drafts verified, drafts accepted)."""
        verifications = drafts = accepted = 0
        for i, entry in enumerate(scheduled.scheduled):
            k = len(entry.spec_token_ids)
            if not k or not ran.sampled_token_ids[i]:
                continue
            a = k - ran.num_rejected(i, k)
            verifications, drafts, accepted = verifications + 1, drafts + k, accepted + a
            state = self._acceptance.setdefault(entry.request.request_id, _Acceptance())
            state.rate += self.EMA * (a / k - state.rate)
            state.num_verified += 1
            if a >= self.min_acceptance * k:
                state.num_pauses = 0  # this one paid: the next pause, if any, starts short again
        self.counters.num_verifications += verifications
        self.counters.num_drafts += drafts
        self.counters.num_accepted += accepted
        return verifications, drafts, accepted

    def propose(self, scheduled: SchedulerOutput, num_running: int) -> None:
        """Set the drafts of every sequence of this step that decodes next; the others'
        are cleared."""
        candidates: list[Request] = []
        ended: list[str] = []
        for entry in scheduled.scheduled:
            request = entry.request
            request.spec_token_ids = []
            if request.is_finished:
                ended.append(request.request_id)
            elif request.status == RequestStatus.RUNNING and request.num_computed_tokens + 1 == request.num_tokens:
                candidates.append(request)  # decodes next
        if ended:
            self.finish(ended)
        if not candidates:
            return
        if num_running > self.max_batch:
            self.counters.num_steps_off += 1
            return
        requests, limits = [], []
        for request in candidates:
            limit = min(self.num_tokens, request.max_tokens - request.num_output_tokens - 1)
            if limit > 0 and not self._paused(request.request_id):
                requests.append(request)
                limits.append(limit)
        if not requests:
            return
        for request, limit, drafts in zip(requests, limits, self.proposer.propose(requests, limits)):
            request.spec_token_ids = list(drafts[:limit])
            self.counters.num_proposed += len(request.spec_token_ids)

    def _paused(self, request_id: str) -> bool:
        """Whether this sequence skips proposing this step (its drafts were mostly rejected)."""
        state = self._acceptance.get(request_id)
        if state is None:
            return False
        if state.paused_steps > 0:
            state.paused_steps -= 1
            if state.paused_steps == 0:
                state.rate, state.num_verified = 1.0, 0  # try again afresh
            return True
        if state.num_verified >= self.MIN_VERIFICATIONS and state.rate < self.min_acceptance:
            state.paused_steps = self.pause_steps * min(1 << state.num_pauses, self.MAX_PAUSE_FACTOR)
            state.num_pauses += 1
            self.counters.num_paused += 1
            return True
        return False

    def finish(self, request_ids: Sequence[str]) -> None:
        """Forget these sequences (aborted or failed outside a step)."""
        for request_id in request_ids:
            self._acceptance.pop(request_id, None)
        self.proposer.finish(request_ids)
