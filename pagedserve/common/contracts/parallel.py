"""Tensor parallelism's contract: the group of ranks one model is split across, and the
size checks a model that opts in shares.

With `--tensor-parallel-size N` one worker is N ranks, each holding a shard of every large
matrix (Megatron's split): the q/k/v and gate/up projections by output rows
(column-parallel), o_proj and down_proj by input columns (row-parallel, then an all-reduce
of the partial sums), the embedding and LM head by vocabulary rows. The engine builds a
`ParallelGroup` for each rank and hands it to the model plugin's factory
(`factory(hf_config, dtype=..., device=..., kernels=..., parallel=group)`); a model opts in
by answering `CausalLMPlugin.tensor_parallel_problem` with None. With N = 1 the factory is
called without `parallel`, as before.

No torch import at run time: tensors appear in annotations only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ParallelGroup(ABC):
    """One rank's view of the ranks a model is split across (the engine's implementation
    runs torch.distributed: gloo on CPU, NCCL on CUDA)."""

    rank: int  # this rank, 0..world_size-1; rank 0 schedules and samples
    world_size: int  # how many ranks hold a shard

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `tensor` over every rank (in place; returns it)."""

    @abstractmethod
    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise max of `tensor` over every rank (in place; returns it)."""

    @abstractmethod
    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """On rank 0, every rank's `tensor` (all of one shape) concatenated along the last
        dimension in rank order; on the other ranks, `tensor` itself (they sample nothing)."""


@dataclass(frozen=True, slots=True)
class RowSlice:
    """Which rows of one part of a full weight a rank holds."""

    start: int  # the first row of the part's full weight held here
    size: int  # how many rows


def even_slice(full: int, rank: int, world_size: int) -> RowSlice:
    """Rank `rank`'s share of `full` rows split evenly (the caller checked divisibility)."""
    size = full // world_size
    return RowSlice(rank * size, size)


def padded_shard_size(full: int, world_size: int) -> int:
    """Rows per rank of a dimension padded up to a multiple of `world_size` (the
    vocabulary: the last rank's padding rows are zero and their logits are cut off)."""
    return -(-full // world_size)


def kv_head_slice(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> RowSlice:
    """The KV heads rank `rank` holds, in heads: its share when there are at least as many
    KV heads as ranks, else the one KV head its query heads read (replicated on
    world_size / num_kv_heads ranks)."""
    if num_kv_heads >= world_size:
        return even_slice(num_kv_heads, rank, world_size)
    first_query_head = rank * (num_heads // world_size)
    return RowSlice(first_query_head // (num_heads // num_kv_heads), 1)


def tensor_parallel_sizes_problem(world_size: int, *, num_heads: int, num_kv_heads: int,
                                  intermediate_size: int) -> str | None:
    """Why a Llama-shaped model cannot be split across `world_size` ranks, naming the sizes
    that would work; None when it can. Query heads and the MLP's intermediate size must
    divide evenly; KV heads too, or (fewer KV heads than ranks) the ranks must divide
    evenly among them. The vocabulary is padded, so any size splits it."""

    def problems(n: int) -> list[str]:
        found = []
        if num_heads % n:
            found.append(f"num_attention_heads ({num_heads})")
        if num_kv_heads % n and n % num_kv_heads:
            found.append(f"num_key_value_heads ({num_kv_heads}), which must divide it or be divided by it")
        if intermediate_size % n:
            found.append(f"intermediate_size ({intermediate_size})")
        return found

    found = problems(world_size)
    if not found:
        return None
    working = [n for n in range(1, num_heads + 1) if not problems(n)]
    return (f"tensor_parallel_size {world_size} does not divide {', '.join(found)}; "
            f"sizes that work for this model: {', '.join(map(str, working))}")
