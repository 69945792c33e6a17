"""float32 linear layers on CPU over weights packed at load (csrc/cpu_packed_gemm.cpp).

`pack_linears` replaces every float32 `nn.Linear` of a loaded CPU model with a `PackedLinear`
that holds the weight once, cut into panels of 16 output rows stored k-major
([ceil(out / 16), in, 16]), and calls `torch.ops.pagedserve.packed_linear`: the BLAS shape of
a product (16 outputs in the vector lanes, no horizontal sums), with each output one chain
of fused multiply-adds over k. So every row's bits are the same whatever the batch, in the
eager forward (prefill, mixed steps) as in the fused decode step, which reads the same
packed tensors (kernels/cpu_decode.py). The weight is not kept in its [out, in] form as
well: packing costs no memory.

A tied LM head is the embedding, which the lookup needs as [vocab, hidden]: it stays as it
is in the model, and the fused step packs its own copy (`pack_weight`). Outside the fused
step (--enforce-eager, other attention backends, tensor parallelism) a tied head's logits
still come from torch's `F.linear` on the embedding: those are not batch-invariant.
"""

from __future__ import annotations

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


def pack_linears(model: nn.Module) -> int:
    """Replace each float32 `nn.Linear` of `model` (on CPU) with a PackedLinear; returns how
    many. Quantized linears (not `nn.Linear`) are left as they are. The CPU extension must be
    loaded (kernels/cpu_attention.cpu_kernels)."""
    # the places first, by name, so that no list holds the replaced linears: each one's float
    # weight is freed as soon as its packed copy takes its place (peak: one layer's weight more)
    places = [(parent_name, name) for parent_name, parent in model.named_modules()
              for name, child in parent.named_children()
              if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]
    for parent_name, name in places:
        parent = model.get_submodule(parent_name)
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(places)
