"""Rotary position embedding (rotate-half layout), default and llama3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.common.contracts import KernelOps


def rope_parameters(hf_config) -> dict:
    """The rope settings of a transformers config, old (`rope_scaling`) or new style."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as the rope type says."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    raise NotImplementedError(f"rope type {rope_type!r} is not supported yet (default, llama3 are)")


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q and k from a cos/sin table indexed by position."""

    # buffers (register_buffer), [max_positions, head_dim]
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, params: dict, dtype: torch.dtype, ops: KernelOps):
        super().__init__()
        self.ops = ops  # the worker's kernels (torch or Triton)
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [n]; q [n, heads, head_dim], k [n, kv_heads, head_dim] → rotated q, k."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)
