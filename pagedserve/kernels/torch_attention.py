"""Paged attention in plain torch: the reference backend, and the one CPU workers run.

Decodes are batched: their cached K/V are gathered by one index into a padded
[num_decodes, max_len, kv_heads, head_dim] view and attended with one masked SDPA call.
Prefill chunks with no cached context use the fresh K/V directly (grouped by length, one
causal SDPA per group); chunks that continue a context gather it and use an offset mask.

A quantized cache (int8 rows with their scale, or fp8_e4m3; kernels/reference_ops.py) is
written through `kv_store_ref` and dequantized where it is read. Fresh prefill chunks attend
to their K/V quantized and dequantized too, exactly what a later step (or a prefix hit)
reads back from the cache, so a cached prefix computes what recomputing it would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.common.contracts import AttentionBackend, AttentionMetadata
from pagedserve.kernels.reference_ops import dequantize_kv_rows, kv_store_ref, quantize_kv_rows


@dataclass(slots=True)
class _PrefillGroup:
    """Prefill chunks attended by one SDPA call."""

    token_index: torch.Tensor | None  # [n * q_len] rows of the batch, None if one contiguous span
    start: int  # first row when contiguous (the n chunks one after another from there)
    num_seqs: int
    q_len: int
    context_slots: torch.Tensor | None  # [ctx_len] cache slots, for a chunk with cached context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True where attention is allowed


@dataclass(slots=True)
class _TorchPlan:
    decode_blocks: torch.Tensor | None  # [num_decodes * max_blocks] int64 block ids
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefill_groups: list[_PrefillGroup]


#: Reference KV store: cache slot slot_mapping[i] ← key[i], value[i].
write_kv = kv_store_ref


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    quantized_kv = True  # int8 and fp8 rows, through reference_ops (the C++ kernel: int8; see cpu_attention.py)

    def prepare(self, metadata: AttentionMetadata, block_size: int, gather_decodes: bool = True) -> None:
        device = metadata.slot_mapping.device
        nd = metadata.num_decodes
        decode_blocks = decode_mask = None
        if nd and gather_decodes:
            # Whole blocks are gathered (one memcpy each), the tail of the last one masked.
            max_blocks = -(-max(metadata.seq_lens_cpu[:nd]) // block_size)
            decode_blocks = metadata.block_tables[:nd, :max_blocks].flatten().long()
            pos = torch.arange(max_blocks * block_size, device=device)
            decode_mask = (pos[None, :] < metadata.seq_lens[:nd, None])[:, None, None, :]
        groups: list[_PrefillGroup] = []
        fresh: dict[int, list[int]] = {}  # q_len → starts of chunks with no cached context
        start = nd
        for i in range(nd, len(metadata.query_lens_cpu)):
            q_len, seq_len = metadata.query_lens_cpu[i], metadata.seq_lens_cpu[i]
            if seq_len == q_len:
                fresh.setdefault(q_len, []).append(start)
            else:
                pos = torch.arange(seq_len, device=device)
                table = metadata.block_tables[i, : -(-seq_len // block_size)].long()
                slots = table[pos // block_size] * block_size + pos % block_size
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = pos[None, :] <= q_pos[:, None]
                groups.append(_PrefillGroup(None, start, 1, q_len, slots, mask))
            start += q_len
        for q_len, starts in fresh.items():
            if starts[-1] - starts[0] == (len(starts) - 1) * q_len:  # back to back: views, no gather
                groups.append(_PrefillGroup(None, starts[0], len(starts), q_len, None, None))
                continue
            index = (torch.tensor(starts, device=device)[:, None] + torch.arange(q_len, device=device)).flatten()
            groups.append(_PrefillGroup(index, 0, len(starts), q_len, None, None))
        metadata.backend_state = _TorchPlan(decode_blocks, decode_mask, groups)

    def store(self, key, value, kv_cache, metadata):
        """Store the step's K/V at their slots; returns the K/V fresh prefill chunks attend to:
        as given, or from a quantized cache, as its rows read back (dequantized)."""
        if kv_cache.dtype == key.dtype:
            write_kv(key, value, kv_cache, metadata.slot_mapping)
            return key, value
        # quantized once: the rows stored, and the values attended by fresh prefills
        key_rows, value_rows = quantize_kv_rows(key, kv_cache.dtype), quantize_kv_rows(value, kv_cache.dtype)
        write_kv(key_rows, value_rows, kv_cache, metadata.slot_mapping)
        if not metadata.backend_state.prefill_groups:
            return key, value  # decodes only: they read the cache
        head_dim = key.shape[-1]
        return dequantize_kv_rows(key_rows, head_dim, key.dtype), dequantize_kv_rows(value_rows, head_dim, key.dtype)

    def forward(self, query, key, value, kv_cache, metadata, scale):
        key, value = self.store(key, value, kv_cache, metadata)
        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self.attend_decodes(query[:nd], kv_cache, metadata, scale)
        self.attend_prefills(query, key, value, kv_cache, metadata, scale, out)
        return out

    def attend_decodes(self, query, kv_cache, metadata, scale):
        """query [nd, heads, head_dim] of the one-token decodes → [nd, heads, head_dim]."""
        plan: _TorchPlan = metadata.backend_state
        nd, head_dim = query.shape[0], query.shape[2]
        num_kv_heads, width = kv_cache.shape[3], kv_cache.shape[4]
        # [nd, heads, 1, head_dim] against [nd, kv_heads, max_blocks * block_size, head_dim]
        k = kv_cache[0].index_select(0, plan.decode_blocks).view(nd, -1, num_kv_heads, width)
        v = kv_cache[1].index_select(0, plan.decode_blocks).view(nd, -1, num_kv_heads, width)
        if kv_cache.dtype != query.dtype:
            k, v = dequantize_kv_rows(k, head_dim, query.dtype), dequantize_kv_rows(v, head_dim, query.dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        o = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)


    def attend_prefills(self, query, key, value, kv_cache, metadata, scale: float, out: torch.Tensor) -> None:
        """Causal attention of every prefill chunk, written into its rows of `out`: one SDPA
        call per group of the plan that `prepare` made."""
        attend_prefill_groups(query, key, value, kv_cache, metadata.backend_state, scale, out)


def attend_prefill_groups(query, key, value, kv_cache, plan: _TorchPlan, scale: float, out: torch.Tensor) -> None:
    """Causal attention of every prefill chunk, written into its rows of `out`."""
    num_kv_heads, head_dim, width = key.shape[1], key.shape[2], kv_cache.shape[4]
    k_flat = kv_cache[0].view(-1, num_kv_heads, width)
    v_flat = kv_cache[1].view(-1, num_kv_heads, width)
    quantized = kv_cache.dtype != query.dtype
    for g in plan.prefill_groups:
        if g.context_slots is None:  # n fresh chunks of q_len rows: back to back (views) or gathered
            rows = slice(g.start, g.start + g.num_seqs * g.q_len) if g.token_index is None else g.token_index
            shape = (g.num_seqs, g.q_len)
            q = query[rows].view(*shape, -1, head_dim).transpose(1, 2)  # [n, heads, q_len, head_dim]
            k = key[rows].view(*shape, num_kv_heads, head_dim).transpose(1, 2)
            v = value[rows].view(*shape, num_kv_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out[rows] = o.transpose(1, 2).reshape(-1, query.shape[1], head_dim)
        else:  # one chunk after its cached context
            rows = slice(g.start, g.start + g.q_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
            k, v = k_flat[g.context_slots], v_flat[g.context_slots]
            if quantized:
                k, v = dequantize_kv_rows(k, head_dim, query.dtype), dequantize_kv_rows(v, head_dim, query.dtype)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
