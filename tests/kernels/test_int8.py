"""int8 weight-only quantization: the rounding bound, each int8 kernel against its float
reference, and the fused decode step with int8 weights against the eager int8 forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.plugins.int8_quantization import (
    Int8Linear,
    Int8Quantization,
    dequantize,
    quantize_per_channel,
)

from engine_helpers import assert_fused_step_equals_eager
from int8_reference import (
    ACT_BLOCK,
    assert_equals_the_reference,
    int8_int8_linear_ref,
    quantize_activations_ref,
)

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")
#: the int8 × int8 kernels of this CPU (kernels/csrc/cpu_int8_gemv.cpp: avx512vnni, avxvnni,
#: avx2, whichever the CPU has), best first; "float" (the weights widened to float32) is not one
INT8_INT8_KERNELS = [] if cpu_kernels() is None else [k for k in cpu_kernels().int8_kernels() if k != "float"]
needs_int8_int8 = pytest.mark.skipif(not INT8_INT8_KERNELS,
                                     reason="no int8 × int8 kernel here (it needs x86 with AVX2 + FMA at least)")


def _int8_int8_on() -> bool:
    """Whether the int8 linear of the extension runs an int8 × int8 kernel now (quantized activations)."""
    kernels = cpu_kernels()
    return kernels is not None and kernels.int8_kernel() != "float"


@contextlib.contextmanager
def _select(kernel: str) -> Iterator[None]:
    """That kernel of the int8 linear for the duration (the previous one restored after)."""
    previous = cpu_kernels().set_int8_kernel(kernel)
    try:
        yield
    finally:
        cpu_kernels().set_int8_kernel(previous)


@pytest.fixture
def float_path():
    """The float path of the int8 kernel (weights widened to float32) for this test, where an
    int8 × int8 kernel would otherwise run; the switch is restored after it."""
    if cpu_kernels() is None:
        yield
        return
    with _select("float"):
        yield


def activation_bound(x, q, scale) -> torch.Tensor:
    """|int8 × int8 kernel - x · dequantized(w)ᵀ| per output, from the activation quantization step:
    Σ_k (d[r, k] / 2) · |q[o, k]·scale[o]|, plus 1e-5 of Σ_k |x·w| for float32 rounding (the
    int8 products are summed exactly in int32; each block's sum is scaled in float32)."""
    _, d = quantize_activations_ref(x)
    w = q.double().abs() * scale.double()[:, None]
    return (d.double() / 2) @ w.T + 1e-5 * (x.double().abs() @ w.T) + 1e-6

#: |int8 kernel - F.linear(x, dequantized w)|: both sum the same products of float32 numbers
#: (int8 values and the scale are exact in float32), in another order, over K <= 1536 terms
#: of |x·w| <= ~4·127: float32 rounding of such sums stays far below 1e-4 relative.
RTOL, ATOL = 1e-4, 1e-3


def _check_rounding_bound(w: torch.Tensor) -> None:
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    error = (dequantize(q, scale) - w.float()).abs()
    # the int8 rounding bound, with a float32 ulp of slack for the division and the product
    bound = scale[:, None] / 2 + w.float().abs() * 2 ** -22
    assert bool((error <= bound).all()), float((error - bound).max())


@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (960, 576), (3, 1000)])
def test_quantize_dequantize_error_within_half_a_scale_random(shape):
    torch.manual_seed(shape[0])
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3  # rows of different ranges
    _check_rounding_bound(w)


def test_quantize_zero_rows_and_extremes():
    w = torch.zeros(4, 10)
    w[1, 3] = -5.0  # the extreme of its row maps to -127 exactly
    w[2] = 1e-30  # tiny but not zero
    q, scale = quantize_per_channel(w)
    assert torch.equal(q[0], torch.zeros(10, dtype=torch.int8)) and scale[0] == 1.0
    assert q[1, 3] == -127
    assert torch.equal(q[2], torch.full((10,), 127, dtype=torch.int8))
    _check_rounding_bound(w)


def test_quantize_dequantize_error_within_half_a_scale_real_weights(tiny_checkpoint):
    """The real weights of a checkpoint (here a tiny random Llama's, as saved; the default
    model's are checked by tests/engine/test_quantization.py when it is pulled)."""
    from safetensors.torch import load_file

    weights = load_file(str(tiny_checkpoint("llama-gqa") / "model.safetensors"))
    checked = 0
    for name, tensor in weights.items():
        if tensor.dim() == 2 and "proj" in name:
            _check_rounding_bound(tensor)
            checked += 1
    assert checked == 2 * 7  # q k v o gate up down, in each of the two layers


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 40])
@pytest.mark.parametrize(("k", "n"), [(70, 131), (577, 33), (15, 3), (1536, 50)])
def test_int8_linear_kernel_equals_the_dequantized_f_linear(rows, k, n, float_path):
    """The float path (int8 weights widened to float32, float32 activations): K and N off
    multiples of 16 (the AVX-512 tail) and of 8; M across the 8-row groups."""
    torch.manual_seed(rows * 1000 + k)
    x, w, bias = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    q, scale = quantize_per_channel(w)
    reference = dequantize(q, scale)
    kernels = cpu_kernels()
    torch.testing.assert_close(kernels.small_linear_int8(x, q, scale), F.linear(x, reference), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(kernels.small_linear_int8(x, q, scale, bias), F.linear(x, reference, bias),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.ops.pagedserve.int8_linear(x, q, scale, bias), F.linear(x, reference, bias),
                               rtol=RTOL, atol=ATOL)
    assert torch.equal(torch.ops.pagedserve.int8_dequantize(q, scale), reference)


#: batch sizes that put a row in groups of every size and position (up to 6 rows on the float
#: path, 4 on the int8 × int8 kernels)
BATCHES = [2, 3, 5, 8, 13, 17]


def _rows_alone_and_together(linear, x: torch.Tensor) -> None:
    """Each row of x computed alone is bitwise the row computed with m - 1 others, for every m of
    BATCHES and two windows of x: a sequence's greedy tokens must not depend on its batch."""
    alone = torch.cat([linear(x[r:r + 1]) for r in range(x.shape[0])])
    for m in BATCHES:
        for start in (0, x.shape[0] - m):
            assert torch.equal(linear(x[start:start + m]), alone[start:start + m]), (m, start)


@needs_kernels
@pytest.mark.parametrize("kernel", ["float", "avx2", "avxvnni", "avx512vnni"])
@pytest.mark.parametrize(("k", "n"), [(200, 131), (576, 33), (70, 7), (1, 3), (1536, 65), (96, 9)])
def test_int8_linear_rows_are_batch_invariant(k, n, kernel):
    """Every path of the int8 linear this CPU has (the float path, and each int8 × int8 kernel):
    K off multiples of 64, 32 and 16, N odd (the 4- and 2-row weight tiles and their 1-row
    rest); and within their bounds of x · dequantized(w)ᵀ."""
    kernels = cpu_kernels()
    if kernel not in kernels.int8_kernels():
        pytest.skip(f"this CPU (or the build's -march) cannot run the {kernel} kernel")
    g = torch.Generator().manual_seed(k * 100 + n)
    x = _rows_of_mixed_ranges(20, k, k + n)
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g)
    with _select(kernel):
        _rows_alone_and_together(lambda rows: kernels.small_linear_int8(rows, q, scale), x)
        _rows_alone_and_together(lambda rows: torch.ops.pagedserve.int8_linear(rows, q, scale, bias), x)
        y = kernels.small_linear_int8(x, q, scale)
        if kernel != "float":
            assert_equals_the_reference(y, x, q, scale)
        else:
            torch.testing.assert_close(y, F.linear(x, dequantize(q, scale)), rtol=RTOL, atol=ATOL)


def _rows_of_mixed_ranges(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activation rows whose blocks of 32 span four orders of magnitude (and a zero block), so
    that one scale per row instead of per block, or blocks cut in the wrong place, would break
    the per-block bound."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    blocks = -(-k // ACT_BLOCK)
    ranges = 10.0 ** torch.randint(-3, 2, (rows, blocks), generator=g).float()
    x *= ranges.repeat_interleave(ACT_BLOCK, dim=1)[:, :k]
    if k >= 2 * ACT_BLOCK:
        x[0, ACT_BLOCK:2 * ACT_BLOCK] = 0.0
    return x


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 70, 131), (3, 577, 33), (17, 1536, 50), (2, 15, 3)])
def test_activation_quantization_reference_within_its_bound(rows, k, n):
    """The quantized-activation product (computed in torch, as the int8 × int8 kernels do) against the
    exact product, within the bound of the activation step; and against the float weights
    within both steps' bounds (the weight step adds Σ_k |x|·scale/2). Runs on every CPU."""
    x = _rows_of_mixed_ranges(rows, k, rows * 7 + k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    q, scale = quantize_per_channel(w)
    qx, d = quantize_activations_ref(x)
    assert int(qx.abs().max()) <= 127
    assert bool(((qx * d - x).abs() <= d / 2 + x.abs() * 2 ** -22).all())
    got = int8_int8_linear_ref(x, q, scale)
    exact = x.double() @ dequantize(q, scale).double().T
    assert bool(((got - exact).abs() <= activation_bound(x, q, scale)).all())
    weight_step = x.double().abs() @ (scale.double()[:, None] / 2).expand(n, k).T
    assert bool(((got - x.double() @ w.double().T).abs() <= activation_bound(x, q, scale) + weight_step).all())


@needs_int8_int8
@pytest.mark.parametrize("kernel", INT8_INT8_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 40])
@pytest.mark.parametrize(("k", "n"), [(70, 131), (577, 33), (15, 3), (1536, 50), (64, 7), (1, 5), (128, 66), (32, 2)])
def test_int8_int8_kernel_within_the_activation_quantization_bound(rows, k, n, kernel):
    """Each int8 × int8 kernel of this CPU: K off multiples of 64 (the AVX-512 masked tail) and
    of 32 (a partial activation block, the 256-bit kernels' copied tail), N off multiples of 4
    and 2 (the weight tiles), M across the 4-row groups: within the activation step's bound of
    the double-precision product with the dequantized weights, and equal, to float32
    rounding, to the same quantization done in torch."""
    kernels = cpu_kernels()
    x = _rows_of_mixed_ranges(rows, k, rows * 1000 + k)
    g = torch.Generator().manual_seed(n)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, scale = quantize_per_channel(w)
    exact = x.double() @ dequantize(q, scale).double().T
    bound = activation_bound(x, q, scale)
    with _select(kernel):
        for y in (kernels.small_linear_int8(x, q, scale), torch.ops.pagedserve.int8_linear(x, q, scale, None)):
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert bool(((y.double() - exact).abs() <= bound).all()), float(((y.double() - exact).abs() - bound).max())
            assert_equals_the_reference(y, x, q, scale)
        with_bias = torch.ops.pagedserve.int8_linear(x, q, scale, bias)
    assert bool(((with_bias.double() - exact - bias.double()).abs() <= bound + 1e-5).all())


@needs_int8_int8
@pytest.mark.parametrize("kernel", INT8_INT8_KERNELS)
def test_int8_int8_kernel_takes_every_int8_weight_and_the_extreme_activations(kernel):
    """Weights of the whole int8 range, -128 included (quantize_per_channel never writes it, but
    the kernel takes any int8 tensor: AVX2's sign trick gives |-128| = 128 as an unsigned byte),
    against activation blocks whose quantized values are all ±127 (the largest int16 pair sums
    of `vpmaddubsw`, 2·128·127): the result is exact to float32 rounding."""
    kernels = cpu_kernels()
    k, n = 96, 6
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1] = 127
    q[2, ::2], q[2, 1::2] = -128, 127
    q[3] = torch.arange(k, dtype=torch.int64).remainder(256).sub(128).to(torch.int8)  # every value once or so
    q[4] = torch.randint(-128, 128, (k,), generator=torch.Generator().manual_seed(4), dtype=torch.int8)
    q[5] = 0
    scale = torch.rand(n, generator=torch.Generator().manual_seed(5)) + 0.5
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -3.0
    x[2, 1::2] = 3.0
    x[3] = torch.where(q[3] < 0, -2.0, 2.0)  # against q[3], every product |q|·127 > 0
    with _select(kernel):
        y = kernels.small_linear_int8(x, q, scale)
    assert_equals_the_reference(y, x, q, scale)
    # each of these rows quantizes to ±127 exactly (d = max|x| / 127): the sums are known
    expected = (x.double() @ q.double().T) * scale.double()
    assert bool(((y.double() - expected).abs() <= 1e-5 * expected.abs() + 1e-6).all())


@needs_int8_int8
def test_int8_kernel_switch():
    """`set_int8_kernel` selects the path for later calls and returns the previous name; the
    best kernel of the CPU is the default, and a kernel the CPU lacks is refused."""
    kernels = cpu_kernels()
    best = INT8_INT8_KERNELS[0]
    assert kernels.int8_kernels()[0] == best and kernels.int8_kernels()[-1] == "float"
    before = kernels.set_int8_kernel(best)  # an engine loaded earlier in this process may have chosen another
    x = _rows_of_mixed_ranges(2, 100, 1)
    q, scale = quantize_per_channel(torch.randn(9, 100))
    assert kernels.set_int8_kernel("float") == best
    try:
        assert kernels.int8_kernel() == "float"
        torch.testing.assert_close(kernels.small_linear_int8(x, q, scale), F.linear(x, dequantize(q, scale)),
                                   rtol=RTOL, atol=ATOL)
    finally:
        assert kernels.set_int8_kernel(best) == "float"
    assert_equals_the_reference(kernels.small_linear_int8(x, q, scale), x, q, scale)
    with pytest.raises(RuntimeError, match="unknown kernel 'int4'"):
        kernels.set_int8_kernel("int4")
    missing = [k for k in ("avx2", "avxvnni", "avx512vnni") if k not in kernels.int8_kernels()]
    for name in missing:
        with pytest.raises(RuntimeError, match="this CPU cannot run"):
            kernels.set_int8_kernel(name)
    assert kernels.int8_kernel() == best
    kernels.set_int8_kernel(before)


@needs_kernels
def test_int8_linear_kernel_refuses_wrong_dtypes_and_shapes():
    kernels = cpu_kernels()
    q, scale = quantize_per_channel(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="int8 w"):
        kernels.small_linear_int8(torch.randn(2, 16), q.float(), scale)
    with pytest.raises(RuntimeError, match="scale"):
        kernels.small_linear_int8(torch.randn(2, 16), q, scale[:4])
    with pytest.raises(RuntimeError, match="x \\[m, in\\]"):
        kernels.small_linear_int8(torch.randn(2, 15), q, scale)


@pytest.mark.parametrize("rows", [1, 3, 17, 100, 129])
@pytest.mark.parametrize("with_kernels", [True, False])
def test_int8_module_forward_equals_the_dequantized_linear(rows, with_kernels, monkeypatch):
    """Both sides of the switch-over (the C++ kernel up to 16 rows, 48 or 128 with an int8 × int8 kernel;
    dequantize + F.linear above), and the plain torch fallback when the extension is not loaded."""
    import pagedserve.plugins.int8_quantization as quantization

    if with_kernels and cpu_kernels() is None:
        pytest.skip("the CPU kernels need a C++ compiler")
    if not with_kernels:
        monkeypatch.setattr(quantization, "_cpu_op", lambda name: None)
    torch.manual_seed(rows)
    linear = torch.nn.Linear(67, 45, bias=True)
    module = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 67)
    expected = F.linear(x, dequantize(module.weight, module.weight_scale), linear.bias)
    if with_kernels and rows <= quantization.int8_kernel_max_rows() and _int8_int8_on():
        # the int8 × int8 kernel's activations are int8 too: the same quantization done in torch
        expected = int8_int8_linear_ref(x, module.weight, module.weight_scale, linear.bias.detach()).float()
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(module(x.view(1, rows, 67)), expected.view(1, rows, 45), rtol=RTOL, atol=ATOL)


def test_plugin_replaces_every_projection_and_reports_bytes(tiny_checkpoint):
    from pagedserve import LLM
    from pagedserve.kernels.cpu_packed import PackedInt8Linear, PackedLinear

    for pack in (False, True):
        runner = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, quantization="int8",
                     pack_cpu_weights=pack).engine.runner
        model = runner.model
        assert not any(isinstance(m, torch.nn.Linear) for m in model.layers.modules())
        # on CPU the loader packs the int8 linears for the packed int8 product (when it is built)
        kind = PackedInt8Linear if pack and cpu_kernels() is not None else Int8Linear
        quantized = [m for m in model.modules() if isinstance(m, kind)]
        assert len(quantized) == 2 * 4  # qkv, o, gate_up, down per layer
        # the LM head stays float by default (packed on CPU)
        assert isinstance(model.lm_head, PackedLinear if pack and cpu_kernels() is not None else torch.nn.Linear)
    report = Int8Quantization().quantize(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()))
    assert (report.num_linear, report.float_bytes, report.quantized_bytes, report.lm_head) == (1, 8 * 16 * 4,
                                                                                              8 * 16 + 8 * 4, False)


@needs_kernels
@pytest.mark.parametrize(("model_name", "lm_head"), [("llama-gqa", False), ("qwen2", False), ("qwen3", False),
                                                     ("llama-tied", True), ("llama-mha-odd", True)])
def test_fused_step_with_int8_weights_equals_the_eager_int8_forward(tiny_checkpoint, model_name, lm_head,
                                                                    float_path):
    """One decode step of 3 sequences: hidden states, the KV written and the logits of the
    fused step with int8 weights against the model's forward with the same int8 modules, on
    the float path of the int8 linear. (With an int8 × int8 kernel both sides run the same
    kernel, but its inputs, RMSNorm's, the attention's, SiLU·mul's, differ by float rounding
    between the C++ step and the torch forward, and an activation that close to a rounding
    boundary of the quantizer moves by a whole step d: on qwen3 with the AVX2 kernel the
    hidden states differed by up to 4e-3, against 1.7e-6 on the float path. The kernels
    themselves are checked above, every kernel against the torch reference.)"""
    from pagedserve import LLM

    engine = LLM(str(tiny_checkpoint(model_name)), kv_cache_memory=1 << 22, quantization="int8",
                 quantize_lm_head=lm_head, int8_kernel="float", pack_cpu_weights=False).engine
    runner = engine.runner
    weights = runner.model.decoder_weights()
    assert weights.layers[0].qkv.dtype == torch.int8 and weights.layers[0].down_scale is not None
    assert (weights.lm_head_scale is not None) == lm_head
    assert_fused_step_equals_eager(engine)


def test_unknown_quantization_is_an_invalid_parameter():
    from pagedserve import LLM
    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.common.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="int3.*choices: int4, int4_asym, int4_g128, int4_g128_asym, int8") as info:
        LLM(quantization="int3")
    assert info.value.param == "quantization"
    with pytest.raises(InvalidParameterError, match="unknown method ''; choices: int4, .*, int8"):
        EngineConfig(quantization="")
    assert EngineConfig(quantization="int8").quantization == "int8"


@needs_int8_int8
@pytest.mark.parametrize("kernel", INT8_INT8_KERNELS)
def test_the_int8_kernel_row_bound_per_kernel(kernel):
    """Up to 128 rows with AVX-512 VNNI, 48 with AVX-VNNI or AVX2, 16 on the float path."""
    import pagedserve.plugins.int8_quantization as quantization

    with _select(kernel):
        assert quantization.int8_kernel_max_rows() == {"avx512vnni": 128, "avxvnni": 48, "avx2": 48}[kernel]
    with _select("float"):
        assert quantization.int8_kernel_max_rows() == quantization.INT8_KERNEL_MAX_ROWS == 16
