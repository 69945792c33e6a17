"""The int4 methods' layout: quantize → dequantize within its bound on odd shapes, group size
and zero points honoured, codes packed two per byte in Q4_0's order; the scale search picks
the candidate a plain per-group reference picks, and never does worse than round-to-nearest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.plugins.int4_quantization import (
    ASYMMETRIC_RATIOS,
    SYMMETRIC_CANDIDATES,
    Int4AsymQuantization,
    Int4G128Quantization,
    Int4Linear,
    Int4Quantization,
    Int4Weights,
    dequantize,
    int4_kernel_max_rows,
    pack_codes,
    quantize,
    unpack_codes,
)

SHAPES = [(1, 1), (3, 31), (7, 33), (5, 129), (17, 200)]


def _groups(w: torch.Tensor, g: int) -> torch.Tensor:
    out, k = w.shape
    padded = -(-k // g) * g
    return torch.nn.functional.pad(w, (0, padded - k)).reshape(out, padded // g, g)


def test_codes_are_packed_two_a_byte_in_q4_0_order():
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = pack_codes(codes)
    assert packed.shape == (1, 32)
    # byte i of a block of 32: input i low, input i + 16 high
    assert packed[0, 0].item() == 0 | (16 % 16) << 4
    assert packed[0, 3].item() == 3 | (19 % 16) << 4
    assert packed[0, 16].item() == (32 % 16) | (48 % 16) << 4
    assert torch.equal(unpack_codes(packed), codes)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 128])
def test_symmetric_round_to_nearest_within_half_a_step(shape, group_size):
    torch.manual_seed(sum(shape) + group_size)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    q = quantize(w, group_size, symmetric=True, search=False)
    padded = -(-shape[1] // group_size) * group_size
    assert q.qweight.shape == (shape[0], padded // 2) and q.qweight.dtype == torch.uint8
    assert q.scales.shape == (shape[0], padded // group_size) and q.zeros is None
    error = (dequantize(q) - w).abs()
    step = q.scales.float().abs().repeat_interleave(group_size, dim=1)[:, : shape[1]]
    # the group's largest magnitude m is exact (code 0); values within s/2 of -m clamp (<= s)
    extreme = _groups(w, group_size).abs().amax(dim=2).repeat_interleave(group_size, dim=1)[:, : shape[1]]
    clamped = (w * torch.sign(q.scales.repeat_interleave(group_size, dim=1)[:, : shape[1]])) > 7.5 * step
    slack = 1e-6 * extreme
    assert bool((error[~clamped] <= step[~clamped] / 2 + slack[~clamped]).all())
    assert bool((error <= step + slack).all())
    # the extreme value m of each group comes back as -8·s, s = m / -8 rounded to float16: within
    # float16's relative rounding (2^-11) of m
    index = _groups(w, group_size).abs().argmax(dim=2)
    got = _groups(dequantize(q), group_size).gather(2, index[:, :, None]).squeeze(2)
    expected = _groups(w, group_size).gather(2, index[:, :, None]).squeeze(2)
    assert torch.allclose(got, expected, rtol=2**-11 + 1e-6, atol=0)
    assert torch.equal(q.scales, (expected / -8).half())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("resolution", [1, 16])
def test_asymmetric_round_to_nearest_uses_zero_points(shape, group_size, resolution):
    torch.manual_seed(sum(shape) * 3 + group_size)
    w = torch.rand(shape) * 2 + 0.5  # all positive: the zero point is 0, the step (hi - 0) / 15
    w[:, ::5] -= 1.2  # some negative: zero points above 0 in those groups, in sixteenths
    q = quantize(w, group_size, symmetric=False, search=False, resolution=resolution)
    assert q.zeros is not None and q.zeros.dtype == torch.uint8
    assert q.zeros.shape == q.scales.shape == (shape[0], -(-shape[1] // group_size))
    if shape[1] > 1:  # groups with negative values: zero points above 0, fractional ones in sixteenths
        assert bool((q.zeros % 16 != 0).any()) == (resolution == 16)
    groups = _groups(w, group_size)
    lo, hi = groups.amin(2).clamp(max=0), groups.amax(2).clamp(min=0)
    assert torch.equal(q.scales, ((hi - lo) / 15).half())  # the step, rounded to float16
    want = torch.round(-resolution * lo / q.scales.float()) * (16 // resolution)
    assert torch.equal(q.zeros, want.to(torch.uint8))
    step = q.scales.float().repeat_interleave(group_size, dim=1)[:, : shape[1]]
    error = (dequantize(q) - w).abs()
    assert bool((error <= step * (1 + 1e-5)).all())
    zero = q.zeros.float().repeat_interleave(group_size, dim=1)[:, : shape[1]] / 16
    raw = torch.round(w / step + zero - torch.floor(zero)) + torch.floor(zero)
    inside = (raw >= 0) & (raw <= 15)  # not clamped
    assert bool((error[inside] <= step[inside] * (0.5 + 1e-5)).all())


def test_a_group_on_an_offset_grid_gets_its_fractional_zero_point_and_others_whole_ones():
    """Chosen per group: a group whose values are d·q + m (a dequantized Q4_1) gets the zero
    point in sixteenths nearest -m / d and comes back within d / 32; a Gaussian group, whose
    squared error sixteenths barely lower, keeps a whole zero point (its grid holds 0)."""
    torch.manual_seed(3)
    d, m = 0.0125, -0.0125 * 7.3125  # -m / d = 7.3125 = 117 / 16
    on_grid = d * torch.randint(0, 16, (4, 32)).float() + m
    on_grid[:, 0], on_grid[:, 1] = m, m + 15 * d  # both ends of the grid
    gaussian = torch.randn(4, 32) * 0.05
    q = quantize(torch.cat([on_grid, gaussian], dim=1), 32, symmetric=False)
    assert q.zeros[:, 0].tolist() == [117] * 4
    assert bool((q.zeros[:, 1] % 16 == 0).all())
    assert float((dequantize(q)[:, :32] - on_grid).abs().max()) <= d / 32 * (1 + 1e-3)
    for resolution in (1, 16):  # the choice is the better of the two fits where it matters
        forced = quantize(torch.cat([on_grid, gaussian], dim=1), 32, symmetric=False, resolution=resolution)
        assert torch.equal(forced.zeros[:, 1 - resolution // 16], q.zeros[:, 1 - resolution // 16])


def test_asymmetric_is_closer_than_symmetric_on_one_signed_weights():
    torch.manual_seed(1)
    w = torch.rand(8, 96) + 0.1
    for group_size in (32, 128):
        for search in (False, True):
            sym = (dequantize(quantize(w, group_size, True, search)) - w).abs().mean()
            asym = (dequantize(quantize(w, group_size, False, search)) - w).abs().mean()
            assert asym < sym


def _half(v: float) -> float:
    """v rounded to float16 (through float32, as the plugin's float32 tensors are)."""
    return torch.tensor(v, dtype=torch.float32).half().item()


def _searched_group(x: list[float], symmetric: bool, resolution: int = 16) -> tuple[list[int], float, int]:
    """The scale search of one group, written out plainly in float64 (codes, scale, zero point):
    round-to-nearest first (its scale rounded to float16 before its codes), then each
    candidate's levels with their least-squares scale rounded to float16; a candidate replaces
    the best only with a smaller squared error at its rounded scale."""
    def error(levels: list[int], s: float) -> float:
        return sum((v - lv * s) ** 2 for v, lv in zip(x, levels))

    def least_squares(levels: list[int]) -> float:
        return _half(sum(v * lv for v, lv in zip(x, levels)) / sum(v * v for v in levels))

    if symmetric:
        m = max(x, key=abs)
        s = _half(m / -8)
        levels = [min(7, max(-8, round(v / s))) for v in x]
        best = (error(levels, s), [lv + 8 for lv in levels], s, 128)
        for c in SYMMETRIC_CANDIDATES:
            levels = [min(7, max(-8, round(-c * v / m))) for v in x]
            s = least_squares(levels)
            if error(levels, s) < best[0] - 1e-9:
                best = (error(levels, s), [lv + 8 for lv in levels], s, 128)
    else:
        lo0, hi0 = min(min(x), 0.0), max(max(x), 0.0)

        def rounded(r: float) -> tuple[float, int, list[float]]:
            """(step, zero point in sixteenths z16, levels q - z16 / 16)"""
            step = _half((hi0 - lo0) * r / 15)
            z16 = min(16 * resolution - 1, max(0, round(-resolution * lo0 * r / step))) * (16 // resolution)
            whole, fraction = z16 // 16, (z16 % 16) / 16
            return step, z16, [min(15, max(0, round(v / step + fraction) + whole)) - z16 / 16 for v in x]

        step, z16, levels = rounded(1.0)
        best = (error(levels, step), [round(lv + z16 / 16) for lv in levels], step, z16)
        for r in ASYMMETRIC_RATIOS:
            _, z16, levels = rounded(r)
            s = least_squares(levels)
            if error(levels, s) < best[0] - 1e-9:
                best = (error(levels, s), [round(lv + z16 / 16) for lv in levels], s, z16)
    return best[1], best[2], best[3]


@pytest.mark.parametrize(("symmetric", "resolution"), [(True, None), (False, 16), (False, 1)])
def test_the_search_picks_what_a_plain_reference_picks(symmetric, resolution):
    torch.manual_seed(11 + symmetric)
    # heavy-tailed groups (a few large values), where clipping pays, and plain Gaussian ones
    w = torch.randn(6, 96) * torch.where(torch.rand(6, 96) < 0.05, 6.0, 1.0)
    q = quantize(w, 32, symmetric, resolution=resolution)
    codes = unpack_codes(q.qweight)
    for r in range(6):
        for g in range(3):
            want_codes, want_scale, want_zero = _searched_group(w[r, 32 * g : 32 * g + 32].double().tolist(), symmetric,
                                                                resolution or 16)
            assert codes[r, 32 * g : 32 * g + 32].tolist() == want_codes, (r, g)
            # a float16 value; at most one float16 step from the float64 reference's
            assert q.scales[r, g].item() == _half(q.scales[r, g].item())
            assert q.scales[r, g].item() == pytest.approx(want_scale, rel=2**-10), (r, g)
            assert (q.zeros[r, g].item() if q.zeros is not None else 128) == want_zero, (r, g)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize(("symmetric", "resolution"), [(True, None), (False, 16), (False, 1)])
def test_the_search_never_does_worse_than_round_to_nearest(shape, group_size, symmetric, resolution):
    """At one zero-point resolution (chosen per group, the two fits of a group may take different
    ones: each is no worse than its own round-to-nearest)."""
    torch.manual_seed(sum(shape) * 5 + group_size + symmetric)
    w = torch.randn(shape) * torch.where(torch.rand(shape) < 0.05, 5.0, 1.0)
    searched = quantize(w, group_size, symmetric, resolution=resolution)
    plain = quantize(w, group_size, symmetric, search=False, resolution=resolution)
    error = ((_groups(dequantize(searched) - w, group_size)) ** 2).sum(dim=2)
    rtn = ((_groups(dequantize(plain) - w, group_size)) ** 2).sum(dim=2)
    # the search compares Σ x² - error in float32: errors a millionth of Σ x² apart are a tie
    energy = (_groups(w, group_size) ** 2).sum(dim=2)
    assert bool((error <= rtn * (1 + 1e-5) + 1e-6 * energy).all())
    # each group's scale is the least-squares one for its integer levels, rounded to float16, or
    # round-to-nearest's (codes and scale) where no candidate beat it
    assert searched.scales.dtype == torch.float16
    codes = _groups(unpack_codes(searched.qweight).float()[:, : shape[1]], group_size)
    zero = searched.zeros.float() / 16 if searched.zeros is not None else torch.full_like(searched.scales, 8)
    levels = codes - zero[:, :, None]
    levels = torch.where(_groups(torch.ones(shape), group_size) > 0, levels, torch.zeros_like(levels))  # padding
    l2 = (levels * levels).sum(dim=2)
    least_squares = (_groups(w, group_size) * levels).sum(dim=2) / l2.clamp(min=1e-30)
    searched_fit = (searched.scales.float() - least_squares).abs() <= least_squares.abs() * 2**-10
    kept_rtn = (searched.scales == plain.scales) & (unpack_codes(searched.qweight) == unpack_codes(plain.qweight)).reshape(
        *searched.scales.shape, group_size).all(dim=2)
    assert bool((searched_fit | kept_rtn)[l2 > 0].all())
    if shape[1] >= 32 and shape[0] >= 5:  # on these groups the search finds something better
        assert float(error.sum()) < float(rtn.sum())


def test_a_group_of_zeros_gets_scale_one():
    w = torch.zeros(2, 40)
    w[1, 35] = 1.0
    for symmetric in (True, False):
        q = quantize(w, 32, symmetric)
        assert q.scales[0].tolist() == [1.0, 1.0] and q.scales[1, 0].item() == 1.0
        back = dequantize(q)
        assert torch.equal(back[0], w[0]) and torch.equal(back[1, :35], w[1, :35]) and torch.equal(back[1, 36:], w[1, 36:])
        # symmetric: 1 = -8 · -1/8 exactly; asymmetric: 15 · (1/15 rounded to float16)
        assert back[1, 35].item() == (1.0 if symmetric else 15 * torch.tensor(1 / 15).half().item())


def test_group_size_must_be_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.ones(2, 64), 48)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(50, 40)
        self.proj = nn.Linear(40, 70, bias=True)
        self.down = nn.Linear(70, 40, bias=False)
        self.lm_head = nn.Linear(40, 50, bias=False)


@pytest.mark.parametrize(("method", "group", "zeros"), [(Int4Quantization, 32, False), (Int4G128Quantization, 128, False),
                                                        (Int4AsymQuantization, 32, True)])
@pytest.mark.parametrize("lm_head", [False, True])
def test_every_linear_is_replaced_and_the_lm_head_only_when_asked(method, group, zeros, lm_head):
    model = _Tiny()
    # more rows than the C++ kernel takes (when a test before loaded it): the float path
    x = torch.randn(int4_kernel_max_rows() + 1, 40)
    want = model.proj(x)
    model_weight = model.proj.weight.detach().clone()
    report = method().quantize(model, quantize_lm_head=lm_head)
    assert isinstance(model.proj, Int4Linear) and isinstance(model.down, Int4Linear)
    assert model.proj.group_size == group and (model.proj.zeros is not None) == zeros
    assert isinstance(model.lm_head, Int4Linear) == lm_head and report.lm_head == lm_head
    assert report.num_linear == 2
    assert not hasattr(model.proj, "weight")  # kernels reading int8 rows must not take it
    padded = -(-70 // group) * group
    # per group: codes, a float16 scale (2 bytes) and, with zero points, a uint8 one
    per_layer = 70 * (-(-40 // group) * group) // 2 + 70 * (-(-40 // group)) * (3 if zeros else 2)
    per_layer += 40 * padded // 2 + 40 * (padded // group) * (3 if zeros else 2)
    head = 50 * (-(-40 // group) * group) // 2 + 50 * (-(-40 // group)) * (3 if zeros else 2)
    assert report.quantized_bytes == per_layer + (head if lm_head else 0)
    got = model.proj(x)
    expected = torch.nn.functional.linear(x, dequantize(model.proj.weights), model.proj.bias)
    assert torch.allclose(got, expected, atol=1e-4)
    # the product is off by at most the sum of each weight's error times its input
    error = (dequantize(quantize(model_weight, group, not zeros)) - model_weight).abs()
    assert bool(((got - want).abs() <= x.abs() @ error.T + 1e-4).all())
    assert torch.equal(model.proj.qweight, quantize(model_weight, group, not zeros).qweight)  # the search ran


def test_tied_lm_head_gets_its_own_int4_copy():
    model = _Tiny()
    model.lm_head = None
    report = Int4Quantization().quantize(model, quantize_lm_head=True)
    assert report.lm_head and isinstance(model.lm_head, Int4Linear)
    assert isinstance(model.embed_tokens, nn.Embedding)  # the lookup stays float


def test_the_module_keeps_float16_scales_and_refuses_others():
    w = quantize(torch.randn(8, 64), 32)
    assert w.scales.dtype == torch.float16
    assert Int4Linear(w, None, torch.float32).scales.dtype == torch.float16
    wide = Int4Weights(w.qweight, w.scales.float(), w.zeros, w.group_size, w.in_features)
    with pytest.raises(TypeError, match="int4 scales are float16, not torch.float32"):
        Int4Linear(wide, None, torch.float32)  # never rounded silently: a scale past 65504 would become inf
