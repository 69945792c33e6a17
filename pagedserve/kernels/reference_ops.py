"""The torch references of the Triton kernels in `triton_ops`: the functions the model
computes on every device that does not run the kernels, and what the kernels are tested
against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.common.contracts import KernelOps


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [..., hidden] → norm(x); with a residual: (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [n, 2 * d] (gate then up) → silu(gate) * up, [n, d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_ref(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated (rotate-half layout) by the cos/sin rows of positions."""
    return apply_rotary(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] with cos/sin [n, 1, head_dim] already gathered by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchOps(KernelOps):
    """The element-wise ops in plain torch (the references the Triton kernels are tested against)."""

    name = "torch"

    def rms_norm(self, x, weight, eps, residual=None):
        return rms_norm_ref(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos, sin):
        cos = cos[positions].unsqueeze(1)  # [n, 1, head_dim], gathered once for q and k
        sin = sin[positions].unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [n, d] buffer less than silu_and_mul_ref


# -- quantized KV cache rows -------------------------------------------------------------
# The layout every KV kernel reads and writes (the kernels tell it from the cache's dtype):
#   float (the model's dtype): a row is head_dim values.
#   int8: a row is head_dim int8 values then 4 bytes holding the row's float32 scale
#         (little-endian, read as `row[head_dim:].view(torch.float32)`): value = int8 * scale,
#         scale = max|x| / 127 over the row, int8 = round-half-even(x / scale) (0 where scale is 0).
#   float8_e4m3fn: a row is head_dim fp8 values, no scale; writes saturate to +-448.
# A "row" is one token's K (or V) for one KV head: the cache is
# [2, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype)].

#: bytes of an int8 row's scale, stored after its values
KV_SCALE_BYTES = 4
#: the largest finite float8_e4m3fn value
FP8_E4M3_MAX = 448.0


def kv_row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements in one cache row: head_dim, plus the scale's 4 bytes for int8."""
    if cache_dtype == torch.int8:
        assert head_dim % KV_SCALE_BYTES == 0, "an int8 KV row keeps its float32 scale 4-byte aligned"
        return head_dim + KV_SCALE_BYTES
    return head_dim


def quantize_kv_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] float → cache rows [..., kv_row_width(head_dim, cache_dtype)]."""
    if cache_dtype == torch.int8:
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
        q = torch.where(scale > 0, xf / torch.where(scale > 0, scale, 1.0), 0.0)
        q = q.round().clamp_(-127, 127).to(torch.int8)
        return torch.cat((q, scale.contiguous().view(torch.int8)), dim=-1)
    if cache_dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize_kv_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., width] → values [..., head_dim] in `dtype`."""
    if rows.dtype == torch.int8:
        scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
        return (rows[..., :head_dim].float() * scale).to(dtype)
    return rows.to(dtype)


def kv_store_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, blocks, block_size, kv_heads, width]: slot slot_mapping[i] ← key[i], value[i]
    (quantized to the cache's dtype as above)."""
    _, _, _, num_kv_heads, width = kv_cache.shape
    slots = slot_mapping.long()
    for cache, x in ((kv_cache[0], key), (kv_cache[1], value)):
        rows = x if x.dtype == kv_cache.dtype else quantize_kv_rows(x, kv_cache.dtype)
        flat = cache.view(-1, num_kv_heads, width)
        if kv_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots, rows)
