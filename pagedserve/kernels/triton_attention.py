"""Paged attention in Triton: one launch for a mixed batch of prefill chunks and decodes.

Each program takes a tile of up to BLOCK_M query tokens of one sequence and all the query
heads that share one KV head (GQA), so every K/V block is read once for the whole group. It
walks the sequence's block table in tiles of KV_TILE_TOKENS (several blocks gathered at
once) with an online softmax, causal inside the new tokens. For long contexts the KV range
is split across programs (flash-decoding): each split writes a partial result and its
log-sum-exp, and a second kernel combines them. Where a row's KV is cut depends on its own
context only, never on the rest of its batch: each split holds `tokens_per_split` tokens
(the last one fewer), or, for a context longer than `max_splits` such splits, a
`max_splits`-th of it. The new keys and values are stored by slot mapping first
(`triton_ops.kv_store`), so attention reads only the cache.

The cache may be quantized (the layout of `reference_ops.quantize_kv_rows`, told by its
dtype): int8 rows carry their float32 scale after their head_dim values, float8_e4m3fn rows
have none. The store quantizes each new row; attention widens each K/V block to the
query's dtype as it loads it, and multiplies an int8 row's scale into that row's column of
the scores (K) and of the probabilities (V).

On CPU this runs under TRITON_INTERPRET=1 (slow: tests only); the torch backend is the
reference it is tested against.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from pagedserve.common.contracts import AttentionBackend, AttentionMetadata
from pagedserve.kernels import triton_ops

triton = triton_ops.triton
#: Triton's interpreter computes bfloat16 dot products wrongly, so there the operands are
#: widened to float32 first; compiled kernels keep them in the cache's dtype.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if triton is not None:
    import triton.language as tl

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        tile_seq_ptr, tile_start_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        scale, num_tokens, num_heads, num_kv_heads, max_blocks_per_seq, min_blocks_per_split,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_FP32: tl.constexpr,
        DOT_PRECISION: tl.constexpr, KV_INT8: tl.constexpr, ROW_WIDTH: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(tile_seq_ptr + tile)
        tile_start = tl.load(tile_start_ptr + tile)  # first query of this tile, within its sequence
        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + seq)
        context_before = seq_len - q_len  # tokens cached before this step's queries

        # Rows are (query token, head of the group): [BLOCK_M * GROUP_P2]
        rows = tl.arange(0, BLOCK_M * GROUP_P2)
        tok = tile_start + rows // GROUP_P2
        head = kv_head * GROUP + rows % GROUP_P2
        row_ok = (tok < q_len) & (rows % GROUP_P2 < GROUP)
        d = tl.arange(0, HEAD_DIM_P2)
        d_ok = d < HEAD_DIM
        q_rows = (q_begin + tok).to(tl.int64) * num_heads + head
        q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = context_before + tok  # absolute position of each row's query

        # The KV this tile may see ends at its last query; this split takes a share of it.
        kv_end = tl.minimum(seq_len, context_before + tile_start + BLOCK_M)
        num_blocks = tl.cdiv(kv_end, BLOCK_SIZE)
        # A fixed split count (CUDA graphs) leaves short contexts on fewer splits, the rest empty.
        per_split = tl.maximum(tl.cdiv(num_blocks, NUM_SPLITS), min_blocks_per_split)
        block_lo = split * per_split
        block_hi = tl.minimum(block_lo + per_split, num_blocks)

        m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_P2, HEAD_DIM_P2], tl.float32)
        # Each step takes PAGES blocks of the table at once: a KV tile of PAGES * BLOCK_SIZE
        # tokens, gathered row by row from its blocks, so the dots are wide enough to keep the
        # tensor cores busy whatever the block size.
        n = tl.arange(0, PAGES * BLOCK_SIZE)
        slot = n % BLOCK_SIZE
        block_stride = BLOCK_SIZE * num_kv_heads * ROW_WIDTH
        for b in range(block_lo, block_hi, PAGES):
            page = b + n // BLOCK_SIZE  # [PAGES * BLOCK_SIZE]: each row's block in the table
            page_ok = page < block_hi
            block_id = tl.load(block_tables_ptr + seq * max_blocks_per_seq + page, mask=page_ok, other=0).to(tl.int64)
            row_offs = block_id * block_stride + (slot * num_kv_heads + kv_head) * ROW_WIDTH
            offs = row_offs[:, None] + d[None, :]
            kv_ok = page_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + offs, mask=kv_ok, other=0.0)  # [PAGES * BLOCK_SIZE, HEAD_DIM_P2]
            v = tl.load(v_cache_ptr + offs, mask=kv_ok, other=0.0)
            # A quantized cache is widened to the query's dtype (int8 and float8_e4m3fn values
            # are exact in each). An int8 row's float32 scale, after its values, multiplies the
            # row's column of the scores (K) and of the probabilities (V) instead of its
            # head_dim values: [rows, KV tile] products, not [KV tile, HEAD_DIM] ones.
            if KV_INT8:
                k_scale = tl.load((k_cache_ptr + row_offs + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=page_ok,
                                  other=0.0)
                v_scale = tl.load((v_cache_ptr + row_offs + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=page_ok,
                                  other=0.0)
                k = k.to(tl.float32).to(q_ptr.dtype.element_ty)  # through float32: the interpreter
                v = v.to(tl.float32).to(q_ptr.dtype.element_ty)  # converts int8 to bf16 wrongly
            elif k.dtype != q_ptr.dtype.element_ty:
                k = k.to(tl.float32).to(q_ptr.dtype.element_ty)
                v = v.to(tl.float32).to(q_ptr.dtype.element_ty)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale  # [rows, PAGES * BLOCK_SIZE]
            if KV_INT8:
                s = s * k_scale[None, :]
            k_pos = b * BLOCK_SIZE + n
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len) & page_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if KV_INT8:
                pv = tl.dot((p * v_scale[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new

        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        out_offs = q_rows[:, None] * HEAD_DIM + d[None, :]
        store_ok = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=store_ok)
        else:
            part = split.to(tl.int64) * num_tokens * num_heads * HEAD_DIM
            tl.store(part_out_ptr + part + out_offs, out, mask=store_ok)
            lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + split.to(tl.int64) * num_tokens * num_heads + q_rows, lse, mask=row_ok)

    @triton.jit
    def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_tokens, num_heads,
                               HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                               NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # token * num_heads + head
        s = tl.arange(0, SPLITS_P2)
        lse = tl.load(part_lse_ptr + s * num_tokens * num_heads + row, mask=s < NUM_SPLITS, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))  # [SPLITS_P2]
        d = tl.arange(0, HEAD_DIM_P2)
        parts = tl.load(part_out_ptr + (s[:, None] * num_tokens * num_heads + row) * HEAD_DIM + d[None, :],
                        mask=(s[:, None] < NUM_SPLITS) & (d[None, :] < HEAD_DIM), other=0.0)
        total = tl.sum(w, axis=0)  # 0 only for a padding row with no context
        out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(slots=True)
class _TritonPlan:
    """Per-step launch plan, shared by every layer."""

    tile_seq: torch.Tensor  # [num_tiles] int32: the sequence of each query tile
    tile_start: torch.Tensor  # [num_tiles] int32: its first query, within the sequence
    block_m: int  # query tokens per tile
    num_splits: int  # KV splits per tile (flash-decoding when > 1)
    min_blocks_per_split: int = 1  # KV blocks a split takes at least (fewer splits for short contexts)
    decode_only: bool = False  # every sequence has one query: tiles shrink to fill the dot with heads


class TritonAttentionBackend(AttentionBackend):
    """`num_splits=None` picks the split count from the longest context."""

    name = "triton"
    quantized_kv = True  # reads and writes int8 and float8_e4m3fn rows (see the module docstring)

    def __init__(self, num_splits: int | None = None, tokens_per_split: int = 1024, max_splits: int = 16):
        if triton is None:
            raise RuntimeError("the triton backend needs triton installed")
        self.num_splits = num_splits
        self.tokens_per_split = tokens_per_split
        self.max_splits = max_splits

    #: query tokens per tile; tl.dot wants at least 16 rows (a decode's tile holds one token)
    block_m = 16

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        block_m = self.block_m
        seqs, starts = [], []
        for i, q_len in enumerate(metadata.query_lens_cpu):
            for start in range(0, q_len, block_m):
                seqs.append(i)
                starts.append(start)
        device = metadata.slot_mapping.device
        metadata.backend_state = _TritonPlan(torch.tensor(seqs, dtype=torch.int32, device=device),
                                             torch.tensor(starts, dtype=torch.int32, device=device), block_m,
                                             self.splits_for(metadata.max_seq_len),
                                             self.min_blocks_per_split(block_size),
                                             decode_only=all(q == 1 for q in metadata.query_lens_cpu))

    def min_blocks_per_split(self, block_size: int) -> int:
        """The fewest KV blocks a split takes. Without a fixed split count, `tokens_per_split`
        tokens' worth: a row's splits then hold that many tokens each (up to `max_splits`
        of them; a longer context is shared out over `max_splits`), so where its KV is cut
        depends on its own context only, never on the longest one in the batch, which sets
        only how many splits run. With a fixed count (`num_splits`), one block: the row's
        KV is shared out over that many splits, again by its own context alone."""
        return 1 if self.num_splits else -(-self.tokens_per_split // block_size)

    def splits_for(self, max_seq_len: int) -> int:
        return self.num_splits or min(self.max_splits, max(1, -(-max_seq_len // self.tokens_per_split)))

    def decode_plan(self, num_seqs: int, max_model_len: int, block_size: int, device) -> _TritonPlan:
        """A plan for decode-only batches of `num_seqs` rows that holds for any context up to
        `max_model_len`: what a CUDA graph captures. The split count is the one the longest
        context needs; each sequence uses only the splits its own context fills."""
        min_blocks = self.min_blocks_per_split(block_size)
        return _TritonPlan(torch.arange(num_seqs, dtype=torch.int32, device=device),
                           torch.zeros(num_seqs, dtype=torch.int32, device=device), self.block_m,
                           self.splits_for(max_model_len), min_blocks, decode_only=True)

    def forward(self, query, key, value, kv_cache, metadata, scale):
        triton_ops.kv_store(key, value, kv_cache, metadata.slot_mapping)
        return paged_attention(query, kv_cache, metadata, scale, torch.empty_like(query))


#: KV tokens a program takes per step (whole blocks: at least one). Fixed, never chosen by
#: batch: the online softmax's steps are part of a row's arithmetic (batch invariance).
KV_TILE_TOKENS = 64


def _num_warps(rows: int, head_dim_p2: int, element_size: int, arch: int | None) -> int:
    """A tile keeps its queries and its float32 accumulator in registers. From 16 KiB of
    queries (64 rows × 128 dims in bf16, 64 × 64 in fp32) that spills on sm_80 at 4 warps,
    and 8 warps do not (`python -m pagedserve.kernels.triton_aot` shows both); smaller
    tiles, decode tiles among them, keep 4. On sm_90 every tile keeps 4: there the 64 × 128
    bf16 prefill tile ran 1.3-1.6x faster at 4 warps than at 8 (an H100, 4 × 4096 tokens,
    two runs: docs/performance-history.md). `arch`: the compute capability as 80, 90...
    (None off a GPU)."""
    if arch is not None and arch >= 90:
        return 4
    return 8 if rows * head_dim_p2 * element_size >= 16384 else 4


@functools.cache
def _arch(device: torch.device) -> int | None:
    """The compute capability of a CUDA device as 80, 90...; None for any other device."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    """Attention of every query over its sequence's cached K/V (already stored), into `out`.

    query/out [num_tokens, num_heads, head_dim]; `metadata.backend_state` from `prepare`.
    """
    plan: _TritonPlan = metadata.backend_state
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if kv_cache.dtype in triton_ops.QUANTIZED_KV_DTYPES:
        assert kv_cache.shape[4] == triton_ops.kv_row_width(head_dim, kv_cache.dtype), "cache rows of another head_dim"
    else:
        assert kv_cache.shape[4] == head_dim, "cache rows of another head_dim"
    group = num_heads // num_kv_heads
    query = query.contiguous()
    splits = plan.num_splits
    part_out = part_lse = out  # unused when not split
    if splits > 1:
        part_out = torch.empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
    group_p2 = triton.next_power_of_2(group)
    # A tile's rows are BLOCK_M query tokens × the group's heads, and tl.dot wants 16 rows. A
    # decode tile has one real token, so BLOCK_M is only as large as reaching 16 rows needs.
    block_m = max(1, 16 // group_p2) if plan.decode_only else plan.block_m
    head_dim_p2 = max(16, triton.next_power_of_2(head_dim))
    grid = (plan.tile_seq.numel(), num_kv_heads, splits)
    _paged_attention_kernel[grid](
        query, kv_cache[0], kv_cache[1], metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        plan.tile_seq, plan.tile_start, out, part_out, part_lse,
        scale, num_tokens, num_heads, num_kv_heads, metadata.block_tables.shape[1], plan.min_blocks_per_split,
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2,
        BLOCK_M=block_m, BLOCK_SIZE=block_size, PAGES=max(1, KV_TILE_TOKENS // block_size), NUM_SPLITS=splits,
        DOT_FP32=_INTERPRETED,
        # tl.dot rounds float32 operands to tf32 on a GPU unless told otherwise: a float32
        # model gets full float32 attention, as torch's own matmuls give it
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_INT8=kv_cache.dtype == torch.int8, ROW_WIDTH=kv_cache.shape[4],
        num_warps=_num_warps(block_m * group_p2, head_dim_p2, query.element_size(), _arch(query.device)),
    )
    if splits > 1:
        _combine_splits_kernel[(num_tokens * num_heads,)](
            part_out, part_lse, out, num_tokens, num_heads, HEAD_DIM=head_dim,
            HEAD_DIM_P2=triton.next_power_of_2(head_dim), NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
        )
    return out


def self_check(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Run the Triton kernels once on a small mixed batch and compare them with the torch
    reference. Returns None when they agree, else why not (so `auto` can fall back)."""
    from pagedserve.kernels.torch_attention import TorchAttentionBackend

    try:
        g = torch.Generator().manual_seed(0)
        heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
        query_lens, seq_lens = [1, 1, 20], [37, 5, 20]  # two decodes, one fresh prefill
        tables = [[0, 1, 2], [3, 0, 0], [4, 5, 0]]

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(device, dtype)

        n = sum(query_lens)
        query, key, value = rand(n, heads, head_dim), rand(n, kv_heads, head_dim), rand(n, kv_heads, head_dim)
        cache = rand(2, 7, block_size, kv_heads, head_dim)
        outs = []
        for backend in (TorchAttentionBackend(), TritonAttentionBackend(num_splits=2)):
            metadata = AttentionMetadata.for_batch(query_lens, seq_lens, tables, block_size, device)
            backend.prepare(metadata, block_size)
            outs.append(backend.forward(query, key, value, cache.clone(), metadata, head_dim**-0.5).float())
        # an int8 KV cache (every GPU has it): Triton quantizes and dequantizes; the torch
        # backend runs on the same values already dequantized
        from pagedserve.kernels.reference_ops import dequantize_kv_rows, quantize_kv_rows

        def rounded(t):
            return dequantize_kv_rows(quantize_kv_rows(t, torch.int8), head_dim, dtype)

        metadata = AttentionMetadata.for_batch(query_lens, seq_lens, tables, block_size, device)
        torch_backend = TorchAttentionBackend()
        torch_backend.prepare(metadata, block_size)
        want_int8 = torch_backend.forward(query, rounded(key), rounded(value), rounded(cache), metadata, head_dim**-0.5)
        triton_backend = TritonAttentionBackend(num_splits=2)
        triton_backend.prepare(metadata, block_size)
        got_int8 = triton_backend.forward(query, key, value, quantize_kv_rows(cache, torch.int8), metadata,
                                          head_dim**-0.5)
        x, w = rand(5, 96), rand(96)
        checks = {
            "paged attention": (outs[1], outs[0]),
            "paged attention (int8 KV cache)": (got_int8, want_int8),
            "rms_norm": (triton_ops.rms_norm(x, w, 1e-6, x)[0], triton_ops.rms_norm_ref(x, w, 1e-6, x)[0]),
            "silu_and_mul": (triton_ops.silu_and_mul(x), triton_ops.silu_and_mul_ref(x)),
        }
        for name, (got, want) in checks.items():
            if not torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2):
                return f"{name} disagrees with the torch reference"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use these kernels
        return f"{type(exc).__name__}: {exc}"
    return None
