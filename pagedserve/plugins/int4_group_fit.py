"""The int4 methods' per-group fit: codes, scale and zero point of each group of a weight.

Round-to-nearest of the group's range, or (`search=True`, the methods' default) a search over
candidate roundings that keeps, per group, the one whose least-squares scale leaves the smallest
squared error, as llama.cpp's quantizers do without an importance matrix. Round-to-nearest is
what every candidate has to beat, so no group gets worse. plugins/int4_quantization.py
documents the layout and the bounds.

Every scale is a float16 value (computed in float32; `Int4Weights` stores it as float16), as
Q4_0's and GPTQ's are, which makes a group-32 layer a tenth smaller than float32 scales would.
Round-to-nearest rounds its scale before it picks the codes, so its bounds hold for the scale
it stores; the search rounds each candidate's least-squares scale and compares the errors at
the rounded scales.
"""

from __future__ import annotations

import torch

#: zero points are stored in sixteenths of a code step: a uint8 z16 means z = z16 / 16 (0..15.9375)
ZERO_STEPS = 16
SYMMETRIC_CODE_ZERO = 8  # the code of 0 in a symmetric group
SYMMETRIC_GROUP_ZERO = SYMMETRIC_CODE_ZERO * ZERO_STEPS  # its stored zero point (128)

#: the symmetric search's candidates: the group's value of largest magnitude m is first rounded
#: as if it were -c steps (c = 8: Q4_0's m / -8; smaller c clip nothing, larger c clamp m to -8)
SYMMETRIC_CANDIDATES = tuple(8.5 - 0.25 * i for i in range(15))  # 8.5, 8.25, ..., 5.0
#: the asymmetric search's candidates: the group's range [lo, hi] shrunk by these ratios (clipping)
ASYMMETRIC_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


#: an asymmetric group takes a zero point in sixteenths only where that fit's squared error is
#: under this fraction of the whole-zero fit's: where its values lie on a 4-bit grid with an
#: offset (a re-quantized 4-bit checkpoint, such as the default model, a dequantized Q4_1). A
#: continuous group keeps a whole zero point, whose grid holds 0: on the default model at group
#: 128 (about 6% less squared error) sixteenths raised perplexity from 1.378x float32 to 1.568x
#: (halves: 1.521x), while at group 32 they lowered it from 1.209x to 1.006x.
FRACTIONAL_ZERO_ERROR = 0.5


FLOAT16_MAX = 65504.0


def float16_values(scale: torch.Tensor) -> torch.Tensor:
    """`scale` rounded to the nearest float16 values (finite: clamped to ±65504), as float32."""
    return scale.float().clamp(-FLOAT16_MAX, FLOAT16_MAX).half().float()


def least_squares_scale(groups: torch.Tensor, levels: torch.Tensor, fallback: torch.Tensor,
                        importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For levels L (q - z, z a multiple of 1/16) of each group: the scale s minimising Σ a·(x - L·s)², rounded
    to float16 (`fallback` where every level is 0), and `gain` at that scale. a: `importance`,
    one weight per input broadcast over the groups (None: 1)."""
    sumlx, suml2 = _sums(groups, levels, importance)
    scale = float16_values(torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), fallback))
    return scale, 2 * scale * sumlx - scale * scale * suml2


def gain(groups: torch.Tensor, levels: torch.Tensor, scale: torch.Tensor,
         importance: torch.Tensor | None = None) -> torch.Tensor:
    """Σ a·x² minus the squared error Σ a·(x - L·s)² of each group at scale s: larger is better."""
    sumlx, suml2 = _sums(groups, levels, importance)
    return 2 * scale * sumlx - scale * scale * suml2


def _sums(groups: torch.Tensor, levels: torch.Tensor, importance: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ a·x·L and Σ a·L² of each group."""
    weighted = levels if importance is None else levels * importance
    return (groups * weighted).sum(dim=2), (levels * weighted).sum(dim=2)


def fit_symmetric(groups: torch.Tensor, search: bool, importance: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scales, zero points uint8) of groups [rows, n, g], zero point 8 (stored
    as 128 sixteenths); the search
    weighs each input's squared error by `importance` [1, n, g] when given."""
    index = groups.abs().argmax(dim=2, keepdim=True)
    extreme = groups.gather(2, index).squeeze(2)
    # a group whose scale is 0 in float16 (|m| under about 2.4e-7) is a group of zeros
    nonzero = float16_values(extreme / -8.0) != 0
    extreme = torch.where(nonzero, extreme, torch.ones_like(extreme))
    best_scale = float16_values(extreme / -8.0)
    best_levels = torch.round(groups / best_scale[:, :, None]).clamp_(-8, 7)
    if search:  # round-to-nearest above is the one to beat
        best_gain = gain(groups, best_levels, best_scale, importance)
        for c in SYMMETRIC_CANDIDATES:
            levels = torch.round(groups * (-c / extreme)[:, :, None]).clamp_(-8, 7)
            scale, candidate = least_squares_scale(groups, levels, best_scale, importance)
            better = candidate > best_gain
            best_gain = torch.where(better, candidate, best_gain)
            best_scale = torch.where(better, scale, best_scale)
            best_levels = torch.where(better[:, :, None], levels, best_levels)
    best_scale = torch.where(nonzero, best_scale, torch.ones_like(best_scale))
    best_levels = torch.where(nonzero[:, :, None], best_levels, torch.zeros_like(best_levels))
    codes = (best_levels + SYMMETRIC_CODE_ZERO).to(torch.uint8)
    return codes, best_scale, torch.full_like(codes[:, :, 0], SYMMETRIC_GROUP_ZERO)


def levels_of(groups: torch.Tensor, scale: torch.Tensor, zero16: torch.Tensor) -> torch.Tensor:
    """The levels q - z of groups [rows, n, g] at their scales and zero points in sixteenths
    [rows, n]: q = clamp(round(w / s + f) + i, 0, 15) for z = i + f (i whole, f the sixteenths
    under 1), so that a whole zero point rounds w / s alone, as GPTQ's and AWQ's do."""
    whole = torch.div(zero16, ZERO_STEPS, rounding_mode="floor")
    fraction = ((zero16 - whole * ZERO_STEPS) / ZERO_STEPS)[:, :, None]
    codes = (torch.round(groups / scale[:, :, None] + fraction) + whole[:, :, None]).clamp_(0, 15)
    return codes - (zero16 / ZERO_STEPS)[:, :, None]  # exact: multiples of 1/16 under 16


def fit_asymmetric(groups: torch.Tensor, search: bool, importance: torch.Tensor | None = None,
                   resolution: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scales, zero points uint8 in sixteenths) of groups [rows, n, g]; the search
    weighs each input's squared error by `importance` [1, n, g] when given. A group's levels
    are q - z16 / 16, its zero point rounded to 1 / `resolution` of a step (16: within 1/32 of
    a step of the range's minimum; 1: whole, as GPTQ's and AWQ's). None: both fits, and the
    sixteenths only where their squared error is under FRACTIONAL_ZERO_ERROR times the whole's."""
    if resolution is not None:
        return _fit_asymmetric(groups, search, importance, resolution)
    whole = _fit_asymmetric(groups, search, importance, 1)
    fine = _fit_asymmetric(groups, search, importance, ZERO_STEPS)
    energy = (groups * groups if importance is None else groups * groups * importance).sum(dim=2)
    errors = [energy - gain(groups, codes.float() - zero.float()[:, :, None] / ZERO_STEPS, scale, importance)
              for codes, scale, zero in (whole, fine)]  # of the codes each fit stores
    use = (errors[1] < FRACTIONAL_ZERO_ERROR * errors[0])
    return (torch.where(use[:, :, None], fine[0], whole[0]), torch.where(use, fine[1], whole[1]),
            torch.where(use, fine[2], whole[2]))


def _fit_asymmetric(groups: torch.Tensor, search: bool, importance: torch.Tensor | None, resolution: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fit_asymmetric at one resolution."""
    if resolution not in (1, 2, 4, 8, ZERO_STEPS):
        raise ValueError(f"a zero point's resolution divides {ZERO_STEPS}, got {resolution}")
    lo0 = groups.amin(dim=2).clamp(max=0.0)
    hi0 = groups.amax(dim=2).clamp(min=0.0)

    def rounded(ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale, zero point in sixteenths, levels) of round-to-nearest over the range shrunk
        by `ratio`."""
        lo, hi = lo0 * ratio, hi0 * ratio
        scale = float16_values((hi - lo) / 15.0)
        scale = torch.where((hi > lo) & (scale > 0), scale, torch.ones_like(hi))
        zero16 = torch.round(-lo * resolution / scale).clamp_(0, 16 * resolution - 1) * (ZERO_STEPS // resolution)
        return scale, zero16, levels_of(groups, scale, zero16)

    best_scale, best_zero, best_levels = rounded(1.0)  # round-to-nearest: the one to beat
    if search:
        best_gain = gain(groups, best_levels, best_scale, importance)
        for ratio in ASYMMETRIC_RATIOS:
            scale, zero, levels = rounded(ratio)
            scale, candidate = least_squares_scale(groups, levels, scale, importance)
            better = candidate > best_gain
            best_gain = torch.where(better, candidate, best_gain)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
            best_levels = torch.where(better[:, :, None], levels, best_levels)
    codes = torch.round(best_levels + (best_zero / ZERO_STEPS)[:, :, None]).to(torch.uint8)
    return codes, best_scale, best_zero.to(torch.uint8)
