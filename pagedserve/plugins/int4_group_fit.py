"""The int4 methods' per-group fit: codes, scale and zero point of each group of a weight.

Round-to-nearest of the group's range, or (`search=True`, the methods' default) a search over
candidate roundings that keeps, per group, the one whose least-squares scale leaves the smallest
squared error, as llama.cpp's quantizers do without an importance matrix. Round-to-nearest is
one of the candidates, so no group gets worse. plugins/int4_quantization.py documents the
layout and the bounds.
"""

from __future__ import annotations

import torch

SYMMETRIC_GROUP_ZERO = 8  # the zero point of a symmetric group

#: the symmetric search's candidates: the group's value of largest magnitude m is first rounded
#: as if it were -c steps (c = 8: Q4_0's m / -8; smaller c clip nothing, larger c clamp m to -8)
SYMMETRIC_CANDIDATES = tuple(8.5 - 0.25 * i for i in range(15))  # 8.5, 8.25, ..., 5.0
#: the asymmetric search's candidates: the group's range [lo, hi] shrunk by these ratios (clipping)
ASYMMETRIC_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def least_squares_scale(groups: torch.Tensor, levels: torch.Tensor, fallback: torch.Tensor,
                        importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For integer levels L (q - z) of each group: the scale s minimising Σ a·(x - L·s)², and that
    sum's reduction Σ a·x·L · s (larger is better: the error is Σ a·x² minus it); `fallback` where
    every level is 0. a: `importance`, one weight per input broadcast over the groups (None: 1)."""
    weighted = levels if importance is None else levels * importance
    sumlx = (groups * weighted).sum(dim=2)
    suml2 = (levels * weighted).sum(dim=2)
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), fallback)
    return scale, sumlx * scale


def fit_symmetric(groups: torch.Tensor, search: bool, importance: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scales, zero points uint8) of groups [rows, n, g], zero point 8; the search
    weighs each input's squared error by `importance` [1, n, g] when given."""
    index = groups.abs().argmax(dim=2, keepdim=True)
    extreme = groups.gather(2, index).squeeze(2)
    nonzero = extreme != 0
    extreme = torch.where(nonzero, extreme, torch.ones_like(extreme))
    best_scale = extreme / -8.0
    best_levels = torch.round(groups / best_scale[:, :, None]).clamp_(-8, 7)
    if search:
        best_gain = torch.full_like(extreme, -1.0)
        for c in SYMMETRIC_CANDIDATES:
            levels = torch.round(groups * (-c / extreme)[:, :, None]).clamp_(-8, 7)
            scale, gain = least_squares_scale(groups, levels, extreme / -8.0, importance)
            better = gain > best_gain
            best_gain = torch.where(better, gain, best_gain)
            best_scale = torch.where(better, scale, best_scale)
            best_levels = torch.where(better[:, :, None], levels, best_levels)
    best_scale = torch.where(nonzero, best_scale, torch.ones_like(best_scale))
    codes = (best_levels + SYMMETRIC_GROUP_ZERO).to(torch.uint8)
    return codes, best_scale, torch.full_like(codes[:, :, 0], SYMMETRIC_GROUP_ZERO)


def fit_asymmetric(groups: torch.Tensor, search: bool, importance: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scales, zero points uint8) of groups [rows, n, g]; the search weighs each
    input's squared error by `importance` [1, n, g] when given."""
    lo0 = groups.amin(dim=2).clamp(max=0.0)
    hi0 = groups.amax(dim=2).clamp(min=0.0)
    best_error = None
    for ratio in ASYMMETRIC_RATIOS if search else (1.0,):
        lo, hi = lo0 * ratio, hi0 * ratio
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
        zero = torch.round(-lo / scale).clamp_(0, 15)
        levels = (torch.round(groups / scale[:, :, None]) + zero[:, :, None]).clamp_(0, 15) - zero[:, :, None]
        if search:
            scale, _ = least_squares_scale(groups, levels, scale, importance)
        error = (levels * scale[:, :, None] - groups) ** 2
        error = (error if importance is None else error * importance).sum(dim=2)
        if best_error is None:
            best_error, best_scale, best_zero, best_levels = error, scale, zero, levels
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_levels = torch.where(better[:, :, None], levels, best_levels)
    codes = (best_levels + best_zero[:, :, None]).to(torch.uint8)
    return codes, best_scale, best_zero.to(torch.uint8)
