"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    #: run the Triton kernel (set on GPU workers by the engine; same function)
    use_triton = False

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [n, hidden] → norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if self.use_triton:
            from pagedserve.kernels.triton_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        # Same op order as transformers, so float32 runs match it bit for bit.
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
