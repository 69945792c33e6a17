"""Decode steps through the CUDA-graph path: static buffers, batches padded up to a bucket,
a plan fixed for the longest context. On CPU the path runs eagerly (no CUDA graphs exist
there) in Triton's interpreter; the capture itself is checked by benchmarks/gpu_e2e.py on a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from pagedserve.engine.decode_graphs import batch_buckets  # noqa: E402

from engine_helpers import assert_pool_clean, hf_greedy, mixed_prompts  # noqa: E402


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_padded_decode_steps_match_transformers(tiny_checkpoint):
    """Five requests of different lengths: decode batches of 5, 4, 3, 2 and 1 run padded to
    buckets 8, 4, 4, 2 and 1; every token equals transformers' greedy one, and the padding
    rows leave the KV pool as they found it."""
    from pagedserve import LLM, SamplingParams

    model_dir = tiny_checkpoint("llama-gqa")
    prompts = mixed_prompts(10, seed=11)[:5]  # the first half share no prefix: one prefill step for all
    llm = LLM(str(model_dir), device="cpu", attention_backend="triton", max_num_seqs=8, kv_cache_memory=1 << 22)
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_batch=8, max_model_len=llm.engine.max_model_len, cuda_graphs=False)
    graphs = runner.decode_graphs
    assert graphs.buckets == [1, 2, 4, 8]
    lengths = [3, 5, 7, 9, 11]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    expected = hf_greedy(model_dir, prompts, max(lengths))
    assert ours == [e[:n] for e, n in zip(expected, lengths)]
    # after the prefill step (which yields each first token), the decode batch shrinks by one
    # request every two steps: 2 steps of 5 → bucket 8, 2 of 4 and 2 of 3 → 4, 2 of 2 → 2, 2 of 1 → 1
    assert graphs.replays == {8: 2, 4: 4, 2: 2, 1: 2}
    assert_pool_clean(llm.engine)


def test_graphs_refuse_a_backend_without_a_fixed_plan(tiny_checkpoint):
    from pagedserve import LLM

    llm = LLM(str(tiny_checkpoint("llama-gqa")), device="cpu", attention_backend="torch", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="cannot run from CUDA graphs"):
        llm.engine.runner.enable_decode_graphs(max_batch=4, max_model_len=64, cuda_graphs=False)


def test_a_failed_capture_falls_back_to_eager(tiny_checkpoint, caplog):
    """A capture that fails (here: CUDA graphs asked for on a CPU) is logged once; that step
    and every later one run eagerly, with the same tokens."""
    from pagedserve import LLM, SamplingParams

    model_dir = tiny_checkpoint("llama-gqa")
    prompts = mixed_prompts(4, seed=2)[:2]
    llm = LLM(str(model_dir), device="cpu", attention_backend="triton", kv_cache_memory=1 << 22)
    llm.engine.runner.enable_decode_graphs(max_batch=4, max_model_len=llm.engine.max_model_len, cuda_graphs=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with caplog.at_level("WARNING", logger="pagedserve.engine.model_runner"):
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert ours == hf_greedy(model_dir, prompts, 4)
    assert llm.engine.runner.decode_graphs is None
    assert len([r for r in caplog.records if "CUDA graph capture failed" in r.message]) == 1


def test_the_captured_forward_reads_nothing_back_from_the_device(tiny_checkpoint, monkeypatch):
    """A CUDA graph records device work only: a forward that reads a tensor's value on the
    host (.item(), .tolist(), `if tensor:`) or builds a tensor from host data fails to capture
    or bakes one step's values into every replay. The forward a graph would capture runs here
    with every such call raising, and the Triton launches recorded instead of interpreted (the
    interpreter itself copies tensors to the host)."""
    import torch

    from pagedserve import LLM
    from pagedserve.kernels.triton_aot import recording

    llm = LLM(str(tiny_checkpoint("llama-gqa")), device="cpu", attention_backend="triton", kv_cache_memory=1 << 22)
    llm.engine.runner.enable_decode_graphs(max_batch=8, max_model_len=llm.engine.max_model_len, cuda_graphs=False)
    graph = llm.engine.runner.decode_graphs._capture(4)

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} in the captured forward")
        return call

    with recording() as launches, monkeypatch.context() as guard:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
            guard.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
        for name in ("tensor", "as_tensor", "from_numpy"):
            guard.setattr(torch, name, forbidden(f"torch.{name}"))
        with pytest.raises(AssertionError, match="torch.tensor in the captured forward"):
            torch.tensor([1])  # the guard is on
        hidden = graph.forward()
    assert hidden.shape == (4, 96)
    # per layer: the input norm (fused with the residual add after the first), rotary on q and
    # on k, the KV store, attention, the post-attention norm, SiLU-and-mul; then the final norm
    layer = ["_rms_norm_kernel", "_rotary_kernel", "_rotary_kernel", "_kv_store_kernel", "_paged_attention_kernel",
             "_rms_norm_kernel", "_silu_and_mul_kernel"]
    assert [launch.name for launch in launches] == layer * 2 + ["_rms_norm_kernel"]
    assert all(launch.grid[0] == 4 for launch in launches if launch.name == "_paged_attention_kernel")
