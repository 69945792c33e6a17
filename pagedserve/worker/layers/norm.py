"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.reference_ops import rms_norm_ref


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
        return rms_norm_ref(x, self.weight, self.eps, residual)
