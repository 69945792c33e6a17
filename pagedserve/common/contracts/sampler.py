"""The sampler's contract: a batch of logits and per-row settings in, one token per row out.

A sampler plugin is built by `factory(config: EngineConfig)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.common.contracts.version import API_VERSION

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings of one step, built by the model runner."""

    temperature: torch.Tensor | None  # [B] float32, 0 = greedy; None: every row greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where unset; None: no row sets it
    top_p: torch.Tensor | None  # [B] float32; None: no row sets it
    min_p: torch.Tensor | None  # [B] float32; None: no row sets it
    generators: dict[int, torch.Generator]  # row → its own generator (seeded requests)
    repetition_penalty: torch.Tensor | None  # [B] float32; None: no row sets it
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: list[list[int]]  # per row, for the repetition penalty ([] if unused)
    output_token_ids: list[list[int]]  # per row, for the penalties ([] if unused)
    banned_token_ids: dict[int, list[int]]  # row → ids masked this step (EOS before min_tokens)
    max_num_logprobs: int | None  # largest top-N asked for; None: no row wants logprobs

    @property
    def all_greedy(self) -> bool:
        return self.temperature is None


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log p(sampled token) under the model
    top_logprob_ids: torch.Tensor | None  # [B, max_num_logprobs] int64
    top_logprobs: torch.Tensor | None  # [B, max_num_logprobs] float32


class SamplerPlugin(ABC):
    """Turns float32 logits [B, vocab_size] into one token per row."""

    API_VERSION = API_VERSION

    @abstractmethod
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits`; logprobs when `metadata` asks for them.

        `metadata` is read-only: the runner hands the same object to later steps whose rows
        are the same requests (engine/sampling_inputs.py)."""
