"""Greedy token ids identical to transformers, in every scheduling mode."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.contracts import Request, ScheduledRequest

from engine_helpers import assert_pool_clean, hf_greedy, mixed_prompts

MAX_NEW = 12
MODES = {
    "chunked-small-budget": dict(max_num_batched_tokens=24),
    "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    "prefix-caching-off": dict(enable_prefix_caching=False, max_num_batched_tokens=100),
    # a pool of 10 blocks of 16 tokens: far too few for 16 prompts at once
    "preemption": dict(kv_cache_memory="blocks:10", max_num_batched_tokens=64),
}
MODELS = ["llama-gqa", "llama-mha-odd", "llama3-rope", "qwen2", "qwen3", "mistral"]
_reference: dict[str, list[list[int]]] = {}


def kv_bytes_for_blocks(model_dir, num_blocks: int, block_size: int = 16) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return num_blocks * block_size * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_name", MODELS)
def test_greedy_matches_transformers(tiny_checkpoint, model_name, mode):
    model_dir = tiny_checkpoint(model_name)
    prompts = mixed_prompts()
    if model_name not in _reference:
        _reference[model_name] = hf_greedy(model_dir, prompts, MAX_NEW)
    options = {"kv_cache_memory": 1 << 24, **MODES[mode]}
    if options.get("kv_cache_memory") == "blocks:10":
        options["kv_cache_memory"] = kv_bytes_for_blocks(model_dir, 10)
    llm = LLM(str(model_dir), **options)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    # twice: the second run is served largely from the prefix cache (when it is on)
    for _ in range(2):
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == _reference[model_name]
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert_pool_clean(llm.engine)
    stats = llm.engine.kv_manager.pool.stats
    if mode == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if options.get("enable_prefix_caching", True):
        if mode == "preemption":  # readmitted sequences look up again: the count is the schedule's
            assert stats.num_hits > 0
        else:  # run 1: 7 of the 8 prompts sharing a 37-token prefix reuse its 2 full blocks; run 2: all
            assert stats.num_hits == 2 * 7 + sum((len(p) - 1) // 16 for p in prompts)
    else:
        assert stats.num_hits == 0


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("model_name", ["llama-gqa", "qwen2", "qwen3"])
def test_prefill_logits_match_transformers(tiny_checkpoint, model_name, backend):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint(model_name)
    prompt = mixed_prompts()[9]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    engine = LLM(str(model_dir), kv_cache_memory=1 << 24, attention_backend=backend).engine
    assert engine.runner.kernels.ops.name == backend
    request = Request("r", prompt, SamplingParams(), frozenset(), max_tokens=1)
    assert engine.kv_manager.allocate_slots(request, len(prompt))
    entries = [ScheduledRequest(request, len(prompt), engine.kv_manager.block_ids(request))]
    input_ids, positions, metadata = engine.runner._tensors(engine.runner.prepare_inputs(entries))
    model = engine.runner.model
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, metadata, engine.runner.kv_caches))
    assert logits.shape == expected.shape
    # The C++ RMSNorm of the CPU ops (kernels/cpu_ops.py) sums its squares in another order
    # than torch's mean: an ulp in a norm, which these random weights grow to about 4e-5 in
    # logits of magnitude 10; the torch ops compute as transformers does
    torch.testing.assert_close(logits, expected, atol=1e-4 if backend == "cpu" else 2e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_bfloat16_runs_close_to_float32(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama-gqa")
    prompts = mixed_prompts()[:4]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    f32 = [o.outputs[0].token_ids for o in LLM(str(model_dir), kv_cache_memory=1 << 24).generate(prompts, params)]
    bf16 = [o.outputs[0].token_ids for o in LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=1 << 24).generate(prompts, params)]
    # bf16 rounding may flip a later token; the first token of each prompt must agree
    assert [t[0] for t in bf16] == [t[0] for t in f32]
    assert all(len(t) == 4 for t in bf16)
