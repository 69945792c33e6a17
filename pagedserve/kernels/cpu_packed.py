"""float32 linear layers on CPU over weights packed at load (csrc/cpu_packed_gemm.cpp).

`pack_linears` replaces every float32 `nn.Linear` of a loaded CPU model with a `PackedLinear`
that holds the weight once, cut into panels of 16 output rows stored k-major
([ceil(out / 16), in, 16]), and calls `torch.ops.pagedserve.packed_linear`: the BLAS shape of
a product (16 outputs in the vector lanes, no horizontal sums), with each output one chain
of fused multiply-adds over k. So every row's bits are the same whatever the batch, in the
eager forward (prefill, mixed steps) as in the fused decode step, which reads the same
packed tensors (kernels/cpu_decode.py). The weight is not kept in its [out, in] form as
well: packing costs no memory.

int8 linears (the quantization contract's `weight` int8 [out, in] with `weight_scale` [out])
become `PackedInt8Linear`s: the int8 bytes in panels of 16 output rows for `vpdpbusd`
(csrc/cpu_packed_int8.cpp: [ceil(out / 16), ceil(in / 32) * 8, 16, 4], stored as w + 128),
multiplied by the activations quantized per block of 32 (llama.cpp's Q8_0), at every row
count: decode steps of any batch, prefill and mixed steps. Each output is one exact int32 sum
per block and one chain of FMAs over the blocks, so its bits do not depend on the batch either.

int4 linears (`qweight`: codes two a byte in Q4_0's order, `scales` [out, groups], `zeros`
[out, groups] or None) become `PackedInt4Linear`s in the same panels, two inputs' codes a byte
(csrc/cpu_packed_int8.cpp's int4 section), multiplied the same way at every row count. Their
float16 scales (as Q4_0's and GPTQ's; the int4 layout's own) are regrouped by panel, unchanged.

A tied LM head is the embedding, which the lookup needs as [vocab, hidden]: it stays as it
is in the model, and the fused step packs its own copy (`pack_weight`). Outside the fused
step (--enforce-eager, other attention backends, tensor parallelism) a tied head's logits
still come from torch's `F.linear` on the embedding: those are not batch-invariant.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

PANEL = 16  # output rows per panel (csrc/cpu_packed_gemm.cpp's kPanel)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] → [ceil(out / 16), in, 16], zero-padded."""
    return torch.ops.pagedserve.pack_linear_weight(weight.detach().float().contiguous())


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out, in] weight of a packed one."""
    assert packed.dim() == 3 and packed.shape[2] == PANEL and 0 <= packed.shape[0] * PANEL - out_features < PANEL
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:out_features].contiguous()


class PackedLinear(nn.Module):
    """y = x · Wᵀ (+ bias) for float32 x on CPU, W packed (see the module docstring)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed: torch.Tensor  # [ceil(out / 16), in, 16]; a buffer: no gradients, moves with the module
        self.register_buffer("packed", pack_weight(linear.weight))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagedserve.packed_linear(x, self.packed, self.out_features, self.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight, unpacked into a new tensor (to inspect it; writing to it changes nothing)."""
        return unpack_weight(self.packed, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def unpack_int8_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 [out, in] weight of a packed int8 one."""
    assert packed.dim() == 4 and packed.shape[2:] == (PANEL, 4) and 0 <= packed.shape[0] * PANEL - out_features < PANEL
    rows = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * PANEL, -1)  # [panels·16, in_p]: w + 128
    return (rows[:out_features, :in_features].to(torch.int16) - 128).to(torch.int8)


def _check_width(x: torch.Tensor, in_features: int) -> None:
    if x.shape[-1] != in_features:
        raise ValueError(f"a packed linear of {in_features} inputs got rows of {x.shape[-1]}")


def is_int8_linear(module: nn.Module) -> bool:
    """Whether `module` is a quantized linear of the int8 contract (contracts/quantization.py:
    int8 `weight` [out, in], float32 `weight_scale` [out]) on CPU."""
    weight, scale = getattr(module, "weight", None), getattr(module, "weight_scale", None)
    return (isinstance(weight, torch.Tensor) and isinstance(scale, torch.Tensor) and weight.dtype == torch.int8
            and weight.dim() == 2 and weight.device.type == "cpu" and scale.dtype == torch.float32
            and scale.dim() == 1 and scale.numel() == weight.shape[0] and not hasattr(module, "qweight"))


class PackedInt8Linear(nn.Module):
    """y = (x · Wᵀ) · weight_scale (+ bias) for float32 x on CPU, int8 W packed (see the module
    docstring); the activations are quantized per block of 32 inside the kernel."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        weight, scale = cast(torch.Tensor, linear.weight), cast(torch.Tensor, linear.weight_scale)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.packed: torch.Tensor  # uint8 [ceil(out / 16), ceil(in / 32) * 8, 16, 4]
        self.register_buffer("packed", torch.ops.pagedserve.pack_int8_weight(weight.contiguous()))
        self.weight_scale: torch.Tensor  # float32 [out]
        self.register_buffer("weight_scale", scale.detach().float().contiguous())
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the packed depth is rounded up to 32 inputs: the kernel cannot tell a narrower x itself
        _check_width(x, self.in_features)
        return torch.ops.pagedserve.packed_int8_linear(x, self.packed, self.weight_scale, self.out_features, self.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 [out, in] weight, unpacked into a new tensor (to inspect it; writing to it changes nothing)."""
        return unpack_int8_weight(self.packed, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8 packed"


def is_int4_linear(module: nn.Module) -> bool:
    """Whether `module` is an int4 linear (plugins/int4_quantization.py's layout: uint8
    `qweight` [out, padded_in / 2], float16 `scales` [out, groups], `zeros` or None) on CPU."""
    qweight, scales = getattr(module, "qweight", None), getattr(module, "scales", None)
    return (isinstance(qweight, torch.Tensor) and isinstance(scales, torch.Tensor) and qweight.dtype == torch.uint8
            and qweight.dim() == 2 and qweight.device.type == "cpu" and scales.dtype == torch.float16
            and scales.dim() == 2 and hasattr(module, "group_size"))


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[out, ...] → [ceil(out / 16) · 16, ...], zero-padded."""
    pad = -t.shape[0] % PANEL
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_int4_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [P, padded_in / 8, 16, 4], float16 scales [P, groups, 16], zeros alike or None) of
    an int4 weight in Q4_0's order (byte i of a block of 32 inputs: input i low, input i + 16
    high), from its float16 scales [out, groups] and zero points (uint8, alike) or None."""
    if scales.dtype != torch.float16:
        raise TypeError(f"int4 scales are float16 (plugins/int4_quantization.py's layout), not {scales.dtype}")
    out, padded_in = qweight.shape[0], qweight.shape[1] * 2
    blocks = qweight.view(out, padded_in // 32, 16)
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=2).view(out, padded_in)  # codes in input order
    codes = _panels(codes).view(-1, PANEL, padded_in // 8, 2, 4)  # input 8t + 4h + i
    packed = (codes[:, :, :, 0, :] | (codes[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3).contiguous()

    def by_panel(t: torch.Tensor) -> torch.Tensor:
        return _panels(t).view(-1, PANEL, t.shape[1]).permute(0, 2, 1).contiguous()

    return packed, by_panel(scales), None if zeros is None else by_panel(zeros)


class PackedInt4Linear(nn.Module):
    """y = x · dequantized(W)ᵀ (+ bias) for float32 x on CPU, int4 W packed (see the module
    docstring); the activations are quantized per block of 32 inside the kernel."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        qweight, zeros = cast(torch.Tensor, linear.qweight), cast("torch.Tensor | None", linear.zeros)
        self.out_features, self.in_features = int(qweight.shape[0]), int(cast(int, linear.in_features))
        self.group_size = int(cast(int, linear.group_size))
        codes, scales, zeros = pack_int4_weight(qweight, cast(torch.Tensor, linear.scales), zeros)
        self.packed: torch.Tensor  # uint8 [ceil(out / 16), padded_in / 8, 16, 4]
        self.register_buffer("packed", codes)
        self.scales: torch.Tensor  # float16 [ceil(out / 16), groups, 16]
        self.register_buffer("scales", scales)
        self.zeros: torch.Tensor | None  # uint8 like the scales; None: symmetric (8)
        self.register_buffer("zeros", zeros)
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_width(x, self.in_features)  # the packed depth is rounded up to whole groups
        return torch.ops.pagedserve.packed_int4_linear(x, self.packed, self.scales, self.zeros, self.out_features,
                                                       self.bias)

    def extra_repr(self) -> str:
        kind = "symmetric" if self.zeros is None else "zero points"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int4 group {self.group_size} {kind} packed")


def pack_linears(model: nn.Module) -> int:
    """Replace each float32 `nn.Linear` of `model` (on CPU) with a PackedLinear, each int8
    linear (`is_int8_linear`) with a PackedInt8Linear and each int4 one (`is_int4_linear`) with
    a PackedInt4Linear; returns how many. The CPU extension must be loaded
    (kernels/cpu_attention.cpu_kernels)."""
    # the places first, by name, so that no list holds the replaced linears: each one's float
    # weight is freed as soon as its packed copy takes its place (peak: one layer's weight more)
    places = [(parent_name, name, kind) for parent_name, parent in model.named_modules()
              for name, child in parent.named_children()
              if (kind := _packed_kind(child)) is not None]
    for parent_name, name, kind in places:
        parent = model.get_submodule(parent_name)
        setattr(parent, name, kind(getattr(parent, name)))
    return len(places)


def _packed_kind(module: nn.Module) -> type[nn.Module] | None:
    """The packed module that replaces `module`, or None where it stays as it is."""
    if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
        return PackedLinear
    if is_int8_linear(module):
        return PackedInt8Linear
    return PackedInt4Linear if is_int4_linear(module) else None
