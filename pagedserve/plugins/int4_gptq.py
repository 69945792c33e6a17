"""GPTQ for the int4 methods: one linear layer's int4 codes fitted to its calibration inputs.

Written from the paper (Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers", ICLR 2023). For a layer y = x·Wᵀ with
weight W [out, in] and calibration inputs X [n, in], GPTQ keeps the squared output error
‖X·Wᵀ - X·Qᵀ‖² small by quantizing W one input column at a time and letting the columns not
quantized yet absorb each column's error. The order (`act_order`, `GPTQ_ACT_ORDER`): the
inputs of largest H_jj first, as GPTQ's `desc_act` orders them, with static groups (each
group's scale and zero point fitted to the weights before any column moves), so the groups
stay consecutive inputs, as the layout wants; or the paper's order, 0, 1, 2, ...:

- H = XᵀX (the error's Hessian up to a factor 2), shrunk towards its diagonal, (1 - α)·H +
  α·diag(H) with α = `shrink` (`GPTQ_HESSIAN_SHRINK` for the int4 methods): a few thousand
  calibration tokens estimate the off-diagonal correlations of a layer's inputs loosely, and
  GPTQ fitted to them exactly fits the calibration text more than the text the model will read
  (α = 1 leaves the diagonal: no column moves another, each is rounded to its group's grid);
  then dampened, H + λ·I with λ = `DAMP` × the mean of H's diagonal; an input no calibration
  row reached (H_jj = 0) gets H_jj = 1 and weight 0 (it multiplies nothing the layer was seen
  to get);
- U is the upper Cholesky factor of H⁻¹ (H⁻¹ = UᵀU). Column j quantized to q_j leaves
  e = (w_j - q_j) / U_jj, and every later column k moves by -e·U_jk: the Optimal Brain
  Surgeon update over the columns still free, which U's row j gives for each j in turn
  without re-inverting (the paper's Cholesky form);
- the updates inside a block of `BLOCK_COLUMNS` columns are made column by column, those of
  the block on the columns after it at once (a rank-`BLOCK_COLUMNS` product: "lazy batch");
- group-wise scales: in the paper's order, when column j begins a group, that group's scale and zero point are
  fitted (int4_group_fit.py: round-to-nearest of the range, or the scale search, weighing each
  input by H_jj with `weighted_fit`) to the group's weights as they are then, after the updates of every column before it; each of
  its columns is then rounded to the nearest code of that scale: q = clamp(round(w / s + f) + i, 0, 15)
  for the zero point z = i + f (stored in sixteenths, z16 / 16: i whole, f the fraction).

With H = I (or any diagonal H) U is diagonal, no column moves another, and the codes, scales
and zero points are exactly those of `int4_quantization.quantize` with the same fit. Whether
the error on the calibration inputs is smaller than round-to-nearest's is not guaranteed
column by column (the method is greedy); tests/plugins/test_int4_gptq.py checks it on a layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.plugins.int4_group_fit import (
    ZERO_STEPS,
    fit_asymmetric,
    fit_symmetric,
)

DAMP = 0.01  # λ / mean(diag H): the paper's (and its code's) default dampening
BLOCK_COLUMNS = 128  # columns per lazy-batch block; rounded down to a multiple of the group size
MAX_DAMP_TRIES = 6  # a Hessian not positive definite after dampening gets 10x more, this often
#: each group's scale: True, the data-free methods' scale search (int4_group_fit.py) on the
#: group's updated weights; False, round-to-nearest of its range (the paper's min/max)
GPTQ_SEARCH = True
#: the search weighs each input's squared error by the Hessian's diagonal (Σ x², as `imatrix`):
#: on the default model, group 32, perplexity 35.75 against 39.10 unweighted (docs/performance.md)
GPTQ_WEIGHTED_FIT = True
#: the columns in the order of their inputs' Σ x², largest first, with static groups (the
#: module docstring): on the default model, group 128 with zero points, perplexity 33.92 against
#: 35.18 in the paper's order (4,096 calibration tokens, before the shrink below; docs/performance.md)
GPTQ_ACT_ORDER = True
#: α above: on the default model with 4,096 calibration tokens, group 128 with zero points, perplexity
#: 33.92 at 0 and 33.40 at 0.2 (float32: 31.08); a first form of the same shrink (in float32, before
#: the padding) gave 33.68 at 0.05, 33.32 at 0.2, 33.34 at 0.4, 33.38 at 0.7 (docs/performance.md).
#: The Ledoit-Wolf estimate of α from the tokens' fourth moments came out at 0.0002-0.11 per layer:
#: consecutive tokens are far from independent samples, so it is not used
GPTQ_HESSIAN_SHRINK = 0.2
#: the layers of one calibration pass hold at most this many bytes of Hessians (one [in, in]
#: float32 each, at least one layer a pass); the passes run in the model's order, each with the
#: layers of the passes before it already int4, so a layer is fitted to the inputs it will get
HESSIAN_BYTES_PER_PASS = 64 * 1024**2


def gptq_passes(targets: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    """The (name, linear) targets cut, in order, into the calibration passes above."""
    passes: list[list[tuple[str, Any]]] = []
    held = HESSIAN_BYTES_PER_PASS + 1
    for name, linear in targets:
        size = 4 * linear.in_features**2
        if held + size > HESSIAN_BYTES_PER_PASS:
            passes.append([])
            held = 0
        passes[-1].append((name, linear))
        held += size
    return passes


def _upper_inverse_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor U of (H + λI)⁻¹, in float64, dampening more if it must."""
    h = hessian.double()
    lam = damp * h.diagonal().mean().item()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(MAX_DAMP_TRIES):
        factor, info = torch.linalg.cholesky_ex(h + lam * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            return torch.linalg.cholesky(inverse, upper=True)
        lam *= 10
    raise ValueError("GPTQ: the calibration Hessian is not positive definite even dampened")


@contextmanager
def _column_threads(device: torch.device) -> Iterator[None]:
    """One torch thread on CPU for the column loop: its products are a few thousand values each,
    and a thread pool only adds waiting (a [3072, 576] layer: 0.38 s on one thread, 1.9 s on two
    busy ones); the lazy-batch products, larger, run inside it too."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool,
                  search: bool = True, damp: float = DAMP, weighted_fit: bool = False, act_order: bool = False,
                  shrink: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [out, padded_in], scales [out, groups], zero points uint8 [out, groups], in sixteenths) of
    a float weight [out, in] from its inputs' Hessian [in, in] (Σ xᵀx), the inputs padded with
    zeros to a multiple of `group_size` as `int4_quantization.quantize` pads them. It computes
    in float32 (float64 for a float64 weight: the tests' reference), the scales too.
    `act_order`: the columns in the order of H's diagonal, largest first, each group's scale and
    zero point fitted before any column moves (static groups; the module docstring). `shrink`: α,
    the Hessian's off-diagonal entries taken times 1 - α."""
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    out, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"GPTQ: a Hessian of shape {tuple(hessian.shape)} for a weight of {k} inputs")
    padded = -(-k // group_size) * group_size
    h = torch.zeros(padded, padded, dtype=torch.float64, device=w.device)
    h[:k, :k] = hessian.to(w.device, torch.float64)
    if shrink:  # the off-diagonal entries times 1 - α; the diagonal stays as it is, bit for bit
        diagonal = h.diagonal().clone()
        h.mul_(1 - shrink).diagonal().copy_(diagonal)
    W = F.pad(w, (0, padded - k))  # a fresh tensor: the model's weight is not touched
    dead = h.diagonal() == 0  # the padding, and inputs no calibration row reached
    h[dead, dead] = 1.0
    W[:, dead] = 0.0
    # the fit weighs each input by H_jj (weighted_fit), and the padding, which only meets zero
    # activations, by 0 (as `quantize` does: a fractional zero point leaves 0 between two codes)
    real = (torch.arange(padded, device=w.device) < k).to(w.dtype)
    importance = None
    if weighted_fit or padded > k:
        importance = (h.diagonal().to(w.dtype) * real if weighted_fit else real).reshape(1, padded // group_size,
                                                                                          group_size)

    def fit(part: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, zero points) of the groups [out, n, group_size] that begin at group `group`."""
        weights = None if importance is None else importance[:, group : group + part.shape[1]]
        _, scale, zero = fit_symmetric(part, search, weights) if symmetric else fit_asymmetric(part, search, weights)
        return scale, zero

    codes = torch.empty(out, padded, dtype=torch.uint8, device=w.device)
    scales = torch.empty(out, padded // group_size, dtype=w.dtype, device=w.device)
    zeros = torch.empty(out, padded // group_size, dtype=torch.uint8, device=w.device)
    if act_order:
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        for group in range(padded // group_size):  # one at a time: the fit's temporaries stay small
            scale, zero = fit(W[:, None, group * group_size : (group + 1) * group_size], group)
            scales[:, group], zeros[:, group] = scale[:, 0], zero[:, 0]
        h, W = h[order][:, order], W[:, order]
    else:  # the paper's order; each group fitted when its first column comes
        order = torch.arange(padded, device=w.device)
    columns = order.tolist()
    U = _upper_inverse_factor(h, damp).to(w.dtype)
    # the paper's order fits a group from the block that holds all its columns; act order needs no such block
    block = BLOCK_COLUMNS if act_order else max(BLOCK_COLUMNS // group_size, 1) * group_size
    with _column_threads(w.device):
        for b0 in range(0, padded, block):
            b1 = min(b0 + block, padded)
            Wb = W[:, b0:b1].clone()
            errors = torch.empty_like(Wb)
            Ub = U[b0:b1, b0:b1]
            for j in range(b1 - b0):
                column = columns[b0 + j]
                group = column // group_size
                if not act_order and column % group_size == 0:  # the group's columns are j.. of this block
                    scale, zero = fit(Wb[:, None, j : j + group_size], group)
                    scales[:, group], zeros[:, group] = scale[:, 0], zero[:, 0]
                s, z = scales[:, group], zeros[:, group].to(w.dtype) / ZERO_STEPS  # stored in sixteenths
                whole = torch.floor(z)
                q = torch.round(Wb[:, j] / s + (z - whole)).add_(whole).clamp_(0, 15)
                codes[:, column] = q.to(torch.uint8)
                error = (Wb[:, j] - (q - z) * s) / Ub[j, j]
                Wb[:, j:] -= error[:, None] * Ub[j, j:][None, :]
                errors[:, j] = error
            W[:, b1:] -= errors @ U[b0:b1, b1:]
    return codes, scales, zeros


def gptq_fit(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gptq_quantize` as the int4 methods run it: `GPTQ_SEARCH`, `GPTQ_WEIGHTED_FIT`, `GPTQ_ACT_ORDER`,
    `GPTQ_HESSIAN_SHRINK`."""
    return gptq_quantize(weight, hessian, group_size, symmetric, GPTQ_SEARCH, weighted_fit=GPTQ_WEIGHTED_FIT,
                         act_order=GPTQ_ACT_ORDER, shrink=GPTQ_HESSIAN_SHRINK)
