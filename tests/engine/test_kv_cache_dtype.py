"""`--kv-cache-dtype int8` end to end on CPU: the option and its errors, the pool's size in
bytes, block hashes apart from float ones, greedy ids against a float cache, prefix hits,
and the fused decode step writing and reading int8 rows."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common import options
from pagedserve.common.contracts import Request
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.kv_cache_pool import KVCachePool, KVCacheSpec, resolve_kv_cache_dtype
from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.kernels.reference_ops import dequantize_kv_rows
from pagedserve.prefix_cache.block_hash import prompt_block_hashes

from engine_helpers import assert_pool_clean, eager_then_fused, mixed_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_the_option_from_flags_environment_and_keywords():
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, EngineConfig)
    assert options.build(EngineConfig, parser.parse_args(["--kv-cache-dtype", "int8"]), {}).kv_cache_dtype == "int8"
    assert options.build(EngineConfig, None, {"PAGEDSERVE_KV_CACHE_DTYPE": "int8"}).kv_cache_dtype == "int8"
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(InvalidParameterError, match="auto, int8, fp8_e4m3") as err:
        EngineConfig(kv_cache_dtype="int4")
    assert err.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidParameterError, match="fp8_e4m3 needs a CUDA device"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", device="cpu")
    # device auto that resolves to a CPU: refused when the runner resolves it
    with pytest.raises(InvalidParameterError, match="fp8_e4m3 needs a CUDA device"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.float32, torch.device("cpu"))
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert resolve_kv_cache_dtype("int8", torch.float32, torch.device("cpu")) == torch.int8


def test_an_int8_pool_counts_its_scales_and_buys_more_blocks_for_the_same_memory():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    float_spec, int8_spec = KVCacheSpec(30, 3, 64, torch.float32), KVCacheSpec(30, 3, 64, torch.int8)
    assert float_spec.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert int8_spec.bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12_240  # 3.76x fewer bytes
    cpu = torch.device("cpu")
    memory = 64 << 20
    assert KVCachePool.num_blocks_for(float_spec, 16, cpu, memory, 0.9) == memory // (46_080 * 16) == 91
    assert KVCachePool.num_blocks_for(int8_spec, 16, cpu, memory, 0.9) == memory // (12_240 * 16) == 342
    pool = KVCachePool(KVCacheSpec(2, 2, 16, torch.int8), 4, 3, cpu)
    assert [c.shape for c in pool.kv_caches] == [torch.Size([2, 3, 4, 2, 20])] * 2
    assert all(c.dtype == torch.int8 and c.eq(0).all() for c in pool.kv_caches)


def test_a_head_dim_the_scale_cannot_follow_aligned_is_refused():
    class Config:
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size, head_dim = 2, 2, 2, 12, 6

    with pytest.raises(InvalidParameterError, match="divisible by 4"):
        KVCacheSpec.for_model(Config(), torch.int8)


def test_int8_block_hashes_differ_from_float_ones_and_the_gateway_computes_the_same():
    tokens = list(range(3, 40))
    request = Request("r", tokens, SamplingParams(), frozenset(), max_tokens=1)
    hashes = {}
    for kv_dtype in ("", "int8", "fp8_e4m3"):
        manager = KVCacheManager(8, 16, True, model_id="m", kv_dtype=kv_dtype)
        hashes[kv_dtype] = manager._ensure_hashes(request, 2)
        assert hashes[kv_dtype] == prompt_block_hashes(tokens, 16, "m", None, kv_dtype)
    assert len({h for chain in hashes.values() for h in chain}) == 6  # no two alike
    assert hashes[""] == prompt_block_hashes(tokens, 16, "m")  # a float cache's hashes are unchanged


def run_all(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def float_and_int8(tiny_checkpoint):
    """The same prompts through a float32 cache and an int8 one (torch attention for both:
    the reference paths), with every step eager."""
    model = str(tiny_checkpoint("llama-gqa"))
    prompts = mixed_prompts(16, seed=4)
    common = dict(kv_cache_memory=1 << 22, attention_backend="torch", enable_prefix_caching=False)
    float_ids = run_all(LLM(model, **common), prompts)
    int8_llm = LLM(model, kv_cache_dtype="int8", **common)
    assert int8_llm.engine.runner.kv_caches[0].dtype == torch.int8
    assert int8_llm.engine.kv_manager.kv_dtype == "int8"  # in its hashes, and in the heartbeat (WorkerInfo.kv_dtype)
    return model, prompts, float_ids, run_all(int8_llm, prompts)


def test_greedy_ids_with_an_int8_cache_mostly_match_the_float_cache(float_and_int8):
    """16 prompts x 12 greedy tokens of a tiny random model, whose flat logits make it the
    hardest case for an approximate cache (one flipped token changes the rest of its
    sequence). Stated share: every first token agrees, and at least 70% of the tokens agree
    up to each sequence's first difference (measured here: 144 of 192, 9 sequences of 16
    identical to the end)."""
    _, _, float_ids, int8_ids = float_and_int8
    assert [a[0] for a in float_ids] == [b[0] for b in int8_ids]
    agreed = 0
    for a, b in zip(float_ids, int8_ids):
        agreed += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    total = sum(len(a) for a in float_ids)
    assert agreed / total >= 0.70, (agreed, total)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_prefix_hit_with_an_int8_cache_gives_the_ids_of_recomputing(tiny_checkpoint, backend):
    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("the CPU kernels need a C++ compiler")
    model = str(tiny_checkpoint("llama-gqa"))
    prompts = mixed_prompts(8, seed=5)[4:]  # four prompts sharing a 37-token prefix
    recomputed = run_all(LLM(model, kv_cache_memory=1 << 22, kv_cache_dtype="int8", attention_backend=backend,
                             enable_prefix_caching=False), prompts)
    llm = LLM(model, kv_cache_memory=1 << 22, kv_cache_dtype="int8", attention_backend=backend)
    first = run_all(llm, prompts[:1])
    again = run_all(llm, prompts)  # every prompt hits the shared prefix's blocks, the first one all of its own
    stats = llm.engine.kv_manager.pool.stats
    assert stats.num_hits >= 2 + 3 * 2  # (37 + n) // 16 blocks: the first prompt's, and 2 each for the others
    assert first[0] == recomputed[0] and again == recomputed
    assert_pool_clean(llm.engine)


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")
@pytest.mark.parametrize("model_name", ["llama-gqa", "qwen2", "llama-mha-odd"])
def test_the_fused_step_writes_and_reads_int8_rows_as_the_eager_forward(tiny_checkpoint, model_name):
    """One decode step of 3 sequences (5, 17 and 40 tokens: odd block counts, GQA or not) with
    an int8 cache: the fused step against the model's forward with the C++ attention. Stored
    rows: their scale to 1e-5 relative (the K/V themselves differ to float rounding), their values within one step (a row whose K differs
    in the last float bit may round the other way); hidden states and logits to 1e-3."""
    llm = LLM(str(tiny_checkpoint(model_name)), kv_cache_memory=1 << 22, kv_cache_dtype="int8")
    engine = llm.engine
    runner = engine.runner
    fused = runner.fused_decoder
    assert fused is not None and runner.kv_caches[0].dtype == torch.int8
    head_dim = runner.kv_pool.spec.head_dim
    torch.manual_seed(0)
    for cache in runner.kv_caches:  # a context of random rows, as earlier steps would have left
        cache.copy_(torch.randint(-127, 128, cache.shape, dtype=torch.int8))
        cache[..., head_dim:] = torch.full(cache.shape[:-1] + (1,), 0.01).view(torch.int8)
    with torch.inference_mode():
        eager, eager_kv, before, hidden = eager_then_fused(engine)
        for cache, expected, old in zip(runner.kv_caches, eager_kv, before):
            written = (expected != old).any(-1)  # the rows this step stored
            assert written.sum() >= 2 * 3 * runner.kv_pool.spec.num_kv_heads - 2  # K and V, 3 slots (a row may repeat)
            torch.testing.assert_close(cache[..., head_dim:].contiguous().view(torch.float32),
                                       expected[..., head_dim:].contiguous().view(torch.float32), rtol=1e-5, atol=0)
            steps = (cache[..., :head_dim].int() - expected[..., :head_dim].int()).abs()
            assert steps.max() <= 1
            assert torch.equal(cache[~written], expected[~written])  # nothing else touched
            torch.testing.assert_close(dequantize_kv_rows(cache, head_dim, torch.float32),
                                       dequantize_kv_rows(expected, head_dim, torch.float32), rtol=0, atol=0.02)
        torch.testing.assert_close(hidden, eager, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(fused.logits(hidden), runner.model.compute_logits(eager), rtol=1e-3, atol=1e-3)


def test_a_backend_that_cannot_read_quantized_rows_is_refused_or_replaced(tiny_checkpoint, monkeypatch, caplog):
    """Named explicitly: a clear error. Chosen by `auto`: the torch backend runs instead (logged)."""
    from pagedserve.common.contracts import Kernels
    from pagedserve.engine import model_runner
    from pagedserve.kernels import selector
    from pagedserve.kernels.torch_attention import TorchAttentionBackend

    class FloatOnlyBackend(TorchAttentionBackend):
        name = "float-only"
        quantized_kv = False

    def select(name, device):
        if name == "torch":
            return selector.select_kernels(name, device)
        return Kernels(FloatOnlyBackend(), selector.TorchOps())

    monkeypatch.setattr(model_runner, "select_kernels", select)
    model = str(tiny_checkpoint("llama-gqa"))
    with pytest.raises(InvalidParameterError, match="float-only attention backend cannot read an? int8 KV cache"):
        LLM(model, kv_cache_memory=1 << 22, kv_cache_dtype="int8", attention_backend="cpu")
    llm = LLM(model, kv_cache_memory=1 << 22, kv_cache_dtype="int8")
    assert llm.engine.runner.attention_backend.name == "torch"
    assert "every step runs the torch backend" in caplog.text
    assert LLM(model, kv_cache_memory=1 << 22).engine.runner.attention_backend.name == "float-only"  # float: kept
