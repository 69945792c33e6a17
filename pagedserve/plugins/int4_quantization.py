"""`int4`: weight-only 4-bit quantization with one scale (and zero point) per group of inputs.

Four methods of the `pagedserve.quantization` group, one per layout option (a quantization
plugin is built with no arguments, so the options are in the name):

    int4             group 32, symmetric (as llama.cpp's Q4_0)
    int4_g128        group 128, symmetric
    int4_asym        group 32, asymmetric: a zero point per group
    int4_g128_asym   group 128, asymmetric

At load time every `nn.Linear` of the model (the LM head only with `quantize_lm_head`)
becomes an `Int4Linear`. Its layout (`Int4Weights`), for a float weight w [out, in]:
- the inputs are padded with zeros to `padded_in` = in rounded up to the group size, and cut
  into groups of `group_size` consecutive inputs of one output row;
- each group has a scale s, stored as float16 (Q4_0's and GPTQ's: 4.5 bits a weight at group 32;
  every kernel widens it exactly), a zero point in sixteenths of a step (a uint8 z16, z = z16 / 16;
  8 when symmetric, not stored), and each weight a 4-bit code q (0..15): w ≈ (q - z16 / 16)·s.
  The kernels' sums stay exact integers (16·Σ q·x - z16·Σ x), the scale divided by 16; a whole
  zero point (16·z: GPTQ's, AWQ's, symmetric) gives the bits that subtracting z did;
- round-to-nearest (`quantize(..., search=False)`): symmetric: s = m / -8, m the group's value
  of largest magnitude (code 0, as Q4_0), q = clamp(round(w / s) + 8, 0, 15): the error is at
  most s/2, at most s for values within s/2 of -m (clamped to 15); asymmetric: lo = min(w, 0),
  hi = max(w, 0), s = (hi - lo) / 15, z16 = round(-16·lo / s) (`resolution=16`; 1: 16·round(-lo / s)),
  q = clamp(round(w / s + z16 / 16), 0, 15): at most s/2 unclamped, s clamped. By default each
  asymmetric group takes the sixteenths only where they halve the error (int4_group_fit.py);
- the scale search (`search=True`, what the methods run), per group, for a few candidate
  roundings: symmetric, the levels L = clamp(round(-c·w / m), -8, 7) for c in
  `SYMMETRIC_CANDIDATES` (8.5 down to 5 in steps of 0.25; c = 8 is the round-to-nearest
  above, a smaller c a coarser step that leaves levels unused); asymmetric, the round-to-nearest
  levels of [lo, hi] shrunk by each of `ASYMMETRIC_RATIOS` (1 down to 0.7: clipping). For each
  candidate's levels L (q - z) the least-squares scale s = Σ w·L / Σ L²; the candidate with the
  smallest squared error Σ (w - L·s)² wins. The
  round-to-nearest levels are among the candidates, so a group's squared error is never
  larger than round-to-nearest's (llama.cpp's quantizers search scales the same way, without
  an importance matrix). No bound of s/2 holds per value any more: the search trades a few
  clipped values for a finer step on the rest;
- the codes are packed two per byte, 16 bytes per 32 inputs: byte i of a block of 32 holds
  input i in its low nibble and input i + 16 in its high nibble (Q4_0's order, which the
  SIMD kernels unpack with one mask and one shift into the 32 codes in order).

A group of all zeros gets scale 1 (its codes are the zero point). GPTQ, AWQ and compressed-tensors
checkpoints are repacked into the same layout (plugins/int4_checkpoint.py).

`Int4Linear.forward` on CPU float32 runs the C++ int4 × int8 kernel (`int4_linear`,
kernels/csrc/cpu_int4_gemv.cpp: activations in int8 per 32, as Q4_0 × Q8_0) up to
`int4_kernel_max_rows()` rows, on CUDA the Triton w4a16 GEMM (`w4a16_linear`,
kernels/triton_int4.py), each when the worker has registered it, and otherwise dequantizes
for `F.linear`. The fused CPU decode step calls the same C++ kernel on the same codes, scales
and zero points (`LlamaForCausalLM.decoder_weights`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.contracts import (
    Calibration,
    LayerInputs,
    QuantizationPlugin,
    QuantizationReport,
)
from pagedserve.plugins.int4_gptq import gptq_fit, gptq_passes
from pagedserve.plugins.int4_group_fit import (  # noqa: F401 - the search's candidates, re-exported
    ASYMMETRIC_RATIOS,
    SYMMETRIC_CANDIDATES,
    SYMMETRIC_GROUP_ZERO,
    ZERO_STEPS,
    fit_asymmetric,
    fit_symmetric,
)

BLOCK = 32  # inputs per packed block (16 bytes); every group size is a multiple of it
GROUP_SIZES = (32, 128)  # the group sizes of the built-in methods; any multiple of BLOCK loads
SYMMETRIC_ZERO = SYMMETRIC_GROUP_ZERO  # the stored zero point of a symmetric group (8 in sixteenths: 128)
#: `Int4Linear.forward` runs the C++ kernel up to this many rows when the extension does not
#: say (`int4_kernel_max_rows`), and dequantizes for F.linear above it
INT4_KERNEL_MAX_ROWS = 16
#: Devices on which `Int4Linear.forward` calls the registered Triton `w4a16_linear`
TRITON_GEMM_DEVICES = ("cuda",)


def _cpu_op(name: str) -> Any:
    """The `pagedserve` operator of that name, if the worker has registered it (the plugin
    may not import pagedserve.kernels)."""
    return getattr(torch.ops.pagedserve, name, None) if hasattr(torch.ops, "pagedserve") else None


def int4_kernel_max_rows() -> int:
    """Up to how many rows `Int4Linear.forward` runs the extension's kernel."""
    op = _cpu_op("int4_kernel_max_rows")
    return int(op()) if op is not None else INT4_KERNEL_MAX_ROWS


@dataclass(frozen=True, slots=True)
class Int4Weights:
    """One linear layer's weight in the int4 layout (see the module docstring)."""

    qweight: torch.Tensor  # uint8 [out, padded_in / 2]: two 4-bit codes a byte, Q4_0's order per 32 inputs
    scales: torch.Tensor  # float16 [out, padded_in / group_size]: each group's scale
    zeros: torch.Tensor | None  # uint8 [out, padded_in / group_size]: each group's zero point in sixteenths; None: 8 (symmetric)
    group_size: int  # inputs per scale: a multiple of 32
    in_features: int  # the unpadded input width (the padding's codes multiply zero activations)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, k] (0..15, k a multiple of 32) → uint8 [out, k / 2] in Q4_0's order."""
    out, k = q.shape
    blocks = q.reshape(out, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, k // 2)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes`: uint8 [out, k / 2] → uint8 codes [out, k]."""
    out, half = packed.shape
    blocks = packed.reshape(out, half // (BLOCK // 2), BLOCK // 2)
    return torch.stack([blocks & 15, blocks >> 4], dim=2).reshape(out, 2 * half)


#: rows quantized at a time (the search's temporaries stay a few MB)
_ROWS_AT_A_TIME = 256


def quantize(weight: torch.Tensor, group_size: int = 32, symmetric: bool = True, search: bool = True,
             importance: torch.Tensor | None = None, resolution: int | None = None) -> Int4Weights:
    """The int4 layout of a float weight [out, in] (module docstring: the rules and bounds).
    `search` False: round-to-nearest, True (the methods'): the scale search, each input's squared
    error weighed by `importance` [in] when given (an importance matrix's diagonal).
    `resolution`: steps per code of asymmetric zero points (16, 1; None: `fit_asymmetric` picks)."""
    if group_size <= 0 or group_size % BLOCK:
        raise ValueError(f"int4 group size must be a positive multiple of {BLOCK}, got {group_size}")
    w = weight.detach().float()
    out, k = w.shape
    padded = -(-k // group_size) * group_size
    groups = F.pad(w, (0, padded - k)).reshape(out, padded // group_size, group_size)
    fit = fit_symmetric if symmetric else functools.partial(fit_asymmetric, resolution=resolution)
    if importance is None and not symmetric and padded > k:  # the padding weighs 0: a fractional
        importance = torch.ones(k, device=w.device)  # zero point would leave its 0 between two codes
    if importance is not None:
        importance = F.pad(importance.float().to(w.device), (0, padded - k)).reshape(1, padded // group_size, group_size)
    parts = [fit(groups[r : r + _ROWS_AT_A_TIME], search, importance) for r in range(0, out, _ROWS_AT_A_TIME)]
    codes = torch.cat([p[0] for p in parts]).reshape(out, padded)
    scale = torch.cat([p[1] for p in parts]).contiguous()
    zero = torch.cat([p[2] for p in parts])
    return Int4Weights(qweight=pack_codes(codes), scales=scale.half(),  # float16 values already: exact
                       zeros=None if symmetric else zero.contiguous(),
                       group_size=group_size, in_features=k)


def dequantize(weights: Int4Weights, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [out, in] of an int4 layout."""
    codes = unpack_codes(weights.qweight).float()
    out, padded = codes.shape
    g = weights.group_size
    zero = (weights.zeros.float() if weights.zeros is not None
            else torch.full_like(weights.scales, SYMMETRIC_ZERO, dtype=torch.float32)) / ZERO_STEPS
    w = (codes.reshape(out, padded // g, g) - zero[:, :, None]) * weights.scales.float()[:, :, None]
    return w.reshape(out, padded)[:, : weights.in_features].to(dtype)


class Int4Linear(nn.Module):
    """y = x · dequantize(weights)ᵀ + bias, with int4 weight groups and float activations.

    It has no `weight` attribute on purpose: the kernels that read a linear's `weight` and
    per-row `weight_scale` (contracts/quantization.py, the fused decode step) must not take
    packed codes for int8 rows."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features = weights.in_features
        self.out_features = weights.qweight.shape[0]
        self.group_size = weights.group_size
        self.dtype = dtype  # the activations' (the model's) dtype
        self.register_buffer("qweight", weights.qweight.contiguous())
        if weights.scales.dtype != torch.float16:  # never rounded here: the fits and loaders give float16
            raise TypeError(f"int4 scales are float16, not {weights.scales.dtype}")
        self.register_buffer("scales", weights.scales.contiguous())
        self.register_buffer("zeros", None if weights.zeros is None else weights.zeros.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, symmetric: bool) -> Int4Linear:
        return cls(_quantized_on(linear.weight, group_size, symmetric), linear.bias, linear.weight.dtype)

    @property
    def weights(self) -> Int4Weights:
        return Int4Weights(self.qweight, self.scales, self.zeros, self.group_size, self.in_features)

    def quantized_bytes(self) -> int:
        """The packed codes, scales and zero points, in bytes."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        linear = _cpu_op("int4_linear") if x2.device.type == "cpu" and x2.dtype == torch.float32 else None
        gemm = _cpu_op("w4a16_linear") if x2.device.type in TRITON_GEMM_DEVICES else None
        if gemm is not None:
            y = gemm(x2, self.qweight, self.scales, self.zeros, self.bias, self.group_size)
        elif linear is not None and x2.shape[0] <= int4_kernel_max_rows():
            y = linear(x2.contiguous(), self.qweight, self.scales, self.zeros, self.bias, self.group_size)
        else:
            y = F.linear(x2, dequantize(self.weights, x2.dtype), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "symmetric" if self.zeros is None else "zero points"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int4 group {self.group_size} {kind}")


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class Int4Quantization(QuantizationPlugin):
    """The built-in `int4` method: group 32, symmetric (entry point `pagedserve.quantization: int4`).
    With an `imatrix` calibration the scale search weighs each input by its Σ x² over the
    calibration tokens (one pass of the float model); with `gptq` each layer's codes are fitted
    by GPTQ (int4_gptq.py) to its inputs, a few layers a pass (`gptq_passes`), each pass run with
    the layers before it already int4."""

    name = "int4"
    group_size = 32
    symmetric = True
    calibration_methods = ("gptq", "imatrix")

    def quantize(self, model: Any, *, quantize_lm_head: bool = False,
                 calibration: Calibration | None = None) -> QuantizationReport:
        targets = [(name, module) for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"]
        float_bytes = sum(linear.weight.numel() * linear.weight.element_size() for _, linear in targets)
        quantized_bytes = 0
        gptq = calibration is not None and calibration.method == "gptq"
        for chunk in gptq_passes(targets) if gptq else [targets]:
            inputs = calibration.layer_inputs(dict(chunk), full=gptq) if calibration is not None else {}
            for name, linear in chunk:
                new = Int4Linear(_quantized_on(linear.weight, self.group_size, self.symmetric, inputs.get(name)),
                                 linear.bias, linear.weight.dtype)
                quantized_bytes += new.quantized_bytes()
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, new)
        lm_head = False  # the LM head is fitted data-free (the scale search), calibrated or not
        if quantize_lm_head and hasattr(model, "lm_head"):
            head = model.lm_head
            if isinstance(head, nn.Linear):
                float_bytes += head.weight.numel() * head.weight.element_size()
                model.lm_head = Int4Linear.from_linear(head, self.group_size, self.symmetric)
            elif head is None and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
                # tied: the embedding stays float for the lookup, the LM head gets its own int4 copy
                source = model.embed_tokens.weight
                model.lm_head = Int4Linear(_quantized_on(source, self.group_size, self.symmetric), None, source.dtype)
            if isinstance(model.lm_head, Int4Linear):
                quantized_bytes += model.lm_head.quantized_bytes()
                lm_head = True
        return QuantizationReport(method=self.name, num_linear=len(targets), float_bytes=float_bytes,
                                  quantized_bytes=quantized_bytes, model_bytes=_bytes(model), lm_head=lm_head,
                                  calibration=calibration.method if calibration is not None else "none")


def _quantized_on(weight: torch.Tensor, group_size: int, symmetric: bool, inputs: LayerInputs | None = None
                  ) -> Int4Weights:
    """`quantize`, its tensors on the weight's device; with calibration `inputs`: GPTQ from their
    Hessian, or (a diagonal only: `imatrix`) the scale search weighing each input by its Σ x²."""
    k = weight.shape[1]
    if inputs is not None and inputs.hessian is not None:
        codes, scales, zeros = gptq_fit(weight, inputs.hessian, group_size, symmetric)
        return Int4Weights(pack_codes(codes), scales.half(), None if symmetric else zeros, group_size, k)
    w, d = quantize(weight, group_size, symmetric, importance=None if inputs is None else inputs.squares), weight.device
    return Int4Weights(w.qweight.to(d), w.scales.to(d), w.zeros if w.zeros is None else w.zeros.to(d), group_size, k)


class Int4G128Quantization(Int4Quantization):
    """`int4_g128`: group 128, symmetric."""
    name = "int4_g128"
    group_size = 128


class Int4AsymQuantization(Int4Quantization):
    """`int4_asym`: group 32, a zero point per group."""
    name = "int4_asym"
    symmetric = False


class Int4G128AsymQuantization(Int4Quantization):
    """`int4_g128_asym`: group 128, a zero point per group."""

    name = "int4_g128_asym"
    group_size = 128
    symmetric = False
