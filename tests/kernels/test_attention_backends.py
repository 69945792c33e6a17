"""Attention backends against a dense reference on random inputs, several shapes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.attention_backend import AttentionMetadata
from pagedserve.kernels.cpu_attention import CPUAttentionBackend, cpu_kernels
from pagedserve.kernels.torch_attention import TorchAttentionBackend


def build_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A mixed batch (decodes first) over a shuffled block pool, plus a dense reference."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    total_q = sum(query_lens)
    query = torch.randn(total_q, num_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(total_q, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total_q, num_kv_heads, head_dim, generator=g).to(dtype)
    offset = 0
    for q_len, ctx in zip(query_lens, context_lens):
        n = -(-ctx // block_size)
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        for p in range(ctx - q_len, ctx):
            slots.append(table[p // block_size] * block_size + p % block_size)
        offset += q_len
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    query_start = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=query_start,
        seq_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=block_tables,
        num_decodes=sum(1 for q in query_lens if q == 1), max_seq_len=max(context_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(context_lens),
    )
    return query, key, value, kv_cache, metadata


def dense_reference(query, key, value, kv_cache, metadata, block_size, scale):
    """Straightforward float64 attention per sequence, after the new K/V are stored."""
    kv = kv_cache.clone().double()
    kv[0].view(-1, *kv.shape[3:])[metadata.slot_mapping] = key.double()
    kv[1].view(-1, *kv.shape[3:])[metadata.slot_mapping] = value.double()
    out = torch.empty(query.shape, dtype=torch.float64)
    start = 0
    group = query.shape[1] // key.shape[1]
    for i, (q_len, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        table = metadata.block_tables[i]
        pos = torch.arange(ctx)
        slots = table[pos // block_size].long() * block_size + pos % block_size
        k = kv[0].view(-1, *kv.shape[3:])[slots].repeat_interleave(group, dim=1)  # [ctx, heads, d]
        v = kv[1].view(-1, *kv.shape[3:])[slots].repeat_interleave(group, dim=1)
        q = query[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


SHAPES = [
    # (query lens, context lens, heads, kv heads, head_dim, block size)
    ([1, 1, 1], [5, 33, 16], 4, 4, 16, 16),  # MHA decodes, one exactly a block
    ([1, 1, 7, 20], [40, 3, 7, 50], 6, 2, 32, 16),  # GQA 3: decodes + fresh prefill + chunk with context
    ([1, 1, 1, 1], [100, 17, 64, 1], 8, 1, 64, 32),  # GQA 8, block size 32
    ([5, 5, 5], [5, 5, 5], 3, 1, 16, 16),  # fresh prefills of equal length (grouped)
]
BACKENDS = [TorchAttentionBackend, CPUAttentionBackend]


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}-ctx{s[1]}-h{s[2]}-kv{s[3]}-d{s[4]}-bs{s[5]}")
def test_backend_matches_dense_reference(backend_cls, dtype, shape):
    if backend_cls is CPUAttentionBackend and cpu_kernels() is None:
        pytest.skip("the CPU kernel could not be built here")
    query_lens, context_lens, heads, kv_heads, head_dim, block_size = shape
    query, key, value, kv_cache, metadata = build_batch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    expected = dense_reference(query, key, value, kv_cache, metadata, block_size, scale)
    backend = backend_cls()
    metadata.backend = backend
    backend.prepare(metadata, block_size)
    out = backend.forward(query, key, value, kv_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # the new keys/values were stored at their slots
    stored = kv_cache[0].view(-1, kv_heads, head_dim)[metadata.slot_mapping]
    assert torch.equal(stored, key)
