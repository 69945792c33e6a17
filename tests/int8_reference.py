"""The numbers of the int8 × int8 kernels (kernels/csrc/cpu_int8_gemv.cpp, cpu_packed_int8.cpp)
computed in torch: activations quantized per block of 32 as llama.cpp's Q8_0, products in double."""

from __future__ import annotations

import torch

#: the activation block of the int8 × int8 kernels (kernels/csrc/cpu_int8_gemv.cpp): one scale per 32 values
ACT_BLOCK = 32


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, d) of float32 rows x [m, k] as the int8 × int8 kernels quantize them, both [m, k]: per block
    of 32 values of a row, d = max|x| / 127 and q = round(x · 127 / max|x|) (to nearest even;
    0 for an all-zero block), so |q·d - x| <= d/2 (up to float32 rounding)."""
    m, k = x.shape
    blocks = -(-k // ACT_BLOCK)
    padded = torch.zeros(m, blocks * ACT_BLOCK)
    padded[:, :k] = x
    amax = padded.view(m, blocks, ACT_BLOCK).abs().amax(dim=2, keepdim=True)
    # a tensor over a tensor: one correctly rounded division, as the kernels' 127.f / amax (a
    # Python number over a tensor is computed as reciprocal(amax) * 127, one ulp off at times)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(padded.view(m, blocks, ACT_BLOCK) * inverse)
    d = (amax / 127.0).expand(m, blocks, ACT_BLOCK)
    return q.reshape(m, -1)[:, :k], d.reshape(m, -1)[:, :k]


def int8_int8_linear_ref(x, q, scale, bias=None) -> torch.Tensor:
    """What the int8 × int8 kernels compute, in double precision: Σ_k (q_x·d)[r, k] · q[o, k] · scale[o]."""
    qx, d = quantize_activations_ref(x)
    y = (qx.double() * d.double()) @ q.double().T * scale.double()
    return y if bias is None else y + bias.double()


def assert_equals_the_reference(y, x, q, scale, bias=None) -> None:
    """y equals int8_int8_linear_ref to float32 rounding: within 1e-5 of Σ_k |x·w| (+ 1e-6)."""
    slack = 1e-5 * (x.double().abs() @ (q.double().abs() * scale.double()[:, None]).T) + 1e-6
    error = (y.double() - int8_int8_linear_ref(x, q, scale, bias)).abs()
    assert bool((error <= slack).all()), float((error - slack).max())
