"""The Triton w4a16 GEMM (kernels/triton_int4.py) against dequantize-then-F.linear, its rows'
independence of the batch, and its use by `Int4Linear`. In-process the kernel runs in
Triton's interpreter on CPU tensors; the `gpu` test runs this file again, compiled, on CUDA
tensors (DEVICE below)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from pagedserve.kernels import triton_int4  # noqa: E402
from pagedserve.kernels.triton_int4 import w4a16_linear, w4a16_linear_ref  # noqa: E402
from pagedserve.plugins.int4_quantization import (  # noqa: E402
    Int4Linear,
    Int4Weights,
    dequantize,
    quantize,
    unpack_codes,
)

from triton_twin import run_compiled_twin, twin_device  # noqa: E402

#: CUDA only when the kernels are compiled (the `gpu` twin, triton_twin.py)
DEVICE = twin_device()
#: the largest relative error of rounding float32 to the output's dtype: half an ulp (round
#: to nearest), but a whole one for bfloat16 in the interpreter, which truncates float32 to
#: bfloat16 (its cast has no rounding mode; a compiled kernel rounds to nearest)
OUT_UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11,
            torch.bfloat16: 2.0**-8 if DEVICE == "cuda" else 2.0**-7}
#: float32 accumulation: twice float32's unit roundoff, which also covers tensor cores that
#: truncate their sums instead of rounding them
ACC_UNIT = 2.0**-23


def _case(m, k, n, group, symmetric, dtype, bias=True, seed=0):
    """x [m, k] and an int4 layer quantized by the plugin (the scale search) from a random weight."""
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, group, symmetric)
    # zero points anywhere in 0..255 sixteenths, most fractional (the fit gives few on Gaussian weights)
    zeros = None if symmetric else torch.randint(0, 256, w.scales.shape, generator=g, dtype=torch.uint8).to(DEVICE)
    w = Int4Weights(w.qweight.to(DEVICE), w.scales.to(DEVICE), zeros, group, k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _run(x, w: Int4Weights, b, split_k=None):
    return w4a16_linear(x, w.qweight, w.scales, w.zeros, b, w.group_size, split_k=split_k)


def _exact(w: Int4Weights) -> torch.Tensor:
    """The dequantized weight in float64, exactly (q - z)·s (float32 rounds some products)."""
    codes = unpack_codes(w.qweight.cpu()).double()
    n, padded = codes.shape
    zero = w.zeros.cpu().double() / 16 if w.zeros is not None else torch.full(w.scales.shape, 8.0, dtype=torch.float64)
    groups = (codes.reshape(n, -1, w.group_size) - zero[:, :, None]) * w.scales.cpu().double()[:, :, None]
    return groups.reshape(n, padded)[:, : w.in_features]


def _assert_within_bound(y, x, w: Int4Weights, b):
    """|y - exact| <= u·|exact| + (1 + u)·γ·(|x|·|W|ᵀ + |b|) + half the output's subnormal step,
    with exact = F.linear(x, dequantize(W), b) in float64, u the output dtype's unit roundoff
    and γ = n·ACC_UNIT / (1 - n·ACC_UNIT) for n = 2K + 32 float32 roundings in any sum's chain
    (K products and additions, the scale, the groups', splits' and bias additions)."""
    w64, x64 = _exact(w), x.cpu().double()
    b64 = b.cpu().double() if b is not None else torch.zeros(w64.shape[0], dtype=torch.float64)
    exact = F.linear(x64, w64, b64)
    n = 2 * w.in_features + 32
    gamma = n * ACC_UNIT / (1 - n * ACC_UNIT)
    u = OUT_UNIT[y.dtype]
    bound = u * exact.abs() + (1 + u) * gamma * (x64.abs() @ w64.abs().t() + b64.abs())
    bound += torch.finfo(y.dtype).smallest_normal * u
    error = (y.cpu().double() - exact).abs()
    assert bool((error <= bound).all()), f"max error {error.max().item():.3g}, its bound {bound.flatten()[error.argmax()]:.3g}"


# (K, N, group, symmetric, bias): K no multiple of the group (nor 16), N odd; one input; many groups
SHAPES = [(200, 37, 32, True, True), (200, 37, 128, False, False), (300, 75, 128, True, True),
          (72, 33, 32, False, True), (1, 3, 32, True, False)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("k", "n", "group", "symmetric", "bias"), SHAPES,
                         ids=[f"k{k}-n{n}-g{g}-{'sym' if s else 'asym'}{'-bias' if b else ''}" for k, n, g, s, b in SHAPES])
def test_w4a16_matches_dequantize_then_linear(m, k, n, group, symmetric, bias, dtype):
    x, w, b = _case(m, k, n, group, symmetric, dtype, bias)
    y = _run(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    _assert_within_bound(y, x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("group", "symmetric"), [(32, False), (128, True)], ids=["g32-asym", "g128-sym"])
@pytest.mark.parametrize(("m", "split_k"), [(1, 3), (17, 2), (3, 7)])
def test_w4a16_split_k_matches_dequantize_then_linear(m, split_k, group, symmetric, dtype):
    """K = 520 split across programs (as split_k_for does for few output tiles on a GPU): the
    float32 partials, added by the second kernel, keep the bound. Splits are whole K steps:
    7 asked of K = 520 in 128-wide steps (bfloat16, group 128) leave 5."""
    x, w, b = _case(m, 520, 37, group, symmetric, dtype)
    y = _run(x, w, b, split_k)
    _assert_within_bound(y, x, w, b)
    assert torch.equal(y, _run(x, w, b, split_k))  # the same sum every run


@pytest.mark.parametrize(("tiles", "split_k"), [((16, 32, 4), 2), ((32, 128, 4), 1), ((64, 64, 8), None)],
                         ids=["16x32-split2", "32x128", "64x64-8warps"])
def test_w4a16_tiles_given_by_the_caller_keep_the_bound(tiles, split_k):
    """The `tiles` override that benchmarks/gpu_kernels.py tunes with: another tile shape and
    warp count computes the same product, within the same bound."""
    x, w, b = _case(19, 300, 75, 128, False, torch.bfloat16)
    y = w4a16_linear(x, w.qweight, w.scales, w.zeros, b, w.group_size, split_k=split_k, tiles=tiles)
    _assert_within_bound(y, x, w, b)


@pytest.fixture
def row_by_row_interpreter_dot(monkeypatch):
    """Under the interpreter, `tl.dot` is numpy's matmul, and OpenBLAS's float32 matmul is not
    batch-invariant on every CPU (on an AVX2 EPYC a row of a 16-row product differs from the
    same row of a 32-row one). What the invariance test checks is the kernel's own walk over
    K, so there each row of a tile's dot is computed alone: numpy's vector-matrix product of
    that row, the same whatever tile it sits in. Compiled on a GPU nothing is patched."""
    if twin_device() != "cpu":
        return
    import numpy as np

    matmul = np.matmul

    def rows_alone(a, b, *args, **kwargs):
        if np.ndim(a) != 2:
            return matmul(a, b, *args, **kwargs)
        return np.stack([matmul(row, b, *args, **kwargs) for row in a])

    monkeypatch.setattr(np, "matmul", rows_alone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("group", "symmetric"), [(32, False), (128, True)], ids=["g32-asym", "g128-sym"])
@pytest.mark.parametrize("split_k", [None, 1, 3], ids=["split-default", "split-1", "split-3"])
@pytest.mark.usefixtures("row_by_row_interpreter_dot")
def test_w4a16_rows_are_independent_of_the_batch(split_k, group, symmetric, dtype):
    """For a given split count (the default's is the same for every M up to 32) each row of y
    is bitwise the same for M = 1..17: the 16-row and the 32-row tile walk K alike."""
    x, w, b = _case(17, 520, 37, group, symmetric, dtype)
    full = _run(x, w, b, split_k)
    for m in range(1, 17):
        assert torch.equal(_run(x[:m], w, b, split_k), full[:m]), f"M={m}"


def test_split_k_by_k_alone_up_to_16_rows_and_the_measured_tiles(monkeypatch):
    class Props:
        multi_processor_count = 132  # an H100/H200

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    cuda = torch.device("cuda")
    assert triton_int4.split_k_for(1, 4096, 4096, 32, torch.device("cpu")) == 1  # the interpreter: never
    assert triton_int4.split_k_for(1, 4096, 4096, 128, cuda) == 4  # 8 steps of 128 a program
    assert triton_int4.split_k_for(1, 28672, 4096, 128, cuda) == 4  # whatever the output tiles' count
    assert triton_int4.split_k_for(1, 4096, 14336, 128, cuda) == 14  # down_proj
    assert triton_int4.split_k_for(1, 4096, 32768, 128, cuda) == 16  # the cap
    assert triton_int4.split_k_for(1, 1024, 2048, 32, cuda) == 8  # 64 steps of 32
    assert triton_int4.split_k_for(1, 1024, 256, 128, cuda) == 1  # two 128-wide steps: too short
    assert triton_int4.split_k_for(1, 1024, 1152, 128, cuda) == 2  # 9 steps
    assert triton_int4.split_k_for(17, 4096, 14336, 128, cuda) == 4  # above 16 rows: at most 4
    assert triton_int4.split_k_for(65, 1024, 4096, 32, cuda) == 1  # prefill: no splits
    assert triton_int4.split_k_for(1, 4096, 4096, 128, cuda, torch.float32) == 16  # 32-wide steps in float32
    for n, k, group in ((4096, 4096, 32), (6144, 4096, 128), (960, 576, 32), (4096, 14336, 128)):
        splits = {triton_int4.split_k_for(m, n, k, group, cuda) for m in range(1, 17)}
        assert len(splits) == 1, (n, k, group, splits)  # the same walk over K for every M up to 16
    assert [triton_int4.tiles_for(m) for m in (1, 16, 17, 64, 65, 256)] == [(16, 64, 4)] * 2 + [(64, 64, 4)] * 4
    assert [triton_int4.tiles_for(m, torch.float32) for m in (16, 64, 65)] == [(16, 64, 4), (32, 64, 4), (64, 64, 8)]
    assert triton_int4.block_k_for(32) == 32 and triton_int4.block_k_for(128) == 128
    assert triton_int4.block_k_for(96) == 32 and triton_int4.block_k_for(576) == 64  # a checkpoint's group
    assert triton_int4.block_k_for(128, torch.float32) == 32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("k", "n", "group", "symmetric", "bias"), SHAPES[:4],
                         ids=[f"k{k}-n{n}-g{g}-{'sym' if s else 'asym'}" for k, n, g, s, _ in SHAPES[:4]])
def test_dequantize_pass_gives_the_references_weight(k, n, group, symmetric, bias, dtype):
    """`w4_dequantize` (the prefill path's one pass over the packed bytes) gives the reference's
    float32 weight rounded once to the dtype: exactly, where the interpreter rounds as a GPU
    does (float32, float16); bfloat16's interpreted cast truncates, so there within one ulp."""
    _, w, _ = _case(1, k, n, group, symmetric, dtype, bias)
    got = triton_int4.w4_dequantize(w.qweight, w.scales, w.zeros, group, k, dtype)
    want = triton_int4.dequantize_ref(w.qweight, w.scales, w.zeros, group, k).to(got.device)
    assert got.shape == (n, k) and got.dtype == dtype
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        assert torch.allclose(got.float(), want, rtol=2.0**-7, atol=0)
    else:
        assert torch.equal(got, want.to(dtype))


def test_the_operator_dequantizes_for_a_prefill(monkeypatch):
    """Above DEQUANTIZE_ABOVE_ROWS rows the registered operator takes the dequantize pass and
    torch's matmul, at or below it the w4a16 GEMM; both within the GEMM's bound."""
    x, w, b = _case(9, 200, 37, 32, False, torch.float32)
    calls = []
    gemm = triton_int4.w4a16_linear
    monkeypatch.setattr(triton_int4, "w4a16_linear", lambda *a, **k: calls.append("gemm") or gemm(*a, **k))
    monkeypatch.setattr(triton_int4, "DEQUANTIZE_ABOVE_ROWS", 8)
    y = triton_int4._w4a16_op(x, w.qweight, w.scales, w.zeros, b, 32)
    assert calls == []
    _assert_within_bound(y, x, w, b)
    y8 = triton_int4._w4a16_op(x[:8], w.qweight, w.scales, w.zeros, b, 32)
    assert calls == ["gemm"]
    _assert_within_bound(y8, x[:8], w, b)


def test_w4a16_large_tile_leading_dims_and_a_zero_scale_row():
    """M = 70 takes the 64-row tile (two row tiles, the second partial); x [2, 35, K] is
    flattened and y keeps the leading dimensions; a row of zero scales gives the bias."""
    x, w, b = _case(70, 96, 130, 32, False, torch.bfloat16)
    w.scales[5] = 0.0
    y = w4a16_linear(x.view(2, 35, 96), w.qweight, w.scales, w.zeros, b, 32)
    assert y.shape == (2, 35, 130)
    _assert_within_bound(y.view(70, 130), x, w, b)
    assert torch.equal(y.view(70, 130)[:, 5], b[5].expand(70))


def test_w4a16_group_of_a_checkpoint_and_strided_x():
    """A group that is no power of two (96, a GPTQ checkpoint's: 32-wide steps) and x a
    column slice of a wider tensor (rows strided)."""
    x, w, b = _case(5, 150, 21, 96, False, torch.float16)
    wide = torch.zeros(5, 200, dtype=x.dtype, device=x.device)
    wide[:, 20:170] = x
    _assert_within_bound(_run(wide[:, 20:170], w, b), x, w, b)


def test_the_reference_is_the_plugins_dequantized_linear():
    for group, symmetric in ((32, True), (128, False)):
        x, w, b = _case(4, 200, 24, group, symmetric, torch.float32)
        ref_w = triton_int4.dequantize_ref(w.qweight, w.scales, w.zeros, group, 200)
        assert torch.equal(ref_w, dequantize(w))
        torch.testing.assert_close(w4a16_linear_ref(x, w.qweight, w.scales, w.zeros, b, group),
                                   F.linear(x, dequantize(w), b), rtol=1e-6, atol=1e-6)


def test_int4_linear_calls_the_triton_gemm_where_registered(monkeypatch):
    """On a device in TRITON_GEMM_DEVICES (CUDA; CPU here, for the test) Int4Linear calls the
    registered `w4a16_linear` operator with its layout; elsewhere it keeps its own path."""
    from pagedserve.plugins import int4_quantization as quantization

    linear = torch.nn.Linear(72, 40, bias=True).to(DEVICE, torch.bfloat16)
    module = Int4Linear.from_linear(linear, 32, symmetric=False)
    x = torch.randn(2, 3, 72).to(DEVICE, torch.bfloat16)
    calls = []

    def op(name):
        if name != "w4a16_linear":
            return None
        return lambda *args: calls.append((args[0].shape, args[-1])) or w4a16_linear(*args)

    monkeypatch.setattr(quantization, "_cpu_op", op)
    monkeypatch.setattr(quantization, "TRITON_GEMM_DEVICES", (x.device.type,))
    y = module(x)
    assert calls == [(torch.Size([6, 72]), 32)]
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.view(6, 40), w4a16_linear(x.view(6, 72), module.qweight, module.scales, module.zeros,
                                                   module.bias, 32))
    monkeypatch.setattr(quantization, "TRITON_GEMM_DEVICES", ())
    want = F.linear(x.view(6, 72), dequantize(module.weights, x.dtype), module.bias)
    assert torch.equal(module(x).view(6, 40), want) and len(calls) == 1  # elsewhere: dequantize + F.linear


def test_register_op_and_the_worker_check(monkeypatch, caplog):
    """The worker registers each GEMM after its own self-check passes: an int4 kernel that
    fails its check leaves the int8 one registered; once registered,
    torch.ops.pagedserve.w4a16_linear is the kernel."""
    from pagedserve.engine import model_loader
    from pagedserve.kernels import triton_int8

    registered = []
    monkeypatch.setattr(triton_int8, "self_check", lambda device: None)
    monkeypatch.setattr(triton_int8, "register_op", lambda: registered.append("w8a16"))
    monkeypatch.setattr(triton_int4, "self_check", lambda device: "broken")
    monkeypatch.setattr(triton_int4, "register_op", lambda: registered.append("w4a16"))
    with caplog.at_level(logging.WARNING, logger=model_loader.logger.name):
        model_loader._register_triton_gemm(torch.device(DEVICE))
    assert registered == ["w8a16"]
    assert "the Triton w4a16 GEMM failed its self-check (broken); int4 layers dequantize instead" in caplog.text
    monkeypatch.undo()
    assert triton_int4.self_check(torch.device(DEVICE)) is None
    model_loader._register_triton_gemm(torch.device(DEVICE))
    x, w, b = _case(3, 100, 20, 32, False, torch.bfloat16)
    assert torch.equal(torch.ops.pagedserve.w4a16_linear(x, w.qweight, w.scales, w.zeros, b, 32), _run(x, w, b))
    assert torch.equal(torch.ops.pagedserve.w4a16_linear(x, w.qweight, w.scales, None, None, 32),
                       w4a16_linear(x, w.qweight, w.scales, None, None, 32))
    triton_int4.register_op()  # a second registration is a no-op


def test_self_check_catches_a_wrong_kernel(monkeypatch):
    monkeypatch.setattr(triton_int4, "w4a16_linear", lambda *args: w4a16_linear_ref(*args) + 1)
    assert triton_int4.self_check(torch.device(DEVICE)) == \
        "w4a16_linear disagrees with the torch reference at M=1, group 32"


@pytest.mark.gpu
def test_the_same_checks_compiled_on_a_gpu():
    """This file's tests again, compiled for the GPU, on CUDA tensors (DEVICE)."""
    run_compiled_twin(__file__)
