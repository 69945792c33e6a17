"""Triton elementwise kernels against their torch references (the interpreter on CPU).

Random inputs, outputs poisoned with NaN first so an element the kernel never writes fails."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from pagedserve.kernels import triton_ops as ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    x, res, w = _rand(5, hidden, dtype=dtype), _rand(5, hidden, dtype=dtype, seed=1), _rand(hidden, dtype=dtype, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    out, new_res = ops.rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = ops.rms_norm_ref(x, w, 1e-6, res)
    # exact in float32; in bfloat16 the interpreter's float32→bfloat16 cast may round the
    # other way from torch's round-to-nearest-even, one unit in the last place
    exact = dtype == torch.float32
    torch.testing.assert_close(new_res, ref_res, rtol=0 if exact else 8e-3, atol=0 if exact else 0)
    torch.testing.assert_close(out, ref_out, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_rms_norm_over_heads():
    """Qwen3 normalizes q and k per head: [n, heads, head_dim] rows."""
    x, w = _rand(3, 7, 16), _rand(16, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = _rand(4, 2 * 80, dtype=dtype)
    out = ops.silu_and_mul(x, block=32)  # 80 = 2 full blocks and a partial one
    assert not out.isnan().any()
    torch.testing.assert_close(out, ops.silu_and_mul_ref(x), rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads", [1, 3, 8])
def test_rotary_default_and_llama3(head_dim, num_heads):
    from pagedserve.kernels.reference_ops import TorchOps
    from pagedserve.plugins.models.rotary import RotaryEmbedding

    for params in ({"rope_theta": 10000.0, "rope_type": "default"},
                   {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}):
        rope = RotaryEmbedding(head_dim, 300, params, torch.float32, TorchOps()).to(DEVICE)
        positions = torch.tensor([0, 7, 63, 64, 299], device=DEVICE)
        x = _rand(5, num_heads, head_dim)
        out = ops.rotary(positions, x, rope.cos, rope.sin)
        torch.testing.assert_close(out, ops.rotary_ref(positions, x, rope.cos, rope.sin), rtol=1e-5, atol=1e-5)
        # and the model's own layer computes the same
        torch.testing.assert_close(out, rope(positions, x, x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 1, 64), (32, 8, 128), (16, 3, 64)])
def test_kv_store_writes_exactly_the_slots(dtype, block_size, num_kv_heads, head_dim):
    cache = torch.full((2, 6, block_size, num_kv_heads, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    ref = cache.clone()
    slots = torch.tensor([3, block_size + 5, 4 * block_size + block_size - 1, 2], device=DEVICE, dtype=torch.int32)
    key, value = _rand(4, num_kv_heads, head_dim, dtype=dtype), _rand(4, num_kv_heads, head_dim, dtype=dtype, seed=1)
    ops.kv_store(key, value, cache, slots, block=64)
    ops.kv_store_ref(key, value, ref, slots)
    torch.testing.assert_close(cache, ref, rtol=0, atol=0, equal_nan=True)
    written = ~cache.isnan().all(dim=-1).all(dim=-1)  # [2, blocks, block_size]
    assert int(written.sum()) == 2 * len(slots)  # nothing else was touched


def test_kv_store_skips_padding_slots():
    """Slot -1 marks a padding row of a CUDA graph batch: nothing is written for it."""
    cache = torch.full((2, 3, 16, 2, 64), float("nan"), device=DEVICE)
    ref = cache.clone()
    slots = torch.tensor([5, -1, 20, -1], device=DEVICE)
    key, value = _rand(4, 2, 64), _rand(4, 2, 64, seed=1)
    ops.kv_store(key, value, cache, slots, block=64)
    real = slots >= 0
    ops.kv_store_ref(key[real], value[real], ref, slots[real])
    torch.testing.assert_close(cache, ref, rtol=0, atol=0, equal_nan=True)
    assert int((~cache.isnan().all(dim=-1).all(dim=-1)).sum()) == 2 * 2
