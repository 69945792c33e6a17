"""Tensor-parallel layers (Megatron's split, as vLLM builds it): each holds one rank's shard
of a weight and loads it from the checkpoint's full tensor.

- `ColumnParallelLinear`: a shard of the output rows of each stacked part (q|k|v, gate|up);
  no communication, the next layer reads the shard.
- `RowParallelLinear`: a shard of the input columns (o_proj, down_proj); the partial
  products are summed over the ranks (all-reduce).
- `VocabParallelEmbedding`: a shard of the vocabulary rows; a rank looks up the tokens it
  holds, zeros for the rest, and the all-reduce completes every row.
- `ParallelLMHead`: the logits of this rank's vocabulary rows, gathered on rank 0.

The matrices live in an inner `nn.Linear` (`.linear`) where there is one, so a quantization
method that replaces linear layers shards int8 weights and their scales the same way: a
row-parallel shard's per-row scale must be the whole row's, which `reduce_row_amax` gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.contracts import ParallelGroup, RowSlice, padded_shard_size


class ColumnParallelLinear(nn.Module):
    """y = x · Wᵀ for this rank's rows of each part of a stacked weight, in part order."""

    def __init__(self, in_features: int, parts: list[RowSlice], bias: bool):
        super().__init__()
        self.parts = parts  # per part (q, k, v or gate, up): the rows of its full weight held here
        self.linear = nn.Linear(in_features, sum(p.size for p in parts), bias=bias)

    def load(self, part: int, leaf: str, full: torch.Tensor) -> None:
        """Copy this rank's rows of part `part` of the full `weight` or `bias`."""
        offset = sum(p.size for p in self.parts[:part])
        rows = self.parts[part]
        target: torch.Tensor = getattr(self.linear, leaf)
        target[offset : offset + rows.size].copy_(full[rows.start : rows.start + rows.size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class RowParallelLinear(nn.Module):
    """y = Σ over ranks of x_shard · W_shardᵀ: this rank holds a slice of the input columns
    (its x is the matching slice, from a column-parallel layer)."""

    def __init__(self, in_features: int, out_features: int, group: ParallelGroup):
        super().__init__()
        self.group = group
        shard = in_features // group.world_size
        self.columns = RowSlice(group.rank * shard, shard)  # the input columns held here
        self.linear = nn.Linear(shard, out_features, bias=False)

    def load(self, part: int, leaf: str, full: torch.Tensor) -> None:
        start, size = self.columns.start, self.columns.size
        getattr(self.linear, leaf).copy_(full[:, start : start + size])

    def reduce_row_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """Each output row's max |weight| over every rank's columns, from this shard's."""
        return self.group.all_reduce_max(amax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's slice of the (padded) vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        per_rank = padded_shard_size(vocab_size, group.world_size)
        self.rows = RowSlice(group.rank * per_rank, per_rank)  # token ids held here (padding past vocab_size)
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size), requires_grad=False)

    def load(self, part: int, leaf: str, full: torch.Tensor) -> None:
        held = max(0, min(self.rows.size, self.vocab_size - self.rows.start))
        self.weight[:held].copy_(full[self.rows.start : self.rows.start + held])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.rows.start
        here = (local >= 0) & (local < self.rows.size)
        hidden = F.embedding(torch.where(here, local, 0), self.weight)
        return self.group.all_reduce(hidden * here.unsqueeze(-1).to(hidden.dtype))


class ParallelLMHead(nn.Module):
    """float32 logits: each rank multiplies its vocabulary rows, rank 0 gathers them all."""

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        per_rank = padded_shard_size(vocab_size, group.world_size)
        self.rows = RowSlice(group.rank * per_rank, per_rank)
        self.tied = tied  # the embedding whose rows serve as the head, else None
        self.weight = None if tied is not None else nn.Parameter(torch.zeros(per_rank, hidden_size),
                                                                 requires_grad=False)

    def load(self, part: int, leaf: str, full: torch.Tensor) -> None:
        assert self.weight is not None, "a tied head loads nothing"
        held = max(0, min(self.rows.size, self.vocab_size - self.rows.start))
        self.weight[:held].copy_(full[self.rows.start : self.rows.start + held])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied.weight if self.tied is not None else self.weight
        assert weight is not None
        logits = self.group.gather_last_dim(F.linear(hidden, weight).float())
        return logits[..., : self.vocab_size] if self.group.rank == 0 else logits
