"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.contracts import KernelOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: KernelOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops  # the worker's kernels (torch or Triton)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [n, hidden] → norm(x), or with a residual: (norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
