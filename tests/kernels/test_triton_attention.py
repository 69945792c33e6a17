"""The Triton paged attention (the interpreter on CPU) against the float64 dense reference."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from pagedserve.kernels.triton_attention import TritonAttentionBackend, paged_attention  # noqa: E402

from attention_helpers import build_batch, dense_reference, metadata_in_order  # noqa: E402

SHAPES = [
    # (query lens, context lens, heads, kv heads, head_dim, block size): decodes first
    ([1, 1, 7, 20], [40, 3, 7, 50], 6, 2, 64, 16),  # GQA 3: decodes, a fresh prefill, a chunk with context
    ([1, 1, 1], [100, 17, 1], 8, 1, 128, 32),  # GQA 8, head_dim 128, block size 32
    ([1, 18, 5], [33, 18, 21], 4, 4, 64, 16),  # MHA (GQA 1); a chunk longer than one query tile
    ([1, 3], [77, 40], 6, 2, 12, 16),  # head_dim 12 (a padded one, as in the tiny test models)
]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}-ctx{s[1]}-h{s[2]}-kv{s[3]}-d{s[4]}-bs{s[5]}")
def test_triton_paged_attention(shape, dtype, num_splits):
    query_lens, context_lens, heads, kv_heads, head_dim, block_size = shape
    query, key, value, kv_cache, metadata = build_batch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    expected = dense_reference(query, key, value, kv_cache, metadata, block_size, scale)
    backend = TritonAttentionBackend(num_splits=num_splits)
    backend.prepare(metadata, block_size)
    # store K/V like forward() does, then attend into a poisoned buffer: every element is written
    poisoned = torch.full_like(query, float("nan"))
    kv_ref = kv_cache.clone()
    out = backend.forward(query, key, value, kv_cache, metadata, scale)
    paged_attention(query, kv_cache, metadata, scale, poisoned)
    assert not poisoned.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(poisoned, out, atol=0, rtol=0)
    # the store wrote exactly the new slots
    kv_ref[0].view(-1, kv_heads, head_dim)[metadata.slot_mapping.long()] = key
    kv_ref[1].view(-1, kv_heads, head_dim)[metadata.slot_mapping.long()] = value
    assert torch.equal(kv_cache, kv_ref)


def test_a_rows_bits_do_not_depend_on_the_longest_context_in_its_batch():
    """The longest context of a batch sets how many KV splits run, but every split holds
    `tokens_per_split` tokens, so a row's KV is cut in the same places alone and beside a
    much longer context: its output has the same bits (batch invariance). Before, the
    splits shared out the longest context: a 150-token row was cut in 4-block pieces alone
    and in 1-block pieces beside a 700-token one. (Beside a prefill chunk a decode row sits
    in a taller tile; here the interpreter's numpy matmul then rounds it differently, so
    that case is the GPU's: benchmarks/gpu_checks.py probes it.)"""
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 64, block_size, kv_heads, head_dim, generator=g)
    query = torch.randn(8, heads, head_dim, generator=g)
    rows, splits = [], []
    for query_lens, seq_lens in (([1], [150]), ([1, 1], [150, 700])):
        metadata = metadata_in_order(query_lens, seq_lens, block_size)  # the 150-token row keeps its blocks
        TritonAttentionBackend(tokens_per_split=64).prepare(metadata, block_size)
        splits.append(metadata.backend_state.num_splits)
        q = query[: sum(query_lens)]
        rows.append(paged_attention(q, kv_cache, metadata, head_dim**-0.5, torch.empty_like(q))[:1])
    # the CUDA graph plan (a split count for the longest context the model takes) cuts it there too
    metadata.backend_state = TritonAttentionBackend(tokens_per_split=64).decode_plan(2, 1024, block_size, "cpu")
    rows.append(paged_attention(q, kv_cache, metadata, head_dim**-0.5, torch.empty_like(q))[:1])
    assert splits == [3, 11] and metadata.backend_state.num_splits == 16
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(6, 2, 64, 16), (8, 1, 128, 32), (4, 4, 64, 16)])
def test_graph_decode_plan_with_padding_rows(heads, kv_heads, head_dim, block_size):
    """What a CUDA graph replays: a decode-only plan fixed for the longest context, with a
    split count the short contexts leave partly empty, and padding rows (context 0, slot -1)
    after the real ones. The real rows match the reference; the padding rows come out 0."""
    context_lens = [3 * block_size + 5, 1, 7 * block_size, 2 * block_size - 1]  # 4 real decodes
    query, key, value, kv_cache, metadata = build_batch([1] * 4, context_lens, heads, kv_heads, head_dim,
                                                        block_size, torch.float32)
    expected = dense_reference(query, key, value, kv_cache, metadata, block_size, head_dim**-0.5)
    pad = 3
    backend = TritonAttentionBackend(tokens_per_split=2 * block_size, max_splits=4)
    # the plan holds up to 8 blocks of context: 4 splits of at least 2 blocks each
    metadata.backend_state = backend.decode_plan(4 + pad, 8 * block_size, block_size, "cpu")
    assert (metadata.backend_state.num_splits, metadata.backend_state.min_blocks_per_split) == (4, 2)
    metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.full((pad,), -1)])
    metadata.seq_lens = torch.cat([metadata.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    metadata.query_start_loc = torch.arange(4 + pad + 1, dtype=torch.int32)
    metadata.block_tables = torch.cat([metadata.block_tables, torch.zeros(pad, metadata.block_tables.shape[1], dtype=torch.int32)])
    pad_rows = lambda t: torch.cat([t, torch.randn(pad, *t.shape[1:])])  # noqa: E731
    kv_before = kv_cache.clone()
    out = backend.forward(pad_rows(query), pad_rows(key), pad_rows(value), kv_cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(out[:4].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    # only the 4 real slots were written
    assert int((kv_cache != kv_before).any(dim=-1).any(dim=-1).sum()) == 2 * 4


def test_self_check_passes_and_catches_a_broken_kernel(monkeypatch):
    from pagedserve.kernels import triton_attention, triton_ops

    assert triton_attention.self_check(torch.device("cpu"), torch.float32) is None
    monkeypatch.setattr(triton_ops, "silu_and_mul", lambda x: triton_ops.silu_and_mul_ref(x) + 1)
    assert triton_attention.self_check(torch.device("cpu"), torch.float32) == "silu_and_mul disagrees with the torch reference"


def test_engine_on_triton_matches_transformers(tiny_checkpoint):
    """Greedy ids through the whole engine on the Triton backend (chunked prefill beside
    decodes, prefix caching, GQA) equal transformers' own."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.kernels.triton_attention import TritonAttentionBackend as Backend

    from engine_helpers import hf_greedy, mixed_prompts

    model_dir = tiny_checkpoint("qwen3")  # GQA 7, q/k norms: every Triton kernel runs
    prompts = mixed_prompts(6, seed=3)
    llm = LLM(str(model_dir), device="cpu", attention_backend="triton", max_num_batched_tokens=48, kv_cache_memory=1 << 22)
    assert isinstance(llm.engine.runner.attention_backend, Backend)
    # norms, rotary and MLPs all run the Triton ops the selector chose, none the torch ones
    ops = {type(m.ops).__name__ for m in llm.engine.runner.model.modules() if hasattr(m, "ops")}
    assert ops == {"TritonOps"}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert ours == hf_greedy(model_dir, prompts, 6)


def _run_gpu_kernels_script(env: dict[str, str], name: str = "gpu_kernels") -> str:
    """`python benchmarks/<name>.py --smoke`, as the scripts' docstrings say to run them."""
    import subprocess

    from benchmark_scripts import benchmark_command

    command = benchmark_command(name, "--smoke")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_gpu_kernels_script_on_the_interpreter():
    """The GPU figures script's own checks, on tiny shapes (CPU twin of the gpu test)."""
    import os

    out = _run_gpu_kernels_script({**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert "CPU (Triton interpreter)" in out and out.strip().endswith("all checks passed")
    assert out.count("decode b=2") == 2 and "prefill 1x32" in out
    # the quantized KV caches' decode rows and the w8a16 GEMM's, each checked by the script
    assert out.count("decode kv-int8 b=2") == 2 and out.count("decode kv-fp8 b=2") == 2
    assert out.count("w8a16 tiny") == 2


@pytest.mark.gpu
def test_compiled_kernels_match_torch_on_gpu():
    """The kernels compiled for the GPU agree with the torch backend."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = _run_gpu_kernels_script(env)
    assert "Triton interpreter" not in out and out.strip().endswith("all checks passed")


def test_gpu_e2e_script_on_the_interpreter():
    """The end-to-end GPU script on a tiny model (CPU twin of the gpu test): its greedy
    check passes with the graph path run eagerly, and it prints both systems' figures."""
    import os

    out = _run_gpu_kernels_script({**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, "gpu_e2e")
    assert "graphs True, eager True; graph path run eagerly" in out
    assert "memory-bandwidth utilisation" in out and out.strip().endswith("all checks passed")


@pytest.mark.gpu
def test_cuda_graphs_and_e2e_script_on_gpu():
    """Decode steps replayed from real CUDA graphs give transformers' greedy ids."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = _run_gpu_kernels_script(env, "gpu_e2e")
    assert "graphs True, eager True; CUDA graphs" in out and out.strip().endswith("all checks passed")
