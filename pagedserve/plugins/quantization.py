"""`int8`: weight-only int8 quantization with one symmetric scale per output channel.

At load time every `nn.Linear` of the model (the LM head only with `quantize_lm_head`)
becomes an `Int8Linear`: `weight` int8 [out, in] and `weight_scale` float32 [out], with
scale = max|w[o, :]| / 127 and weight = round(w / scale), so each element is off by at
most scale / 2. Activations stay float. The fused CPU decode step reads these tensors
directly (kernels/csrc/cpu_decode.cpp); every other step runs `Int8Linear.forward`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.contracts import QuantizationPlugin, QuantizationReport

#: `Int8Linear.forward` on CPU float32 uses `aten._weight_int8pack_mm` up to this many rows
#: and dequantizes to float32 for `F.linear` above. Measured on the default model's four
#: shapes (python -m pagedserve.bench.int8_linear, 2 EPYC cores, docs/performance.md,
#: "int8 weights"): int8pack reads a quarter of the bytes and wins while the product is
#: bound by the weight reads (small M), but its per-row kernel does not block for the cache
#: like float32 GEMM does, so past a few dozen rows float32 F.linear plus one dequantization
#: per call is faster.
INT8PACK_MAX_ROWS = 32


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], float32 scale [out]) of a float weight [out, in]: symmetric,
    one scale per output row, |dequantized - weight| <= scale / 2 per element. An all-zero
    row gets scale 1 (its int8 row is zero)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        q, scale = quantize_per_channel(weight)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.dtype = dtype  # the activations' (the model's) dtype
        self.register_buffer("weight", q.to(weight.device))
        self.register_buffer("weight_scale", scale.to(weight.device))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu" and x2.dtype == torch.float32 and x2.shape[0] <= INT8PACK_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.weight_scale)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2, dequantize(self.weight, self.weight_scale, x2.dtype), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class Int8Quantization(QuantizationPlugin):
    """The built-in `int8` method (entry point `pagedserve.quantization: int8`)."""

    name = "int8"

    def quantize(self, model: Any, *, quantize_lm_head: bool = False) -> QuantizationReport:
        targets = [(name, module) for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"]
        float_bytes = quantized_bytes = 0
        for name, linear in targets:
            float_bytes += linear.weight.numel() * linear.weight.element_size()
            new = Int8Linear.from_linear(linear)
            quantized_bytes += new.weight.numel() + new.weight_scale.numel() * 4
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
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
