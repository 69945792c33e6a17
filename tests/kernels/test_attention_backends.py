"""Attention backends against a dense reference on random inputs, several shapes."""

from __future__ import annotations

import platform

import pytest
import torch

from pagedserve.kernels.cpu_attention import CPUAttentionBackend, cpu_kernels
from pagedserve.kernels.torch_attention import TorchAttentionBackend

from attention_helpers import build_batch, dense_reference
from cpu_flags import kernel_flags

SHAPES = [
    # (query lens, context lens, heads, kv heads, head_dim, block size)
    ([1, 1, 1], [5, 33, 16], 4, 4, 16, 16),  # MHA decodes, one exactly a block
    ([1, 1, 7, 20], [40, 3, 7, 50], 6, 2, 32, 16),  # GQA 3: decodes + fresh prefill + chunk with context
    ([1, 1, 1, 1], [100, 17, 64, 1], 8, 1, 64, 32),  # GQA 8, block size 32
    ([5, 5, 5], [5, 5, 5], 3, 1, 16, 16),  # fresh prefills of equal length, back to back (views)
    ([4, 3, 4], [4, 9, 4], 4, 2, 16, 16),  # equal fresh prefills apart (gathered), a chunk between
    # head_dim 64 and 128: the CPU backend's prefill kernel (several tasks per sequence, chunks
    # after their context, sequences that end inside a block)
    ([1, 40, 7, 100], [30, 40, 20, 130], 6, 2, 64, 16),
    ([1, 70, 33, 2], [9, 70, 65, 2], 8, 1, 128, 32),
    # decodes across the CPU decode kernel's 256-token context partitions (two and three, merged)
    ([1, 1, 1], [300, 20, 600], 6, 2, 64, 16),
]
BACKENDS = [TorchAttentionBackend, CPUAttentionBackend]


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}-ctx{s[1]}-h{s[2]}-kv{s[3]}-d{s[4]}-bs{s[5]}")
def test_backend_matches_dense_reference(backend_cls, dtype, shape):
    if backend_cls is CPUAttentionBackend and cpu_kernels() is None:
        pytest.skip("the CPU kernel could not be built here")
    query_lens, context_lens, heads, kv_heads, head_dim, block_size = shape
    query, key, value, kv_cache, metadata = build_batch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    expected = dense_reference(query, key, value, kv_cache, metadata, block_size, scale)
    backend = backend_cls()
    metadata.backend = backend
    backend.prepare(metadata, block_size)
    out = backend.forward(query, key, value, kv_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # the new keys/values were stored at their slots
    stored = kv_cache[0].view(-1, kv_heads, head_dim)[metadata.slot_mapping]
    assert torch.equal(stored, key)


@pytest.fixture(params=["avx512", "avx2"])
def attention_isa(request):
    """The float32 decode attention's vector path for one test: the AVX-512 one where the build
    has it (else the AVX2 one runs again), and the AVX2 one; AVX-512 restored after."""
    if cpu_kernels() is None:
        pytest.skip("the CPU kernel could not be built here")
    yield cpu_kernels().set_decode_attention_isa(request.param)
    cpu_kernels().set_decode_attention_isa("avx512")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_vector_decode_path_matches_the_reference_and_ignores_the_batch(attention_isa, head_dim, block_size):
    """The float32 decode kernel's vector paths (AVX-512 where the build has it, and AVX2; head_dim
    64 and 128): contexts around the groups of 8 or 16 keys they score at once and the blocks
    (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 150) and the context partitions of 256 tokens (256: one;
    257 and 512: two; 700: three, merged), GQA 3, against the float64 reference; and each
    sequence's rows are the same bits alone as in the batch (its own blocks, whatever else
    shares the call). On 2 threads the batch of 15 runs one task per sequence (from 4 sequences
    a thread) and a sequence alone one per KV head and partition: the two task shapes give the
    same bits. A build without AVX2 + FMA runs its generic loops for both."""
    lens = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 150, 256, 257, 512, 700]
    query, key, value, kv_cache, metadata = build_batch([1] * len(lens), lens, 9, 3, head_dim, block_size,
                                                        torch.float32)
    scale = head_dim**-0.5
    expected = dense_reference(query, key, value, kv_cache, metadata, block_size, scale)
    backend = CPUAttentionBackend()
    metadata.backend = backend
    backend.prepare(metadata, block_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = backend.forward(query, key, value, kv_cache, metadata, scale)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    tables, seq_lens = metadata.block_tables, metadata.seq_lens
    for i in range(len(lens)):
        alone = cpu_kernels().paged_decode_attention(query[i : i + 1].contiguous(), kv_cache[0], kv_cache[1],
                                                     tables[i : i + 1].contiguous(), seq_lens[i : i + 1].contiguous(), scale)
        assert torch.equal(alone[0], out[i]), f"sequence {i} (context {lens[i]})"


def test_fresh_chunks_of_one_length_make_one_group():
    """Fresh chunks of one length share an SDPA call: as views of the batch where they lie back
    to back, through a row index where another chunk lies between them."""
    backend = TorchAttentionBackend()
    *_, metadata = build_batch([5, 5, 5], [5, 5, 5], 3, 1, 16, 16, torch.float32)
    backend.prepare(metadata, 16)
    [group] = metadata.backend_state.prefill_groups
    assert (group.token_index, group.start, group.num_seqs, group.q_len) == (None, 0, 3, 5)
    *_, metadata = build_batch([4, 3, 4], [4, 9, 4], 4, 2, 16, 16, torch.float32)
    backend.prepare(metadata, 16)
    chunk, fresh = metadata.backend_state.prefill_groups
    assert (chunk.start, chunk.q_len, chunk.context_slots.numel()) == (4, 3, 9)
    assert fresh.token_index.tolist() == [0, 1, 2, 3, 7, 8, 9, 10] and (fresh.num_seqs, fresh.q_len) == (2, 4)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_matches_the_reference_and_ignores_the_batch(head_dim):
    """The CPU backend's prefill kernel (float32; AVX-512 and AVX2 builds): the dense reference's values,
    and each sequence's rows bitwise the same when the kernel runs on that sequence alone.
    Elsewhere the backend does not call it (SDPA, the first test above)."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernel could not be built here")
    lens, context = [40, 7, 100], [40, 20, 130]
    query, key, value, kv_cache, metadata = build_batch(lens, context, 6, 2, head_dim, 16, torch.float32)
    scale = head_dim**-0.5
    expected = dense_reference(query, key, value, kv_cache, metadata, 16, scale)
    backend = CPUAttentionBackend()
    metadata.backend = backend
    backend.prepare(metadata, 16)
    calls = []
    spy = kernels.paged_prefill_attention
    try:
        kernels.paged_prefill_attention = lambda *args: calls.append(spy(*args))
        out = backend.forward(query, key, value, kv_cache, metadata, scale)
    finally:
        kernels.paged_prefill_attention = spy
    supported = kernels.prefill_attention_supported(head_dim, 3)
    # never for other head sizes, nor for more query heads per KV head than a task's rows (64; 48 on AVX2)
    assert not kernels.prefill_attention_supported(32, 3) and not kernels.prefill_attention_supported(head_dim, 65)
    # every x86 build with AVX2 and FMA: AVX-512 and AVX2 alike
    flags = kernel_flags(kernels)
    assert supported == ("avx2" in flags and "fma" in flags) or platform.machine() not in ("x86_64", "AMD64")
    assert len(calls) == (1 if supported else 0)  # the kernel, where built for it; else SDPA
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    if not supported:
        return
    for i, start in enumerate(metadata.query_start_loc[:-1].tolist()):
        rows = slice(start, start + lens[i])
        alone = torch.empty(query[rows].shape)
        spy(query[rows], kv_cache[0], kv_cache[1], metadata.block_tables[i : i + 1], metadata.seq_lens[i : i + 1],
            torch.tensor([0, lens[i]], dtype=torch.int32), alone, scale)
        assert torch.equal(alone, out[rows])
