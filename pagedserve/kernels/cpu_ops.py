"""The element-wise ops of a decoder layer on CPU, in C++ (csrc/cpu_decode.cpp).

An eager forward (prefill chunks, mixed steps, `--enforce-eager`) with the torch ops spends
about a dozen aten calls a layer on RMSNorm, rotary and SiLU·mul, each a full pass over its
rows, and as much time there as in its matrix products at a 2048-token step. `CPUOps` runs each
as one threaded pass, through the same row functions as the fused decode step
(kernels/cpu_decode.py), so each of these ops computes a row as that step does. With packed
weights an eager decode step therefore has the fused step's bits (the same products and
attention kernel too); a prefill row's attention is torch's, so only its element-wise ops
and products are shared. float32 only: other dtypes take the torch ops.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.kernels.reference_ops import TorchOps


class CPUOps(TorchOps):
    """RMSNorm (with its residual add), rotary and SiLU·mul of float32 rows in C++; other
    dtypes as TorchOps. Needs the CPU extension (cpu_attention.cpu_kernels)."""

    name = "cpu"

    def __init__(self) -> None:
        kernels = cpu_kernels()
        assert kernels is not None, "the CPU ops need the CPU extension"
        self._kernels = kernels

    def rms_norm(self, x, weight, eps, residual=None):
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or (residual is not None and residual.dtype != torch.float32):
            return super().rms_norm(x, weight, eps, residual)
        out = self._kernels.cpu_rms_norm(x, weight, eps, residual)
        return out[0] if residual is None else (out[0], out[1])

    def rotary(self, positions, q, k, cos, sin):
        if not all(t.dtype == torch.float32 for t in (q, k, cos, sin)):
            return super().rotary(positions, q, k, cos, sin)
        q_out, k_out = self._kernels.cpu_rotary(positions, q, k, cos, sin)
        return q_out, k_out

    def silu_and_mul(self, x):
        if x.dtype != torch.float32 or x.dim() != 2:
            return super().silu_and_mul(x)
        return self._kernels.cpu_silu_and_mul(x)
