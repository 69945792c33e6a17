"""The C++ element-wise ops of the eager forward on CPU (kernels/cpu_ops.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.kernels.reference_ops import TorchOps, rms_norm_ref, rotary_ref, silu_and_mul_ref
from pagedserve.kernels.selector import select_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")

#: row counts: one, a few, and enough that the work is split across threads (for_rows)
ROWS = [1, 3, 70, 300]


@pytest.fixture
def ops():
    from pagedserve.kernels.cpu_ops import CPUOps

    return CPUOps()


def test_the_cpu_backend_comes_with_the_cpu_ops():
    assert select_kernels("cpu", torch.device("cpu")).ops.name == "cpu"
    assert select_kernels("auto", torch.device("cpu")).ops.name == "cpu"
    assert select_kernels("torch", torch.device("cpu")).ops.name == "torch"


#: the most relative error of an RMSNorm output against float64, about 3 ulp: measured up to
#: 2.8e-7 (the torch ops: 0.6e-7); the float RSQRT of -ffast-math or a lost term would exceed it
NORM_RTOL = 3.5e-7


def assert_within(out: torch.Tensor, exact: torch.Tensor, rtol: float) -> None:
    error = ((out.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
    assert error <= rtol, error


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_is_within_three_ulp_and_sums_the_residual_exactly(ops, rows):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.rand(576) + 0.5
    x_before, residual_before = x.clone(), residual.clone()
    assert_within(ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x.double(), weight.double(), 1e-5), NORM_RTOL)
    out, total = ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(total, x + residual)  # one IEEE add per element
    assert_within(out, rms_norm_ref(total.double(), weight.double(), 1e-5), NORM_RTOL)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # the inputs are not written


def test_rms_norm_of_head_views_normalizes_each_head(ops):
    """Qwen3's q/k norms: [n, heads, head_dim] views into the fused qkv rows."""
    torch.manual_seed(0)
    qkv, weight = torch.randn(5, 3 * 64 + 2 * 64), torch.rand(64) + 0.5
    q = qkv[:, :192].view(5, 3, 64)
    out = ops.rms_norm(q, weight, 1e-6)
    assert out.shape == (5, 3, 64)
    assert_within(out, rms_norm_ref(q.double(), weight.double(), 1e-6), NORM_RTOL)


def test_zero_rows_give_empty_results(ops):
    weight, table = torch.ones(576), torch.randn(8, 64)
    assert ops.rms_norm(torch.randn(0, 576), weight, 1e-5).shape == (0, 576)
    out, total = ops.rms_norm(torch.randn(0, 576), weight, 1e-5, torch.randn(0, 576))
    assert out.shape == total.shape == (0, 576)
    assert ops.silu_and_mul(torch.randn(0, 16)).shape == (0, 8)
    q, k = ops.rotary(torch.zeros(0, dtype=torch.long), torch.randn(0, 9, 64), torch.randn(0, 3, 64), table, table)
    assert q.shape == (0, 9, 64) and k.shape == (0, 3, 64)


def test_rotary_of_a_transposed_query_is_copied_first(ops):
    """Heads that are not contiguous within a row take the copying path, with the same bits."""
    torch.manual_seed(3)
    q, k, table = torch.randn(9, 4, 64).transpose(0, 1), torch.randn(4, 3, 64), torch.randn(10, 64)
    positions = torch.tensor([0, 3, 9, 5])
    q_out, k_out = ops.rotary(positions, q, k, table, table)
    assert torch.equal(q_out, rotary_ref(positions, q, table, table))
    assert torch.equal(k_out, rotary_ref(positions, k, table, table))


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_of_qkv_views_has_the_references_bits(ops, rows):
    torch.manual_seed(rows)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(rows, heads, d), k.view(rows, kv_heads, d)
    angles = torch.arange(512).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.randint(0, 512, (rows,))
    before = qkv.clone()
    q_out, k_out = ops.rotary(positions, q, k, cos, sin)
    # two rounded products and a rounded sum, as torch: the reference's bits exactly
    assert torch.equal(q_out, rotary_ref(positions, q, cos, sin))
    assert torch.equal(k_out, rotary_ref(positions, k, cos, sin))
    assert torch.equal(qkv, before)  # the fused rows are not written
    q32, k32 = ops.rotary(positions.int(), q, k, cos, sin)
    assert torch.equal(q32, q_out) and torch.equal(k32, k_out)


def test_rotary_refuses_a_position_beyond_the_table(ops):
    q, k, table = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="beyond the rotary table"):
        ops.rotary(torch.tensor([0, 4]), q, k, table, table)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_the_reference(ops, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 1536) * 4
    x[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # silu: about 0 (e^200 is capped at e^80), 200, 0
    out = ops.silu_and_mul(x)
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all() and out[0, 0].abs() < 1e-30
    assert out[0, 1] == 200 * x[0, 1536 + 1] and out[0, 2] == 0


def test_each_row_has_the_same_bits_at_every_row_count(ops):
    """A row's result does not depend on how many rows share the call, nor on the thread split."""
    torch.manual_seed(1)
    n = 300
    x, residual, weight = torch.randn(n, 576), torch.randn(n, 576), torch.rand(576) + 0.5
    gate_up = torch.randn(n, 2 * 1536)
    q, k = torch.randn(n, 9, 64), torch.randn(n, 3, 64)
    table = torch.randn(1024, 64)
    positions = torch.randint(0, 1024, (n,))
    norm_all, sum_all = ops.rms_norm(x, weight, 1e-5, residual)
    act_all = ops.silu_and_mul(gate_up)
    q_all, k_all = ops.rotary(positions, q, k, table, table)
    for m in (1, 7, 113):
        norm, total = ops.rms_norm(x[:m], weight, 1e-5, residual[:m])
        assert torch.equal(norm, norm_all[:m]) and torch.equal(total, sum_all[:m])
        assert torch.equal(ops.silu_and_mul(gate_up[:m]), act_all[:m])
        q_m, k_m = ops.rotary(positions[:m], q[:m], k[:m], table, table)
        assert torch.equal(q_m, q_all[:m]) and torch.equal(k_m, k_all[:m])


def test_other_dtypes_take_the_torch_ops(ops):
    x, weight = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), TorchOps().rms_norm(x, weight, 1e-5))
    gate_up = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(ops.silu_and_mul(gate_up), TorchOps().silu_and_mul(gate_up))


@pytest.mark.parametrize("model_name", ["llama-gqa", "qwen2", "qwen3"])
def test_an_eager_decode_step_has_the_fused_steps_bits(tiny_checkpoint, model_name):
    """With packed float32 weights and these ops, the model's own forward computes each row
    as the fused decode step does: the same products, row functions and attention kernel, so
    the hidden states and the KV written are bitwise equal."""
    from pagedserve import LLM

    from engine_helpers import eager_then_fused

    engine = LLM(str(tiny_checkpoint(model_name)), kv_cache_memory=1 << 22).engine
    assert engine.runner.fused_decoder.packed and engine.runner.kernels.ops.name == "cpu"
    with torch.inference_mode():
        eager, eager_kv, before, fused = eager_then_fused(engine)
    assert torch.equal(fused, eager)
    for cache, expected, old in zip(engine.runner.kv_caches, eager_kv, before):
        assert torch.equal(cache, expected) and not torch.equal(cache, old)
