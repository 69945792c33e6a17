"""The torch references of the Triton kernels in `triton_ops`: the functions the model
computes on every device that does not run the kernels, and what the kernels are tested
against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def kv_store_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, blocks, block_size, kv_heads, head_dim]: slot slot_mapping[i] ← key[i], value[i]."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), value)
