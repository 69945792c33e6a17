"""The proposer's contract: draft tokens for speculative decoding.

A proposer plugin (entry-point group `pagedserve.proposers`) is built by
`factory(config: EngineConfig)`. After each step the engine asks it for drafts: up to
`max_tokens[i]` tokens that it guesses will follow `requests[i].token_ids`. The next step
verifies them in one forward pass of the target model and keeps the longest prefix the
target's own sampling agrees with, plus one token of its own (engine/speculator.py).

Drafts are point guesses: a proposer returns token ids, not a distribution. Verification
samples the target at every draft position and accepts a draft while it equals that
sample, which reproduces the target's distribution exactly whatever the sampling settings
(the accept/reject rule with q = a point mass; see engine/speculator.py). A proposer only
changes how fast tokens come, never which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedserve.common.contracts.request import Request
from pagedserve.common.contracts.version import API_VERSION


class ProposerPlugin(ABC):
    """Guesses the next tokens of running sequences."""

    API_VERSION = API_VERSION

    @abstractmethod
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        """Per request, at most `max_tokens[i]` draft token ids to follow its `token_ids`
        ([] for none). Called once per step for the sequences that decode next."""

    def finish(self, request_ids: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """These sequences ended or were preempted: drop any state kept for them."""
