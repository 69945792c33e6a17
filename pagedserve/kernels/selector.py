"""Chooses, once per worker, the kernels its model runs: the attention backend and the
element-wise ops. The choice is passed to the model and the runner; nothing is switched
on modules afterwards.

    auto on CUDA  -> Triton attention and Triton ops (after a self-check against torch)
    auto on CPU   -> the C++ decode-attention kernel and element-wise ops (kernels/cpu_ops.py)
                     when they build, else torch attention and ops
    torch | cpu | triton -> that backend (triton on CPU only under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import logging
import os

import torch

from pagedserve.common.contracts import AttentionBackend, KernelOps, Kernels
from pagedserve.kernels.reference_ops import TorchOps

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "triton")


class TritonOps(KernelOps):
    """The element-wise ops as Triton kernels (kernels/triton_ops.py)."""

    name = "triton"

    def __init__(self) -> None:
        from pagedserve.kernels import triton_ops  # only where Triton was chosen

        self._kernels = triton_ops

    def rms_norm(self, x, weight, eps, residual=None):
        return self._kernels.rms_norm(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos, sin):
        return self._kernels.rotary(positions, q, cos, sin), self._kernels.rotary(positions, k, cos, sin)

    def silu_and_mul(self, x):
        return self._kernels.silu_and_mul(x)


def select_kernels(name: str, device: torch.device) -> Kernels:
    """The kernels for `--attention-backend name` on `device`: Triton attention comes with
    the Triton ops (the whole hot path runs as Triton kernels), the CPU backend with the
    C++ ops of the same extension, the torch backend with the torch ops."""
    attention = select_attention_backend(name, device)
    ops: KernelOps
    if attention.name == "triton":
        ops = TritonOps()
    elif attention.name == "cpu":  # the CPU extension is built: its element-wise ops too
        from pagedserve.kernels.cpu_ops import CPUOps

        ops = CPUOps()
    else:
        ops = TorchOps()
    return Kernels(attention, ops)


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: Triton on CUDA; on CPU the C++ decode kernel when it builds, else the torch
    reference. `triton` on CPU only runs under TRITON_INTERPRET=1 (for tests)."""
    from pagedserve.kernels.torch_attention import TorchAttentionBackend

    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from pagedserve.kernels import triton_ops

        if triton_ops.triton is None:
            if name == "triton":
                raise RuntimeError("the triton attention backend needs triton installed")
            return TorchAttentionBackend()
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 to test it on CPU)")
        from pagedserve.kernels.triton_attention import TritonAttentionBackend, self_check

        if name == "auto":
            # The default must not fail on a GPU or Triton version the kernels were never
            # compiled for: they are checked once against the torch reference.
            problem = self_check(device)
            if problem is not None:
                logger.warning("Triton kernels failed their self-check (%s); using the torch backend", problem)
                return TorchAttentionBackend()
        return TritonAttentionBackend()
    if name in ("auto", "cpu") and device.type == "cpu":
        from pagedserve.kernels.cpu_attention import CPUAttentionBackend, cpu_kernels

        if cpu_kernels() is not None:
            return CPUAttentionBackend()
        if name == "cpu":
            raise RuntimeError("the CPU attention kernel could not be built (see the log)")
    if name in ("auto", "cpu"):
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
