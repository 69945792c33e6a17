"""The CPU int4 × int8 kernels (kernels/csrc/cpu_int4_gemv.cpp): each ISA path this CPU has
matches the reference on odd shapes and M = 1..17, and each row is bitwise independent of
the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.plugins.int4_quantization import (
    Int4Linear,
    Int4Weights,
    dequantize,
    quantize,
    unpack_codes,
)

from cpu_flags import kernel_flags
from engine_helpers import assert_fused_step_equals_eager

# (in, out, group): K not a multiple of the group, nor of 32, nor of 64; one block; many groups
SHAPES = [(33, 7, 32), (200, 37, 128), (96, 5, 32), (1, 3, 32), (300, 9, 32), (129, 66, 128)]


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    if module is None:
        pytest.skip("the CPU extension cannot be built here (no compiler)")
    previous = module.int4_kernel()
    yield module
    module.set_int4_kernel(previous)


def reference(x: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 of what the kernels compute: x quantized to int8 per block of 32 (d = max|x| / 127,
    round(x·(127 / max|x|)) in float32), exact integer block sums of (16·q - z16)·xq (zero points
    in sixteenths), times d·s / 16."""
    m, k = x.shape
    padded = w.qweight.shape[1] * 2
    xp = F.pad(x, (0, padded - k)).reshape(m, padded // 32, 32)
    amax = xp.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xp * inv).to(torch.int64)  # float32 multiply, as the kernel
    d = (amax / 127.0).double().squeeze(2)  # [m, blocks]
    codes = unpack_codes(w.qweight).to(torch.int64)
    out = codes.shape[0]
    zeros = w.zeros.to(torch.int64) if w.zeros is not None else torch.full(w.scales.shape, 128, dtype=torch.int64)
    centred = (16 * codes.reshape(out, -1, w.group_size) - zeros[:, :, None]).reshape(out, padded // 32, 32)
    sums = torch.einsum("mbi,obi->mob", xq, centred).double()  # exact int64 block sums
    block_scale = w.scales.double().repeat_interleave(w.group_size // 32, dim=1) / 16  # [out, blocks]
    y = (sums * d[:, None, :] * block_scale[None]).sum(dim=2)
    return y if bias is None else y + bias.double()


def _case(k: int, n: int, group: int, symmetric: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, group, symmetric)
    if not symmetric:  # zero points anywhere in 0..255 sixteenths: most fractional (the fit gives few on these)
        w = Int4Weights(w.qweight, w.scales, torch.randint(0, 256, w.scales.shape, generator=g, dtype=torch.uint8),
                        w.group_size, w.in_features)
    x = torch.randn(17, k, generator=g)
    x[3] = 0.0  # an all-zero row: scale 0 blocks
    x[5, : min(k, 40)] *= 100.0  # a block with a large value
    bias = torch.randn(n, generator=g)
    return w, x, bias


def _kernel_names(kernels) -> list[str]:
    return list(kernels.int4_kernels())


def test_this_cpu_runs_its_best_path(kernels):
    names = kernels.int4_kernels()
    assert names[-1] == "scalar"
    flags = kernel_flags(kernels)
    assert (names[0] == "avx512vnni") == ({"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma", "f16c"} <= flags)
    assert ("avx2" in names) == ({"avx2", "fma", "f16c"} <= flags)


@pytest.mark.parametrize(("k", "n", "group"), SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_each_path_matches_the_reference_and_rows_do_not_depend_on_the_batch(kernels, k, n, group, symmetric):
    w, x, bias = _case(k, n, group, symmetric, seed=k * 31 + n + group + symmetric)
    dequantized = dequantize(w)
    for name in _kernel_names(kernels):
        kernels.set_int4_kernel(name)
        full = kernels.int4_linear(x, w.qweight, w.scales, w.zeros, bias, group)
        want = reference(x, w, bias)
        # float32 accumulation of exact block sums: relative to the sum of the terms' sizes
        size = (x.abs().double() @ dequantized.abs().double().T) + bias.abs().double()
        assert bool(((full.double() - want).abs() <= 2e-6 * size + 1e-6).all()), name
        # and the int8 activations stay close to the float product
        assert bool(((full - F.linear(x, dequantized, bias)).abs() <= 0.02 * size.float() + 1e-4).all()), name
        for m in range(1, 18):
            alone = kernels.int4_linear(x[:m].contiguous(), w.qweight, w.scales, w.zeros, bias, group)
            assert torch.equal(alone, full[:m]), (name, m)
        for r in (0, 5, 16):  # a row on its own, at another place of the tiles
            assert torch.equal(kernels.int4_linear(x[r : r + 1].contiguous(), w.qweight, w.scales, w.zeros, bias,
                                                   group), full[r : r + 1]), (name, r)
        without_bias = kernels.int4_linear(x, w.qweight, w.scales, w.zeros, None, group)
        assert torch.allclose(without_bias + bias, full, atol=1e-5), name


def test_the_torch_operator_is_the_same_kernel(kernels):
    w, x, bias = _case(200, 37, 128, False, seed=3)
    kernels.set_int4_kernel(kernels.int4_kernels()[0])
    assert torch.equal(torch.ops.pagedserve.int4_linear(x, w.qweight, w.scales, w.zeros, bias, 128),
                       kernels.int4_linear(x, w.qweight, w.scales, w.zeros, bias, 128))


def test_int4_linear_forward_runs_the_kernel_then_the_float_path(kernels):
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 37)
    module = Int4Linear.from_linear(linear, 32, symmetric=True)
    kernels.set_int4_kernel(kernels.int4_kernels()[0])
    limit = int(torch.ops.pagedserve.int4_kernel_max_rows())
    small = torch.randn(3, 200)
    assert torch.equal(module(small), kernels.int4_linear(small, module.qweight, module.scales, None, module.bias, 32))
    large = torch.randn(limit + 1, 200)
    assert torch.equal(module(large), F.linear(large, dequantize(module.weights), module.bias))


def test_bad_shapes_are_refused(kernels):
    w, x, bias = _case(200, 37, 128, True, seed=4)
    with pytest.raises(RuntimeError, match="group size 32 and padded width 256 do not fit 200 inputs"):
        kernels.int4_linear(x, w.qweight, w.scales, None, bias, 32)
    with pytest.raises(RuntimeError, match="unknown kernel 'avx9'"):
        kernels.set_int4_kernel("avx9")


@pytest.mark.parametrize(("model_name", "method", "lm_head"), [
    ("llama-gqa", "int4", False), ("qwen2", "int4_asym", False), ("qwen3", "int4_g128", False),
    ("llama-mha-odd", "int4_g128_asym", True)])
@pytest.mark.parametrize("pack", [False, True])
def test_fused_step_with_int4_weights_equals_the_eager_int4_forward(tiny_checkpoint, model_name, method, lm_head,
                                                                    pack):
    """The fused CPU step reads the int4 layers' codes, scales and zero points itself (no
    dequantized copy) and runs the kernel that the eager forward runs: unpacked, the one
    `Int4Linear` runs for a few rows; packed at load (the CPU default), the packed int4 product
    of every row count. One decode step of 3 sequences gives the eager forward's hidden
    states, KV and logits, and its greedy tokens; packed, with the C++ element-wise ops, the
    same bits."""
    from pagedserve import LLM

    from engine_helpers import eager_then_fused

    engine = LLM(str(tiny_checkpoint(model_name)), kv_cache_memory=1 << 22, quantization=method,
                 quantize_lm_head=lm_head, pack_cpu_weights=pack).engine
    weights = engine.runner.model.decoder_weights()
    assert weights is not None and weights.layers[0].qkv.dtype == torch.uint8
    assert weights.layers[0].qkv.dim() == (4 if pack else 2)
    assert weights.layers[0].down_scale is not None and weights.layers[0].down_scale.dim() == (3 if pack else 2)
    assert (weights.layers[0].qkv_zeros is not None) == method.endswith("_asym")
    assert (weights.lm_head.dtype == torch.uint8) == lm_head
    config, fused = engine.config, engine.runner.fused_decoder
    assert fused is not None
    limit = 1 << 30 if pack else int(torch.ops.pagedserve.int4_kernel_max_rows())
    assert fused.max_batch == min(config.fused_decode_max_batch, config.max_num_seqs, limit)
    assert_fused_step_equals_eager(engine)
    if pack:
        with torch.inference_mode():
            eager, eager_kv, _, hidden = eager_then_fused(engine)
            assert torch.equal(hidden, eager)
            assert torch.equal(fused.logits(hidden), engine.runner.model.compute_logits(eager))


@pytest.mark.parametrize(("group", "symmetric"), [(32, False), (128, True)])
def test_unpacking_each_weight_tile_once_gives_the_same_bits(kernels, group, symmetric):
    """The VNNI and AVX2 kernels unpack each tile of weight rows once for many activation rows
    (above set_int4_unpack_rows), else once per group of 4 rows: the same operations, the same
    bits, for every kernel this CPU runs (the scalar one has no unpacked path: trivially equal)."""
    w, x, bias = _case(300, 37, group, symmetric, seed=11)
    x = torch.cat([x, x * 0.5, -x])  # 51 rows
    previous = kernels.set_int4_unpack_rows(1 << 30)
    try:
        for name in _kernel_names(kernels):
            kernels.set_int4_kernel(name)
            kernels.set_int4_unpack_rows(1 << 30)
            per_group = kernels.int4_linear(x, w.qweight, w.scales, w.zeros, bias, group)
            kernels.set_int4_unpack_rows(0)
            assert torch.equal(kernels.int4_linear(x, w.qweight, w.scales, w.zeros, bias, group), per_group), name
    finally:
        kernels.set_int4_unpack_rows(previous)
        kernels.set_int4_kernel(kernels.int4_kernels()[0])
    with pytest.raises(RuntimeError, match="a row count"):
        kernels.set_int4_unpack_rows(-1)


@pytest.mark.parametrize("group", [32, 128])
def test_whole_zero_points_in_sixteenths_give_the_symmetric_bits(kernels, group):
    """Zero points are stored in sixteenths. A symmetric layer given explicitly (zeros of 128:
    8 steps) runs the zero-point paths of every kernel, unpacked and packed, in registers and
    unpacked once per tile, and gives the same bits as the symmetric paths: 16 times the exact
    sum times the scale / 16 is the same float product."""
    from pagedserve.kernels.cpu_packed import pack_int4_weight

    w, x, bias = _case(300, 37, group, True, seed=5 + group)
    x = torch.cat([x, x * 0.5, -x])  # 51 rows: every tile shape, and the unpacked paths
    zeros = torch.full(w.scales.shape, 128, dtype=torch.uint8)
    try:
        for name in _kernel_names(kernels):
            kernels.set_int4_kernel(name)
            for rows in (1, 3, 4, 51):
                want = kernels.int4_linear(x[:rows], w.qweight, w.scales, None, bias, group)
                assert torch.equal(kernels.int4_linear(x[:rows], w.qweight, w.scales, zeros, bias, group), want), name
        codes, scales, _ = pack_int4_weight(w.qweight, w.scales, None)
        _, _, packed_zeros = pack_int4_weight(w.qweight, w.scales, zeros)
        for isa in ("avx512vnni", "avxvnni", "avx2", "scalar"):
            kernels.set_packed_int8_isa(isa)
            for rows in (1, 3, 4, 51):
                want = kernels.packed_int4_linear(x[:rows], codes, scales, None, 37, bias)
                got = kernels.packed_int4_linear(x[:rows], codes, scales, packed_zeros, 37, bias)
                assert torch.equal(got, want), (isa, rows)
    finally:
        kernels.set_int4_kernel(kernels.int4_kernels()[0])
        kernels.set_packed_int8_isa("avx512vnni")


def test_the_row_limit_can_be_set_and_given_back(kernels):
    """set_int4_kernel_max_rows (tests, benchmarks): a limit replaces the selected kernel's own
    until 0 gives it back; Int4Linear reads it through torch.ops.pagedserve.int4_kernel_max_rows."""
    own = int(torch.ops.pagedserve.int4_kernel_max_rows())
    previous = kernels.set_int4_kernel_max_rows(5)
    try:
        assert previous == 0 and int(torch.ops.pagedserve.int4_kernel_max_rows()) == 5
    finally:
        kernels.set_int4_kernel_max_rows(previous)
    assert int(torch.ops.pagedserve.int4_kernel_max_rows()) == own
    with pytest.raises(RuntimeError, match="a row count"):
        kernels.set_int4_kernel_max_rows(-1)


@pytest.mark.parametrize(("k", "n", "group"), SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_the_packed_product_matches_the_reference_with_the_same_bits_everywhere(kernels, k, n, group, symmetric):
    """The packed int4 product (kernels/cpu_packed.py's PackedInt4Linear, csrc/cpu_packed_int8.cpp):
    every kernel gives the same bits, each row's bits do not depend on its batch, and the
    numbers are the reference's (the same int8 activations and exact block sums)."""
    from pagedserve.kernels.cpu_packed import pack_int4_weight

    w, x, bias = _case(k, n, group, symmetric, seed=k * 7 + n + group + symmetric)
    codes, scales, zeros = pack_int4_weight(w.qweight, w.scales, w.zeros)
    assert codes.shape == (-(-n // 16), w.qweight.shape[1] // 4, 16, 4) and scales.shape == (-(-n // 16),
                                                                                            w.scales.shape[1], 16)
    # the layout's own float16 scales, regrouped by panel
    assert w.scales.dtype == scales.dtype == torch.float16
    assert torch.equal(scales.permute(0, 2, 1).reshape(-1, w.scales.shape[1])[:n], w.scales)
    results = {}
    try:
        for isa in ("avx512vnni", "avxvnni", "avx2", "scalar"):
            kernels.set_packed_int8_isa(isa)
            results[isa] = kernels.packed_int4_linear(x, codes, scales, zeros, n, bias)
            for m in (1, 2, 3, 5, 8):
                for start in range(0, x.shape[0], m):
                    part = kernels.packed_int4_linear(x[start:start + m], codes, scales, zeros, n, bias)
                    assert torch.equal(part, results[isa][start:start + m]), (isa, m, start)
            # 51 rows: from 32 rows the AVX-512 kernel widens each tile's codes once (the same bits)
            many = kernels.packed_int4_linear(torch.cat([x, x, x]), codes, scales, zeros, n, bias)
            assert torch.equal(many, torch.cat([results[isa]] * 3)), isa
    finally:
        kernels.set_packed_int8_isa("avx512vnni")
    for isa, y in results.items():
        assert torch.equal(y, results["scalar"]), isa
    size = (x.abs().double() @ dequantize(w).abs().double().T) + bias.abs().double()
    assert bool(((results["scalar"].double() - reference(x, w, bias)).abs() <= 2e-6 * size + 1e-6).all())
    # the bias is one float add after the chain
    assert torch.equal(kernels.packed_int4_linear(x, codes, scales, zeros, n) + bias, results["avx512vnni"])


def test_packing_takes_float16_scales_only():
    from pagedserve.kernels.cpu_packed import pack_int4_weight

    qweight = torch.zeros(16, 16, dtype=torch.uint8)
    scales = torch.tensor([[1 / 3], [65504.0], [-2.0**-24]] + [[0.5]] * 13)
    _, packed, _ = pack_int4_weight(qweight, scales.half(), None)
    assert packed.dtype == torch.float16 and packed.shape == (1, 1, 16)
    assert packed[0, 0, :3].tolist() == [torch.tensor(1 / 3).half().item(), 65504.0, -(2.0**-24)]
    with pytest.raises(TypeError, match="int4 scales are float16"):
        pack_int4_weight(qweight, scales, None)  # float32: the layout never holds it, packing does not guess


def test_the_packed_module_refuses_a_wrong_depth(kernels):
    from pagedserve.kernels.cpu_packed import PackedInt4Linear, is_int4_linear

    torch.manual_seed(0)
    module = Int4Linear.from_linear(torch.nn.Linear(200, 37), 128, symmetric=False)
    assert is_int4_linear(module)
    packed = PackedInt4Linear(module)
    x = torch.randn(4, 200)
    assert torch.allclose(packed(x), module(x), atol=1e-4)
    with pytest.raises(ValueError, match="a packed linear of 200 inputs got rows of 199"):
        packed(torch.randn(4, 199))  # the same padded depth (256): only the module can tell
    with pytest.raises(RuntimeError, match="packed int4 weight"):  # the operator itself: past the padded depth
        torch.ops.pagedserve.packed_int4_linear(torch.randn(4, 300), packed.packed, packed.scales, packed.zeros, 37)


def test_packed_int4_weights_without_the_mlp_width_do_not_run_fused(tiny_checkpoint):
    """A model plugin that gives no `intermediate_size` keeps packed int4 models out of the fused
    step (the padded panels do not tell the width), with the reason; with it they run fused."""
    import dataclasses

    from pagedserve import LLM
    from pagedserve.kernels.cpu_decode import fused_decode_supported

    runner = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, quantization="int4").engine.runner
    weights = runner.model.decoder_weights()
    assert weights.intermediate_size == 128 and weights.layers[0].down_scale.dim() == 3
    assert fused_decode_supported(weights, torch.float32, torch.device("cpu")) is None
    reason = fused_decode_supported(dataclasses.replace(weights, intermediate_size=None), torch.float32,
                                    torch.device("cpu"))
    assert reason == "packed int4 weights need DecoderWeights.intermediate_size (the model plugin gives none)"
