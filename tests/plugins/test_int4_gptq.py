"""The calibrated int4 fits: GPTQ (plugins/int4_gptq.py) against the paper's algorithm written
plainly in float64 and against round-to-nearest on the calibration inputs it was fitted to;
the importance-weighted scale search (`imatrix`) against the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.plugins.int4_gptq import (
    DAMP,
    GPTQ_HESSIAN_SHRINK,
    gptq_fit,
    gptq_passes,
    gptq_quantize,
)
from pagedserve.plugins.int4_group_fit import fit_asymmetric, fit_symmetric
from pagedserve.plugins.int4_quantization import Int4Weights, dequantize, pack_codes, quantize

CASES = [(32, True), (128, True), (32, False), (128, False)]


@pytest.fixture(autouse=True)
def _one_thread():
    """These are small products: on a shared machine torch's thread pool only waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool, search: bool,
                   weighted: bool = False, act_order: bool = False, shrink: float = 0.0):
    """GPTQ as the paper states it, one column at a time with no Cholesky factor and no lazy
    batches: quantize column j, then move the columns F still free by the Optimal Brain Surgeon
    update -(w_j - q_j) / [H_F⁻¹]_jj · [H_F⁻¹]_j,:, with H_F⁻¹ inverted afresh each column.
    `act_order`: the columns by decreasing H_jj, every group fitted first (static groups).
    `shrink`: α, H taken as (1 - α)·H + α·diag(H) first."""
    out, k = weight.shape
    padded = -(-k // group_size) * group_size
    W = F.pad(weight.double(), (0, padded - k))
    H = torch.zeros(padded, padded, dtype=torch.float64)
    H[:k, :k] = hessian.double()
    off_diagonal = ~torch.eye(padded, dtype=torch.bool)
    H[off_diagonal] *= 1 - shrink
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    real = (torch.arange(padded) < k).double()  # the padding weighs 0 in the fit, as in `quantize`
    importance = None
    if weighted or padded > k:  # H's diagonal before dampening
        importance = (H.diagonal() * real if weighted else real).reshape(1, -1, group_size)
    order = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else torch.arange(padded)
    H += DAMP * H.diagonal().mean() * torch.eye(padded, dtype=torch.float64)
    codes = torch.zeros(out, padded, dtype=torch.uint8)
    scales = torch.zeros(out, padded // group_size, dtype=torch.float64)
    zeros = torch.zeros(out, padded // group_size, dtype=torch.uint8)

    def fit(part, group):
        weights = None if importance is None else importance[:, group : group + part.shape[1]]
        _, scale, zero = fit_symmetric(part, search, weights) if symmetric else fit_asymmetric(part, search, weights)
        return scale, zero

    if act_order:
        scales[:], zeros[:] = fit(W.reshape(out, -1, group_size), 0)
    for i, j in enumerate(order.tolist()):
        g = j // group_size
        if not act_order and j % group_size == 0:
            scale, zero = fit(W[:, None, j : j + group_size], g)
            scales[:, g], zeros[:, g] = scale[:, 0], zero[:, 0]
        s, z = scales[:, g], zeros[:, g].double() / 16  # zero points in sixteenths
        q = torch.clamp(torch.round(W[:, j] / s + z - torch.floor(z)) + torch.floor(z), 0, 15)
        codes[:, j] = q.to(torch.uint8)
        free = order[i:]
        inverse = torch.linalg.inv(H[free][:, free])
        W[:, free] -= ((W[:, j] - (q - z) * s) / inverse[0, 0])[:, None] * inverse[0][None, :]
    return codes, scales, zeros


def _layer(out: int = 24, k: int = 200, rows: int = 400, seed: int = 0):
    """A weight and calibration inputs with correlated features (as a layer's inputs are)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, k, generator=g)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(rows, k, generator=g) @ mix + torch.randn(k, generator=g)
    x[:, 5] = 0.0  # an input the calibration never reached: a dead column
    return weight, x


@pytest.mark.parametrize(("group_size", "symmetric"), CASES)
@pytest.mark.parametrize(("search", "weighted", "act_order", "shrink"),
                         [(False, False, False, 0.0), (True, False, False, 0.0), (True, True, False, 0.0),
                          (False, False, True, 0.0), (True, True, True, 0.0), (True, True, True, 0.3)])
def test_gptq_matches_the_papers_algorithm_in_float64(group_size, symmetric, search, weighted, act_order, shrink,
                                                      monkeypatch):
    from pagedserve.plugins import int4_gptq

    monkeypatch.setattr(int4_gptq, "BLOCK_COLUMNS", 32)  # several lazy batches at group 32
    weight, x = _layer(out=8, k=72, rows=160)  # 72 inputs: padded to 96 and to 128
    hessian = x.double().T @ x.double()
    codes, scales, zeros = gptq_quantize(weight.double(), hessian, group_size, symmetric, search, weighted_fit=weighted,
                                         act_order=act_order, shrink=shrink)
    want_codes, want_scales, want_zeros = reference_gptq(weight, hessian, group_size, symmetric, search, weighted,
                                                         act_order, shrink)
    assert torch.equal(codes, want_codes)
    assert torch.allclose(scales, want_scales, rtol=1e-9, atol=0)
    assert torch.equal(zeros, want_zeros)


@pytest.mark.parametrize(("group_size", "symmetric"), CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_diagonal_hessian_gives_round_to_nearest_exactly(group_size, symmetric, act_order):
    weight, _ = _layer(k=200)  # 200 inputs: the last group is padded at 32 and at 128
    # distinct diagonal values in shuffled order, so act order really permutes the columns
    diagonal = torch.linspace(0.5, 2.0, 200)[torch.randperm(200, generator=torch.Generator().manual_seed(1))]
    codes, scales, zeros = gptq_quantize(weight, torch.diag(diagonal), group_size, symmetric, search=False,
                                         act_order=act_order)
    rtn = quantize(weight, group_size, symmetric, search=False)
    assert torch.equal(pack_codes(codes), rtn.qweight)
    assert torch.equal(scales, rtn.scales.float())
    assert symmetric or torch.equal(zeros, rtn.zeros)


@pytest.mark.parametrize(("group_size", "symmetric"), CASES)
def test_a_fully_shrunk_hessian_is_its_diagonal_and_the_methods_shrink_it(group_size, symmetric):
    from pagedserve.plugins import int4_gptq

    weight, x = _layer()
    hessian = x.T @ x
    flags = {"search": True, "weighted_fit": True, "act_order": True}
    diagonal = gptq_quantize(weight, torch.diag(hessian.diagonal()), group_size, symmetric, **flags)
    shrunk = gptq_quantize(weight, hessian, group_size, symmetric, shrink=1.0, **flags)
    assert all(torch.equal(a, b) for a, b in zip(shrunk, diagonal, strict=True))
    # the methods' fit: GPTQ_HESSIAN_SHRINK, which moves codes (this layer's inputs are correlated)
    fitted = gptq_fit(weight, hessian, group_size, symmetric)
    assert int4_gptq.GPTQ_HESSIAN_SHRINK == 0.2
    want = gptq_quantize(weight, hessian, group_size, symmetric, shrink=0.2, **flags)
    assert all(torch.equal(a, b) for a, b in zip(fitted, want, strict=True))
    assert not torch.equal(fitted[0], gptq_quantize(weight, hessian, group_size, symmetric, **flags)[0])


def _output_error(weight: torch.Tensor, x: torch.Tensor, q: Int4Weights) -> float:
    x64 = x.double()
    return float(((x64 @ (weight.double() - dequantize(q).double()).T) ** 2).sum())


@pytest.mark.parametrize(("group_size", "symmetric"), CASES)
@pytest.mark.parametrize(("act_order", "shrink"), [(False, 0.0), (True, 0.0), (True, GPTQ_HESSIAN_SHRINK)])
def test_gptq_error_on_its_calibration_inputs_is_below_round_to_nearest(group_size, symmetric, act_order, shrink):
    weight, x = _layer()
    codes, scales, zeros = gptq_quantize(weight, x.T @ x, group_size, symmetric, act_order=act_order, shrink=shrink)
    fitted = Int4Weights(pack_codes(codes), scales.half(), None if symmetric else zeros, group_size, weight.shape[1])
    gptq_error = _output_error(weight, x, fitted)
    # both data-free fits: round-to-nearest, and the scale search the methods run without calibration
    for search in (False, True):
        assert gptq_error < 0.7 * _output_error(weight, x, quantize(weight, group_size, symmetric, search))


def test_passes_hold_at_most_the_budget_of_hessians(monkeypatch):
    from pagedserve.plugins import int4_gptq

    monkeypatch.setattr(int4_gptq, "HESSIAN_BYTES_PER_PASS", 3 * 4 * 64**2)
    targets = [(f"l{i}", torch.nn.Linear(k, 8)) for i, k in enumerate([64, 64, 64, 64, 128, 64])]
    names = [[name for name, _ in p] for p in gptq_passes(targets)]
    assert names == [["l0", "l1", "l2"], ["l3"], ["l4"], ["l5"]]  # l4 alone is over the budget


@pytest.mark.parametrize(("group_size", "symmetric"), CASES)
def test_importance_weighted_search_never_does_worse_on_its_weights(group_size, symmetric):
    weight, x = _layer()
    importance = (x * x).sum(dim=0)
    ones = quantize(weight, group_size, symmetric, importance=torch.ones(weight.shape[1]))
    plain = quantize(weight, group_size, symmetric)
    assert torch.equal(ones.qweight, plain.qweight) and torch.allclose(ones.scales, plain.scales, rtol=1e-6, atol=0)

    def weighted_error(q: Int4Weights) -> float:
        return float((((dequantize(q) - weight) ** 2) * importance).sum())

    weighted = quantize(weight, group_size, symmetric, importance=importance)
    # the same candidate roundings, each with its weighted least-squares scale: never worse
    assert weighted_error(weighted) <= weighted_error(plain)
    assert weighted_error(weighted) <= weighted_error(quantize(weight, group_size, symmetric, search=False))
