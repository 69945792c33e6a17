"""What the model runner takes and gives each step.

`ModelInput` is the step's flat batch on the host, built from a `SchedulerOutput`;
`RunnerOutput` is the new tokens of each scheduled sequence whose prompt is complete (one,
or several with speculative decoding); `SequenceUpdate` is what the scheduler made of each
token, for the output processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.common.contracts.request import Request

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True)
class ModelInput:
    """One step's batch, laid out flat: decodes (one token each) first, then prefill chunks."""

    input_ids: list[int]  # [num_tokens]
    positions: np.ndarray  # [num_tokens] int64: each token's position in its sequence
    slots: np.ndarray  # [num_tokens] int64: flat KV cache slot of each token
    query_lens: list[int]  # [num_seqs]: tokens computed per sequence this step
    seq_lens: list[int]  # [num_seqs]: context length after this step
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    sample_rows: list[int]  # rows of the flat batch whose hidden states are sampled
    sample_entries: list[int]  # their entries in SchedulerOutput.scheduled (an entry verifying
    #: k drafts has k + 1 rows, consecutive, in position order)


@dataclass(slots=True)
class SampledLogprobs:
    """Log-probabilities at one sampled position (token ids; text is added later)."""

    logprob: float  # of the sampled token
    top_token_ids: list[int]  # the top-N, best first
    top_logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    """One step's new tokens, aligned with `SchedulerOutput.scheduled`."""

    #: per entry, the tokens to append, in order: [] for a prefill chunk that did not finish
    #: its prompt, one token for a decode, and with speculative decoding the accepted drafts
    #: followed by the target's own next token (so 1 + accepted drafts: the entry's
    #: `spec_token_ids` beyond that were rejected, and their K/V does not count as computed),
    #: then any tokens a grammar forces (`num_forced`)
    sampled_token_ids: list[list[int]]
    #: per entry, one SampledLogprobs per token above (None for an entry that asked for none);
    #: None when no sequence asked for them
    logprobs: list[list[SampledLogprobs] | None] | None
    #: per entry, how many of its tokens, at the end, a grammar forced after the sampled one
    #: (structured output's jump-forward): appended like the others, but their K/V is not
    #: computed yet (the next step computes it); None when no entry has any
    num_forced: list[int] | None = None

    def num_rejected(self, i: int, entry_num_drafts: int) -> int:
        """Drafts of entry `i` the target rejected (their K/V was computed but is not kept)."""
        tokens = self.sampled_token_ids[i]
        forced = self.num_forced[i] if self.num_forced is not None else 0
        return entry_num_drafts - (len(tokens) - 1 - forced) if tokens else 0


@dataclass(slots=True)
class SequenceUpdate:
    """A sequence's new token, after the scheduler appended it and checked the stops."""

    request: Request  # its status after the step
    new_token_id: int
    logprobs: SampledLogprobs | None = None
    ends: bool = False  # this token ended the sequence (request.status says how)
