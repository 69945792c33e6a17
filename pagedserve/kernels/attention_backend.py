"""The attention interface every backend implements (torch, C++ on CPU, Triton on GPU).

The batch of one engine step is flat: the tokens of every scheduled request laid end to
end, decodes (one token each) first, then prefill chunks. `AttentionMetadata` describes
that layout once per step; every layer reuses it.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and which cached K/V each query attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot (block * block_size + offset)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's queries
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (padding entries are 0)
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_seq_len: int  # max(seq_lens)
    #: host copies, so backends plan without device syncs
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    backend: AttentionBackend | None = None  # computes attention in every layer this step
    backend_state: Any = None  # whatever the backend precomputed once for all layers

    @classmethod
    def for_batch(cls, query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int,
                  device="cpu", width: int | None = None) -> AttentionMetadata:
        """The metadata of a batch given each sequence's block table, for checks, benchmarks and
        tests (the engine builds its own from the scheduler's arrays): the new tokens' slots,
        the query offsets, and the tables padded with 0 to `width` (default: the longest)."""
        width = width or max(len(t) for t in tables)
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, q, s in zip(tables, query_lens, seq_lens) for p in range(s - q, s)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            num_decodes=sum(1 for q in query_lens if q == 1), max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
        )


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache for a mixed prefill/decode batch."""

    name: str = ""

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Precompute per-step state (index maps, masks) shared by every layer."""
        metadata.backend_state = None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value at metadata.slot_mapping, then attend causally over each context."""


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: Triton on CUDA; on CPU the C++ decode kernel when it builds, else the torch
    reference. `triton` on CPU only runs under TRITON_INTERPRET=1 (for tests)."""
    from pagedserve.kernels.torch_attention import TorchAttentionBackend

    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from pagedserve.kernels import triton_ops

        if triton_ops.triton is None:
            if name == "triton":
                raise RuntimeError("the triton attention backend needs triton installed")
            return TorchAttentionBackend()
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 to test it on CPU)")
        from pagedserve.kernels.triton_attention import TritonAttentionBackend, self_check

        if name == "auto":
            # The default must not fail on a GPU or Triton version the kernels were never
            # compiled for: they are checked once against the torch reference.
            problem = self_check(device)
            if problem is not None:
                logger.warning("Triton kernels failed their self-check (%s); using the torch backend", problem)
                return TorchAttentionBackend()
        return TritonAttentionBackend()
    if name in ("auto", "cpu") and device.type == "cpu":
        from pagedserve.kernels.cpu_attention import CPUAttentionBackend, cpu_kernels

        if cpu_kernels() is not None:
            return CPUAttentionBackend()
        if name == "cpu":
            raise RuntimeError("the CPU attention kernel could not be built (see the log)")
    if name in ("auto", "cpu"):
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; known: auto, torch, cpu, triton")
