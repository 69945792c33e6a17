"""int8 weight-only quantization: the rounding bound, each int8 kernel against its float
reference, and the fused decode step with int8 weights against the eager int8 forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.plugins.quantization import (
    Int8Linear,
    Int8Quantization,
    dequantize,
    quantize_per_channel,
)

from engine_helpers import assert_fused_step_equals_eager

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")

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
    model's are checked by tests/worker/test_quantization.py when it is pulled)."""
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
def test_int8_linear_kernel_equals_the_dequantized_f_linear(rows, k, n):
    """K and N off multiples of 16 (the AVX-512 tail) and of 8; M across the 8-row groups."""
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


@pytest.mark.parametrize("rows", [1, 3, 17, 100])
@pytest.mark.parametrize("with_kernels", [True, False])
def test_int8_module_forward_equals_the_dequantized_linear(rows, with_kernels, monkeypatch):
    """Both sides of the switch-over (the C++ kernel up to 16 rows, dequantize + F.linear
    above), and the plain torch fallback when the extension is not loaded."""
    import pagedserve.plugins.quantization as quantization

    if with_kernels and cpu_kernels() is None:
        pytest.skip("the CPU kernels need a C++ compiler")
    if not with_kernels:
        monkeypatch.setattr(quantization, "_cpu_op", lambda name: None)
    torch.manual_seed(rows)
    linear = torch.nn.Linear(67, 45, bias=True)
    module = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 67)
    expected = F.linear(x, dequantize(module.weight, module.weight_scale), linear.bias)
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(module(x.view(1, rows, 67)), expected.view(1, rows, 45), rtol=RTOL, atol=ATOL)


def test_plugin_replaces_every_projection_and_reports_bytes(tiny_checkpoint):
    from pagedserve import LLM

    runner = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, quantization="int8").engine.runner
    model = runner.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.layers.modules())
    quantized = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(quantized) == 2 * 4  # qkv, o, gate_up, down per layer
    assert isinstance(model.lm_head, torch.nn.Linear)  # the LM head stays float by default
    report = Int8Quantization().quantize(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()))
    assert (report.num_linear, report.float_bytes, report.quantized_bytes, report.lm_head) == (1, 8 * 16 * 4,
                                                                                              8 * 16 + 8 * 4, False)


@needs_kernels
@pytest.mark.parametrize(("model_name", "lm_head"), [("llama-gqa", False), ("qwen2", False), ("qwen3", False),
                                                     ("llama-tied", True), ("llama-mha-odd", True)])
def test_fused_step_with_int8_weights_equals_the_eager_int8_forward(tiny_checkpoint, model_name, lm_head):
    """One decode step of 3 sequences: hidden states, the KV written and the logits of the
    fused step with int8 weights against the model's forward with the same int8 modules."""
    from pagedserve import LLM

    engine = LLM(str(tiny_checkpoint(model_name)), kv_cache_memory=1 << 22, quantization="int8",
                 quantize_lm_head=lm_head).engine
    runner = engine.runner
    weights = runner.model.decoder_weights()
    assert weights.layers[0].qkv.dtype == torch.int8 and weights.layers[0].down_scale is not None
    assert (weights.lm_head_scale is not None) == lm_head
    assert_fused_step_equals_eager(engine)


def test_unknown_quantization_is_an_invalid_parameter():
    from pagedserve import LLM
    from pagedserve.common.config import EngineConfig
    from pagedserve.common.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="int4.*choices: int8") as info:
        LLM(quantization="int4")
    assert info.value.param == "quantization"
    with pytest.raises(InvalidParameterError, match="choices: int8"):
        EngineConfig(quantization="")
    assert EngineConfig(quantization="int8").quantization == "int8"
