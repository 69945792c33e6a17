"""Each tensor-parallel layer against its dense twin, on odd shapes: N ranks as real
processes over gloo on the CPU (world sizes 2 and 3), and the size checks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pagedserve.common.contracts import (
    RowSlice,
    even_slice,
    kv_head_slice,
    tensor_parallel_sizes_problem,
)
from pagedserve.engine.parallel_group import TorchParallelGroup
from pagedserve.plugins.int8_quantization import Int8Quantization, quantize_per_channel
from pagedserve.plugins.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)

VOCAB, HIDDEN = 23, 9  # 23 splits evenly over neither 2 nor 3 ranks: the last shard is padded


def _dense(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_all(rank: int, store_dir: str) -> None:
    """Three processes (one spawn: starting Python and torch is what costs): the layers over
    3 ranks, then over the first 2."""
    torch.set_num_threads(1)
    _check_layers(rank, 3, f"{store_dir}/three")
    if rank < 2:
        _check_layers(rank, 2, f"{store_dir}/two")


def _check_layers(rank: int, world: int, store_path: str) -> None:
    """Runs in each rank: every layer's output equals the dense computation."""
    store = dist.FileStore(store_path, world)
    group = TorchParallelGroup(store, rank, world, torch.device("cpu"), timeout=20, start_timeout=60)
    q_full, kv_full, k_in = 5 * world, 3 * world, 13
    x = _dense(0, 7, k_in)

    # column-parallel: this rank's rows of each stacked part (q|k|v), bias included
    w_q, w_kv, bias = _dense(1, q_full, k_in), _dense(2, kv_full, k_in), _dense(3, q_full)
    parts = [even_slice(q_full, rank, world), even_slice(kv_full, rank, world)]
    column = ColumnParallelLinear(k_in, parts, bias=True)
    column.linear.bias.data.zero_()
    with torch.no_grad():
        column.load(0, "weight", w_q)
        column.load(1, "weight", w_kv)
        column.load(0, "bias", bias)
    dense_q = x @ w_q.T + bias
    dense_kv = x @ w_kv.T
    q_rows, kv_rows = parts
    expected = torch.cat([dense_q[:, q_rows.start : q_rows.start + q_rows.size],
                          dense_kv[:, kv_rows.start : kv_rows.start + kv_rows.size]], dim=1)
    torch.testing.assert_close(column(x), expected, rtol=1e-5, atol=1e-5)

    # row-parallel: a slice of the input columns, summed over the ranks
    in_full, out = 7 * world, 11
    w_o, x_full = _dense(4, out, in_full), _dense(5, 6, in_full)
    row = RowParallelLinear(in_full, out, group)
    with torch.no_grad():
        row.load(0, "weight", w_o)
    cols = row.columns
    torch.testing.assert_close(row(x_full[:, cols.start : cols.start + cols.size]), x_full @ w_o.T,
                               rtol=1e-5, atol=1e-5)

    # int8: the row-parallel shard keeps the whole row's scales, so its int8 values are the
    # unsplit layer's columns; a column-parallel shard's rows are the unsplit rows
    holder = nn.Module()
    holder.row, holder.column = row, column
    Int8Quantization().quantize(holder)
    q_dense, scale_dense = quantize_per_channel(w_o)
    assert torch.equal(row.linear.weight_scale, scale_dense)
    assert torch.equal(row.linear.weight, q_dense[:, cols.start : cols.start + cols.size])
    q_col, scale_col = quantize_per_channel(w_q)
    assert torch.equal(column.linear.weight_scale[: q_rows.size], scale_col[q_rows.start : q_rows.start + q_rows.size])
    assert torch.equal(column.linear.weight[: q_rows.size], q_col[q_rows.start : q_rows.start + q_rows.size])

    # vocab-parallel embedding: every id, the last (padded) shard's included, exactly
    table = _dense(6, VOCAB, HIDDEN)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, group)
    with torch.no_grad():
        embed.load(0, "weight", table)
    ids = torch.tensor([0, VOCAB - 1, 5, 11, 12, 17, 22, 3])
    assert torch.equal(embed(ids), table[ids])

    # LM heads, own and tied: rank 0 has every logit, float32, the padding cut off
    w_head, hidden = _dense(7, VOCAB, HIDDEN), _dense(8, 4, HIDDEN)
    head = ParallelLMHead(VOCAB, HIDDEN, group)
    with torch.no_grad():
        head.load(0, "weight", w_head)
    tied = ParallelLMHead(VOCAB, HIDDEN, group, tied=embed)
    logits, tied_logits = head(hidden), tied(hidden)
    if rank == 0:
        assert logits.shape == (4, VOCAB) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, hidden @ w_head.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tied_logits, hidden @ table.T, rtol=1e-5, atol=1e-5)
    else:
        assert logits.shape == (4, -(-VOCAB // world))  # its own shard only


def test_parallel_layers_match_their_dense_twins_over_3_and_2_ranks(tmp_path: Path) -> None:
    mp.start_processes(_check_all, args=(str(tmp_path),), nprocs=3, start_method="spawn")


def test_kv_heads_are_split_or_replicated() -> None:
    # 8 query heads, 2 KV heads: 2 ranks split them, 4 ranks share each between two ranks
    assert [kv_head_slice(8, 2, r, 2) for r in range(2)] == [RowSlice(0, 1), RowSlice(1, 1)]
    assert [kv_head_slice(8, 2, r, 4).start for r in range(4)] == [0, 0, 1, 1]
    assert [kv_head_slice(8, 8, r, 4) for r in range(4)] == [RowSlice(2 * r, 2) for r in range(4)]
    # SmolLM2's 9 heads and 3 KV heads over 3 ranks: one KV head each
    assert [kv_head_slice(9, 3, r, 3) for r in range(3)] == [RowSlice(r, 1) for r in range(3)]


def test_sizes_that_do_not_divide_are_refused_naming_those_that_do() -> None:
    assert tensor_parallel_sizes_problem(4, num_heads=8, num_kv_heads=2, intermediate_size=192) is None
    assert tensor_parallel_sizes_problem(3, num_heads=9, num_kv_heads=3, intermediate_size=1536) is None
    assert tensor_parallel_sizes_problem(2, num_heads=9, num_kv_heads=3, intermediate_size=1536) == (
        "tensor_parallel_size 2 does not divide num_attention_heads (9), num_key_value_heads (3), which must "
        "divide it or be divided by it; sizes that work for this model: 1, 3")
    assert tensor_parallel_sizes_problem(4, num_heads=8, num_kv_heads=2, intermediate_size=190) == (
        "tensor_parallel_size 4 does not divide intermediate_size (190); sizes that work for this model: 1, 2")
