"""The quantized KV cache (int8 rows with their float32 scale; kernels/reference_ops.py):
the reference round trip, the torch and C++ attention backends and the fused CPU decode
step reading and writing int8 rows, against float references on odd shapes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_attention import CPUAttentionBackend, cpu_kernels
from pagedserve.kernels.reference_ops import (
    FP8_E4M3_MAX,
    dequantize_kv_rows,
    kv_row_width,
    kv_store_ref,
    quantize_kv_rows,
)
from pagedserve.kernels.torch_attention import TorchAttentionBackend

from attention_helpers import build_batch, dense_reference

needs_cpu_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")


def row_scales(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The float32 scale of every int8 row, [..., 1]."""
    return rows[..., head_dim:].contiguous().view(torch.float32)


@pytest.mark.parametrize("shape", [(1, 4), (7, 3, 12), (33, 20), (5, 2, 68)])
def test_int8_round_trip_is_within_half_a_step_of_each_row(shape):
    torch.manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 10  # rows of very different ranges
    x[..., 0] = 0.0
    rows = quantize_kv_rows(x, torch.int8)
    head_dim = shape[-1]
    assert rows.dtype == torch.int8 and rows.shape == (*shape[:-1], kv_row_width(head_dim, torch.int8))
    scale = row_scales(rows, head_dim)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    back = dequantize_kv_rows(rows, head_dim, torch.float32)
    # |err| <= scale / 2 per element (the float product adds at most an ulp of the value)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6) + 1e-7).all()
    assert rows[..., :head_dim].abs().max() <= 127
    # the largest |x| of every row is exactly ±127 steps
    assert torch.equal(rows[..., :head_dim].abs().amax(-1).long(), torch.full(shape[:-1], 127))


def test_a_zero_row_stores_zeros_and_a_zero_scale():
    rows = quantize_kv_rows(torch.zeros(3, 8), torch.int8)
    assert torch.equal(rows, torch.zeros(3, 12, dtype=torch.int8))
    assert torch.equal(dequantize_kv_rows(rows, 8, torch.float32), torch.zeros(3, 8))


def test_fp8_rows_have_no_scale_and_saturate():
    x = torch.tensor([[1000.0, -1000.0, 0.5, 3.0]])
    rows = quantize_kv_rows(x, torch.float8_e4m3fn)
    assert rows.shape == (1, 4) and kv_row_width(4, torch.float8_e4m3fn) == 4
    assert dequantize_kv_rows(rows, 4, torch.float32).tolist() == [[FP8_E4M3_MAX, -FP8_E4M3_MAX, 0.5, 3.0]]


SHAPES = [
    # (query lens, context lens, heads, kv heads, head_dim, block size): head_dim a multiple of 4,
    # context lengths not multiples of the block size, odd numbers of blocks
    ([1, 1, 1], [5, 33, 16], 4, 4, 20, 16),  # MHA decodes, one exactly a block
    ([1, 1, 7, 20], [40, 3, 7, 50], 6, 2, 36, 16),  # GQA 3: decodes + fresh prefill + chunk with context
    ([1, 1, 1, 1, 1], [100, 17, 64, 1, 77], 8, 1, 64, 8),  # GQA 8, 13 blocks of 8 for the longest
    ([1, 3, 5], [9, 3, 21], 5, 5, 12, 4),  # odd head count, blocks of 4
    ([1, 1, 1], [300, 9, 530], 6, 2, 36, 16),  # GQA 3 across the decode kernel's 256-token partitions
    ([1, 1], [257, 600], 4, 4, 20, 8),  # MHA, blocks of 8: two and three partitions of 32 blocks
]


def quantized_batch(shape, dtype):
    """build_batch's batch with its cache quantized to int8 rows, and the float64 reference:
    attention over the dequantized cache and the new K/V quantized and dequantized."""
    query_lens, context_lens, heads, kv_heads, head_dim, block_size = shape
    query, key, value, float_cache, metadata = build_batch(query_lens, context_lens, heads, kv_heads, head_dim,
                                                           block_size, dtype)
    kv_cache = quantize_kv_rows(float_cache, torch.int8)
    scale = head_dim**-0.5
    key_dq = dequantize_kv_rows(quantize_kv_rows(key, torch.int8), head_dim, dtype)
    value_dq = dequantize_kv_rows(quantize_kv_rows(value, torch.int8), head_dim, dtype)
    expected = dense_reference(query, key_dq, value_dq, dequantize_kv_rows(kv_cache, head_dim, dtype), metadata,
                               block_size, scale)
    return query, key, value, kv_cache, metadata, expected, scale


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, CPUAttentionBackend], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}-ctx{s[1]}-h{s[2]}-kv{s[3]}-d{s[4]}-bs{s[5]}")
def test_backends_read_and_write_int8_rows(backend_cls, dtype, shape):
    """Every backend with an int8 cache computes attention over exactly the dequantized rows
    (to float rounding: 1e-5 in float32, 2e-2 in bfloat16), and stores the reference rows."""
    if backend_cls is CPUAttentionBackend and cpu_kernels() is None:
        pytest.skip("the CPU kernel could not be built here")
    query, key, value, kv_cache, metadata, expected, scale = quantized_batch(shape, dtype)
    block_size = shape[5]
    backend = backend_cls()
    metadata.backend = backend
    backend.prepare(metadata, block_size)
    out = backend.forward(query, key, value, kv_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    kv_heads, width = kv_cache.shape[3], kv_cache.shape[4]
    assert torch.equal(kv_cache[0].view(-1, kv_heads, width)[metadata.slot_mapping], quantize_kv_rows(key, torch.int8))
    assert torch.equal(kv_cache[1].view(-1, kv_heads, width)[metadata.slot_mapping],
                       quantize_kv_rows(value, torch.int8))


@needs_cpu_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"ctx{s[1]}-h{s[2]}-kv{s[3]}-d{s[4]}-bs{s[5]}")
def test_cpu_decode_kernel_int8_equals_the_float_kernel_on_the_dequantized_cache(shape):
    """The C++ kernel on int8 rows against itself on the same rows dequantized to float32."""
    _, context_lens, heads, kv_heads, head_dim, block_size = shape
    query, _, _, kv_cache, metadata, _, scale = quantized_batch(shape, torch.float32)
    n = len(context_lens)
    tables, lens = metadata.block_tables, metadata.seq_lens
    q = query[:n] if query.shape[0] >= n else torch.randn(n, heads, head_dim)
    out = cpu_kernels().paged_decode_attention(q.contiguous(), kv_cache[0], kv_cache[1], tables, lens, scale)
    dq = dequantize_kv_rows(kv_cache, head_dim, torch.float32).contiguous()
    ref = cpu_kernels().paged_decode_attention(q.contiguous(), dq[0], dq[1], tables, lens, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_cpu_kernels
def test_cpu_decode_kernel_refuses_a_cache_row_of_the_wrong_width():
    kv = torch.zeros(2, 3, 4, 1, 16, dtype=torch.int8)  # 16 = head_dim 16 with no room for the scale
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int8 cache row"):
        cpu_kernels().paged_decode_attention(torch.randn(1, 2, 16), kv[0], kv[1], tables, lens, 0.25)


def test_kv_store_ref_writes_quantized_rows_at_their_slots():
    torch.manual_seed(3)
    cache = torch.zeros(2, 5, 4, 2, 12, dtype=torch.int8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([0, 13, 19])
    kv_store_ref(key, value, cache, slots)
    flat = cache.view(2, -1, 2, 12)
    assert torch.equal(flat[0, slots], quantize_kv_rows(key, torch.int8))
    assert torch.equal(flat[1, slots], quantize_kv_rows(value, torch.int8))
    assert flat[:, [i for i in range(20) if i not in (0, 13, 19)]].eq(0).all()


@needs_cpu_kernels
@pytest.mark.parametrize("rows, heads, head_dim", [(1, 1, 4), (7, 3, 20), (33, 2, 64)])
def test_the_cpu_store_quantizes_exactly_as_the_reference(rows, heads, head_dim):
    """store_kv_int8 (C++, the CPU backend's store) writes the very bytes kv_store_ref writes,
    ties and zero rows included, and nothing outside its slots."""
    torch.manual_seed(rows)
    key, value = torch.randn(rows, heads, head_dim) * 3, torch.randn(rows, heads, head_dim)
    key[0] = 0.0  # a zero row: scale 0
    value[-1, 0, :2] = torch.tensor([127.0, 0.5])  # a tie: 0.5 / (127 / 127) rounds to even (0)
    blocks, block_size = rows // 4 + 2, 4
    slots = torch.randperm(blocks * block_size)[:rows]
    expected = torch.zeros(2, blocks, block_size, heads, head_dim + 4, dtype=torch.int8)
    kv_store_ref(key, value, expected, slots)
    cache = torch.zeros_like(expected)
    cpu_kernels().store_kv_int8(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot beyond the cache"):
        cpu_kernels().store_kv_int8(key[:1], value[:1], cache[0], cache[1], torch.tensor([blocks * block_size]))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: f"q{s[0]}-ctx{s[1]}-d{s[4]}")
def test_the_torch_backend_reads_and_writes_fp8_rows(shape):
    """The CPU twin of the GPU's fp8_e4m3 cache (the engine allows it on CUDA only): the
    torch backend stores saturated fp8 rows and attends over exactly their values (1e-5)."""
    query_lens, context_lens, heads, kv_heads, head_dim, block_size = shape
    query, key, value, float_cache, metadata = build_batch(query_lens, context_lens, heads, kv_heads, head_dim,
                                                           block_size, torch.float32)
    key[0, 0, 0] = 1000.0  # saturates to 448
    fp8 = torch.float8_e4m3fn
    kv_cache = float_cache.to(fp8)
    expected = dense_reference(query, key.clamp(-448, 448).to(fp8).float(), value.to(fp8).float(),
                               kv_cache.float(), metadata, block_size, head_dim**-0.5)
    backend = TorchAttentionBackend()
    backend.prepare(metadata, block_size)
    out = backend.forward(query, key, value, kv_cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    stored = kv_cache[0].view(-1, kv_heads, head_dim)[metadata.slot_mapping]
    assert torch.equal(stored.view(torch.uint8), quantize_kv_rows(key, fp8).view(torch.uint8))
    assert stored[0, 0, 0].item() == FP8_E4M3_MAX
