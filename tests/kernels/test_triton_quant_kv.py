"""The Triton KV store and paged attention over a quantized KV cache (int8 rows with their
float32 scale, float8_e4m3fn rows; the layout of reference_ops.quantize_kv_rows) against the
torch reference: the quantized rows bit for bit, and attention against float64 attention over
the dequantized cache. In-process the kernels run in Triton's interpreter on CPU tensors;
the `gpu` test runs this file again, compiled, on CUDA tensors (DEVICE below)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from pagedserve.kernels import triton_ops  # noqa: E402
from pagedserve.kernels.reference_ops import (  # noqa: E402
    FP8_E4M3_MAX,
    dequantize_kv_rows,
    kv_row_width,
    kv_store_ref,
    quantize_kv_rows,
)
from pagedserve.kernels.triton_attention import TritonAttentionBackend, paged_attention  # noqa: E402

from attention_helpers import build_batch, dense_reference  # noqa: E402
from triton_twin import run_compiled_twin, twin_device  # noqa: E402

#: CUDA only when the kernels are compiled (the `gpu` twin, triton_twin.py)
DEVICE = twin_device()
#: float8_e4m3fn compiles for sm_89+ only (a GPU below is refused: the last test)
_FP8_HERE = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
CACHE_DTYPES = [torch.int8, torch.float8_e4m3fn] if _FP8_HERE else [torch.int8]
#: attention against float64 over the same dequantized cache: what differs is the kernel's
#: arithmetic (float32 softmax, products in the query's dtype), as for a float cache
ATTENTION_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def store_ref(key, value, kv_cache, slot_mapping):
    """`kv_store_ref`, through a byte view: torch's CPU index_copy_ has no float8 kernel."""
    if kv_cache.dtype == torch.int8:
        return kv_store_ref(key, value, kv_cache, slot_mapping)
    width = kv_cache.shape[-1]
    for cache, x in ((kv_cache[0], key), (kv_cache[1], value)):
        rows = quantize_kv_rows(x, kv_cache.dtype).view(torch.uint8)
        cache.view(torch.uint8).view(-1, x.shape[1], width).index_copy_(0, slot_mapping.long(), rows)
    return None


def _on_device(metadata):
    return dataclasses.replace(metadata, **{f: getattr(metadata, f).to(DEVICE) for f in
                                            ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})


def _quantized_batch(shape, dtype, cache_dtype, seed=0):
    """build_batch's mixed batch, its cache quantized, on DEVICE; and the float64 reference
    over the cache the reference store leaves (dequantized)."""
    query_lens, context_lens, heads, kv_heads, head_dim, block_size = shape
    query, key, value, kv_cache, metadata = build_batch(query_lens, context_lens, heads, kv_heads, head_dim,
                                                        block_size, dtype, seed)
    cache = quantize_kv_rows(kv_cache, cache_dtype)
    stored = cache.clone()
    store_ref(key, value, stored, metadata.slot_mapping)
    deq = dequantize_kv_rows(stored, head_dim, torch.float64)
    slots = metadata.slot_mapping.long()
    expected = dense_reference(query, deq[0].view(-1, kv_heads, head_dim)[slots],
                               deq[1].view(-1, kv_heads, head_dim)[slots], deq, metadata, block_size, head_dim**-0.5)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(query), to(key), to(value), to(cache), _on_device(metadata), stored, expected


def _bytes(t):
    return t.cpu().view(torch.uint8)


# -- the store ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(3, 12), (2, 64), (1, 100)])
def test_kv_store_quantizes_rows_bit_for_bit(kv_heads, head_dim, cache_dtype, dtype):
    """Every stored row equals quantize_kv_rows' bytes (int8 values and scale, or fp8), with
    rows of a zero, a tie and an out-of-range value; padding tokens (slot -1) and the other
    slots are left as they were."""
    g = torch.Generator().manual_seed(1)
    n, num_blocks, block_size = 7, 3, 4
    key = (torch.randn(n, kv_heads, head_dim, generator=g) * 3).to(dtype)
    value = (torch.randn(n, kv_heads, head_dim, generator=g) * 0.01).to(dtype)
    key[0, 0] = 0.0  # an all-zero row: int8 scale 0, values 0
    key[1, 0, :4] = torch.tensor([500.0, -1000.0, 0.5, -0.0]).to(dtype)  # fp8 saturates at +-448
    value[2, -1, :3] = torch.tensor([127.0, 63.5, -0.5]).to(dtype)  # int8: 63.5 / (127 / 127) is a tie
    slots = torch.tensor([5, 0, 11, -1, 6, 3, -1])
    width = kv_row_width(head_dim, cache_dtype)
    before = torch.randint(-100, 100, (2, num_blocks, block_size, kv_heads, width), generator=g,
                           dtype=torch.int8).view(cache_dtype)
    expected = before.clone()
    store_ref(key[slots >= 0], value[slots >= 0], expected, slots[slots >= 0])
    cache = before.to(DEVICE)
    triton_ops.kv_store(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE))
    assert torch.equal(_bytes(cache), _bytes(expected))
    deq = dequantize_kv_rows(expected[0].view(-1, kv_heads, width)[0, 0], head_dim, torch.float32)  # key[1]: slot 0
    if cache_dtype == torch.float8_e4m3fn:
        assert deq[:4].tolist() == [FP8_E4M3_MAX, -FP8_E4M3_MAX, 0.5, 0.0]


def test_kv_store_rounds_int8_halves_to_even():
    """x / scale exactly k + 0.5 rounds to the even neighbour, as torch.round does."""
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -3.5, 100.5, -126.5])  # scale 1
    key = row.view(1, 1, 8)
    cache = torch.zeros(2, 1, 1, 1, 12, dtype=torch.int8, device=DEVICE)
    triton_ops.kv_store(key.to(DEVICE), key.to(DEVICE), cache, torch.tensor([0], device=DEVICE))
    assert cache[0, 0, 0, 0, :8].tolist() == [127, 0, 2, 2, -2, -4, 100, -126]
    assert cache[0, 0, 0, 0, 8:].cpu().view(torch.float32).item() == 1.0


def test_kv_store_refuses_a_cache_of_another_row_width():
    key = torch.zeros(1, 1, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="rows 16 wide"):
        triton_ops.kv_store(key, key, torch.zeros(2, 1, 1, 1, 16, dtype=torch.int8, device=DEVICE),
                            torch.tensor([0], device=DEVICE))


# -- attention ---------------------------------------------------------------------------

#: (query lens, context lens, heads, kv heads, head_dim, block size): decodes first
MIXED = ([1, 1, 7, 20], [40, 3, 7, 50], 6, 2, 64, 16)  # GQA 3: decodes, a fresh prefill, a chunk with context
DECODE_D128 = ([1, 1, 1], [100, 17, 1], 8, 1, 128, 32)  # GQA 8, head_dim 128, block size 32
ODD_D12 = ([1, 3], [77, 40], 6, 2, 12, 16)  # head_dim 12 (padded to 16 in the kernel)


def _assert_store_and_attention(shape, dtype, cache_dtype, num_splits: int, seed: int = 0) -> None:
    """One launch over a quantized cache: the store writes the reference's bytes, and the
    attention matches the dequantized reference within ATTENTION_TOL."""
    query, key, value, cache, metadata, stored, expected = _quantized_batch(shape, dtype, cache_dtype, seed=seed)
    backend = TritonAttentionBackend(num_splits=num_splits)
    backend.prepare(metadata, shape[5])
    out = backend.forward(query, key, value, cache, metadata, shape[4] ** -0.5)
    assert torch.equal(_bytes(cache), _bytes(stored))
    tol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_quantized_cache_attention_mixed_batch(cache_dtype, dtype):
    """Decodes, a fresh prefill and a chunk over cached context in one launch, KV split in 2:
    the store writes the reference's bytes and attention matches the dequantized reference."""
    _assert_store_and_attention(MIXED, dtype, cache_dtype, num_splits=2)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "dtype", "num_splits"), [(DECODE_D128, torch.bfloat16, 1),
                                                            (ODD_D12, torch.float32, 3)], ids=["d128-bf16", "d12-f32"])
def test_quantized_cache_attention_other_layouts(shape, dtype, num_splits, cache_dtype):
    _assert_store_and_attention(shape, dtype, cache_dtype, num_splits, seed=3)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_quantized_cache_graph_decode_plan_with_padding_rows(cache_dtype):
    """The CUDA graph's decode plan (fixed splits, padding rows with slot -1 and context 0)
    over a quantized cache: real rows match, padding rows come out 0 and store nothing."""
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    shape = ([1] * 4, [3 * block_size + 5, 1, 7 * block_size, 2 * block_size - 1], heads, kv_heads, head_dim, block_size)
    query, key, value, cache, metadata, stored, expected = _quantized_batch(shape, torch.float32, cache_dtype)
    pad = 3
    backend = TritonAttentionBackend(tokens_per_split=2 * block_size, max_splits=4)
    metadata.backend_state = backend.decode_plan(4 + pad, 8 * block_size, block_size, DEVICE)
    metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    metadata.seq_lens = torch.cat([metadata.seq_lens, torch.zeros(pad, dtype=torch.int32, device=DEVICE)])
    metadata.query_start_loc = torch.arange(4 + pad + 1, dtype=torch.int32, device=DEVICE)
    metadata.block_tables = torch.cat([metadata.block_tables,
                                       torch.zeros(pad, metadata.block_tables.shape[1], dtype=torch.int32, device=DEVICE)])
    pad_rows = lambda t: torch.cat([t, torch.randn(pad, *t.shape[1:], device=DEVICE)])  # noqa: E731
    out = backend.forward(pad_rows(query), pad_rows(key), pad_rows(value), cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(out[:4].cpu().double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    assert torch.equal(_bytes(cache), _bytes(stored))  # the padding rows stored nothing


def test_attention_reads_only_what_the_cache_says():
    """A cache whose rows are wider than the query's head_dim allows (not its int8 layout) is
    refused rather than read with the wrong stride."""
    query, key, value, cache, metadata, _, _ = _quantized_batch(ODD_D12, torch.float32, torch.int8)
    backend = TritonAttentionBackend()
    backend.prepare(metadata, ODD_D12[5])
    with pytest.raises(AssertionError, match="cache rows of another head_dim"):
        paged_attention(query[..., :8].contiguous(), cache, metadata, 1.0, torch.empty_like(query[..., :8]))


def test_self_check_covers_the_int8_cache(monkeypatch):
    """The `auto` backend's start-up check runs attention over an int8 cache too: a store
    that writes the wrong int8 values is caught (the float cache's check still passes)."""
    from pagedserve.kernels import triton_attention

    assert triton_attention.self_check(torch.device(DEVICE), torch.float32) is None
    store = triton_ops.kv_store

    def off_by_one(key, value, kv_cache, slot_mapping):
        store(key, value, kv_cache, slot_mapping)
        if kv_cache.dtype == torch.int8:
            kv_cache[..., :4].add_(1)

    monkeypatch.setattr(triton_ops, "kv_store", off_by_one)
    assert (triton_attention.self_check(torch.device(DEVICE), torch.float32)
            == "paged attention (int8 KV cache) disagrees with the torch reference")


def test_a_float8_cache_is_refused_below_sm89(monkeypatch):
    from types import SimpleNamespace

    cache = SimpleNamespace(dtype=torch.float8_e4m3fn, is_cuda=True, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match=r"needs a GPU of sm_89 or later .* \(this one is sm_80\); use an int8"):
        triton_ops.check_kv_cache_device(cache)
    triton_ops.check_kv_cache_device(SimpleNamespace(dtype=torch.int8, is_cuda=True, device="cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    triton_ops.check_kv_cache_device(cache)


@pytest.mark.gpu
def test_the_same_checks_compiled_on_a_gpu():
    """This file's tests again, compiled for the GPU, on CUDA tensors (DEVICE)."""
    run_compiled_twin(__file__)
