"""Random paged batches and a dense float64 reference, for the attention backend tests."""

from __future__ import annotations

import torch

from pagedserve.common.contracts import AttentionMetadata


def build_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A mixed batch (decodes first) over a shuffled block pool, plus a dense reference."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    total_q = sum(query_lens)
    query = torch.randn(total_q, num_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(total_q, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total_q, num_kv_heads, head_dim, generator=g).to(dtype)
    for ctx in context_lens:
        tables.append([perm.pop() for _ in range(-(-ctx // block_size))])
    metadata = AttentionMetadata.for_batch(query_lens, context_lens, tables, block_size)
    return query, key, value, kv_cache, metadata


def metadata_in_order(query_lens, seq_lens, block_size, device="cpu") -> AttentionMetadata:
    """Metadata whose block tables number the blocks in order, sequence after sequence: the
    first sequence holds the same blocks in any batch it leads (batch-invariance checks)."""
    tables, first = [], 0
    for length in seq_lens:
        tables.append(list(range(first, first + -(-length // block_size))))
        first += len(tables[-1])
    return AttentionMetadata.for_batch(query_lens, seq_lens, tables, block_size, device)


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
