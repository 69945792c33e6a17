"""What the model runner takes and gives each step.

`ModelInput` is the step's flat batch on the host, built from a `SchedulerOutput`;
`RunnerOutput` is one sampled token per scheduled sequence whose prompt is complete;
`SequenceUpdate` is what the scheduler made of it, for the output processor.
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
    sample_entries: list[int]  # their entries in SchedulerOutput.scheduled


@dataclass(slots=True)
class SampledLogprobs:
    """Log-probabilities at one sampled position (token ids; text is added later)."""

    logprob: float  # of the sampled token
    top_token_ids: list[int]  # the top-N, best first
    top_logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    """One step's sampled tokens, aligned with `SchedulerOutput.scheduled`."""

    sampled_token_ids: list[int | None]  # None: a prefill chunk that did not finish its prompt
    logprobs: list[SampledLogprobs | None] | None  # None when no sequence asked for them


@dataclass(slots=True)
class SequenceUpdate:
    """A sequence's new token, after the scheduler appended it and checked the stops."""

    request: Request  # its status tells whether this token ended it
    new_token_id: int
    logprobs: SampledLogprobs | None = None
