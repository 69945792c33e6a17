"""`int8`: weight-only int8 quantization with one symmetric scale per output channel.

At load time every `nn.Linear` of the model (the LM head only with `quantize_lm_head`)
becomes an `Int8Linear`: `weight` int8 [out, in] and `weight_scale` float32 [out], with
scale = max|w[o, :]| / 127 and weight = round(w / scale), so each element is off by at
most scale / 2. Activations stay float, except inside the C++ int8 × int8 kernels on x86 CPUs
with AVX2 + FMA, AVX-VNNI or AVX-512 VNNI (kernels/csrc/cpu_int8_gemv.cpp, chosen at run time),
which quantize them to int8 per block of 32 values (as llama.cpp's Q8_0 activations) to
multiply int8 by int8. The fused CPU decode step reads
these tensors directly (kernels/csrc/cpu_decode.cpp); every other step runs
`Int8Linear.forward`, which uses the same C++ kernel through torch's operator registry when
the worker has loaded it, on CUDA the Triton w8a16 GEMM (kernels/triton_int8.py) through the
same registry when the worker has registered it, and plain torch (dequantize, then
`F.linear`) elsewhere.

On a CPU float32 worker the loader then packs each `Int8Linear` (it follows the quantization
contract's layout) into a `PackedInt8Linear` (kernels/cpu_packed.py) unless
`pack_cpu_weights` is off: the same numbers per block of 32, at every row count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.contracts import Calibration, QuantizationPlugin, QuantizationReport

#: `Int8Linear.forward` on CPU float32 runs the int8 kernel of the fused decode step
#: (`torch.ops.pagedserve.int8_linear`, kernels/csrc/cpu_decode.cpp) up to this many rows,
#: and above it dequantizes the weight (`torch.ops.pagedserve.int8_dequantize`) for float32
#: `F.linear`. Measured on the default model's four shapes, one thread (python -m
#: benchmarks/int8_linear.py --threads 1; docs/performance-history.md, "int8 weights"): the int8
#: kernel takes 0.4-0.6x the time of float32 F.linear at M = 1-4 and about the same at
#: M = 16 (qkv+o+gate_up+down: 1.65 ms against 1.77 ms dequantize + F.linear), but it is a
#: blocked GEMV, not a GEMM: at M = 32-1024 it takes 1.1-2x F.linear's time, while the
#: dequantization adds 30-100 us per call, lost in the GEMM from M = 64 on.
#: `aten._weight_int8pack_mm` (torch 2.13 CPU) is not used: it took 10x float32's time at
#: M = 1 (qkv 450 us against 44 us) and grows linearly with M (7.6 ms at M = 16).
#: With an int8 × int8 kernel the extension says so (`int8_kernel_max_rows`: 128 rows with
#: AVX-512 VNNI, 48 with AVX2 or AVX-VNNI).
INT8_KERNEL_MAX_ROWS = 16


def int8_kernel_max_rows() -> int:
    """Up to how many rows `Int8Linear.forward` runs the extension's int8 kernel: what the
    extension answers for its kernel selected now (128 with AVX-512 VNNI, 48 with AVX2 or
    AVX-VNNI, 16 on the float path), else INT8_KERNEL_MAX_ROWS."""
    op = _cpu_op("int8_kernel_max_rows")
    return int(op()) if op is not None else INT8_KERNEL_MAX_ROWS

#: Devices on which `Int8Linear.forward` calls `torch.ops.pagedserve.w8a16_linear` (the
#: Triton w8a16 GEMM, kernels/triton_int8.py) when the worker has registered it.
TRITON_GEMM_DEVICES = ("cuda",)


def _cpu_op(name: str) -> Any:
    """The `pagedserve` operator of that name, if the worker has registered it (the plugin may
    not import pagedserve.kernels): the CPU extension's `int8_*`, which the worker loads for
    a quantized CPU model, or the Triton `w8a16_linear`, registered for the Triton kernels."""
    return getattr(torch.ops.pagedserve, name, None) if hasattr(torch.ops, "pagedserve") else None


def quantize_per_channel(weight: torch.Tensor, reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], float32 scale [out]) of a float weight [out, in]: symmetric,
    one scale per output row, |dequantized - weight| <= scale / 2 per element. An all-zero
    row gets scale 1 (its int8 row is zero). `reduce_amax`: for a shard of the input columns
    (a row-parallel layer), each row's max |w| over the whole row, from this shard's."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [out, in] of an int8 weight and its per-row scales."""
    return (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


class Int8Linear(nn.Module):
    """y = x · (weight · scale)ᵀ + bias, with int8 weight rows and float activations."""

    weight: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        q, scale = quantize_per_channel(weight, reduce_amax)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.dtype = dtype  # the activations' (the model's) dtype
        self.register_buffer("weight", q.to(weight.device))
        self.register_buffer("weight_scale", scale.to(weight.device))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear,
                    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Int8Linear:
        return cls(linear.weight, linear.bias, linear.weight.dtype, reduce_amax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        cpu32 = x2.device.type == "cpu" and x2.dtype == torch.float32
        linear = _cpu_op("int8_linear") if cpu32 else None
        gemm = _cpu_op("w8a16_linear") if x2.device.type in TRITON_GEMM_DEVICES else None
        if gemm is not None:
            y = gemm(x2, self.weight, self.weight_scale, self.bias)
        elif linear is not None and (x2.shape[0] <= INT8_KERNEL_MAX_ROWS or x2.shape[0] <= int8_kernel_max_rows()):
            y = linear(x2.contiguous(), self.weight, self.weight_scale, self.bias)
        else:
            dequant = _cpu_op("int8_dequantize") if cpu32 else None
            weight = (dequant(self.weight, self.weight_scale) if dequant is not None
                      else dequantize(self.weight, self.weight_scale, x2.dtype))
            y = F.linear(x2, weight, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class Int8Quantization(QuantizationPlugin):
    """The built-in `int8` method (entry point `pagedserve.quantization: int8`)."""

    name = "int8"

    def quantize(self, model: Any, *, quantize_lm_head: bool = False,
                 calibration: Calibration | None = None) -> QuantizationReport:
        targets = [(name, module) for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"]
        float_bytes = quantized_bytes = 0
        for name, linear in targets:
            float_bytes += linear.weight.numel() * linear.weight.element_size()
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            # a row-parallel layer holds a shard of each row: its scales are the whole row's
            # (contracts/parallel.py), so every rank's int8 shard is the unsplit layer's
            new = Int8Linear.from_linear(linear, getattr(owner, "reduce_row_amax", None))
            quantized_bytes += new.weight.numel() + new.weight_scale.numel() * 4
            setattr(owner, child, new)
        lm_head = False
        if quantize_lm_head and hasattr(model, "lm_head"):
            head = model.lm_head
            if isinstance(head, nn.Linear):
                source = head.weight
            elif head is None and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
                source = model.embed_tokens.weight  # tied: the embedding stays float for the lookup
            else:
                source = None
            if source is not None:
                new = Int8Linear(source, getattr(head, "bias", None), source.dtype)
                if isinstance(head, nn.Linear):
                    float_bytes += source.numel() * source.element_size()
                quantized_bytes += new.weight.numel() + new.weight_scale.numel() * 4
                model.lm_head = new
                lm_head = True
        return QuantizationReport(method=self.name, num_linear=len(targets), float_bytes=float_bytes,
                                  quantized_bytes=quantized_bytes, model_bytes=_bytes(model), lm_head=lm_head)
