"""The real default model (SmolLM2-135M-Instruct), pulled and converted on first use."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def smollm():
    return LLM(max_num_batched_tokens=512, kv_cache_memory=1 << 27)


def test_default_model_knows_the_capital_of_france(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # it ended its turn with <|im_end|>


def test_default_model_greedy_matches_transformers(smollm):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm.engine.model_dir, dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in smollm.generate(prompts, params)]
    tok = smollm.get_tokenizer()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        theirs = [model.generate(torch.tensor([tok.encode(p)]), max_new_tokens=16, do_sample=False)[0, len(tok.encode(p)):].tolist() for p in prompts]
    assert ours == theirs


def test_default_model_fused_decode_matches_eager(smollm):
    """The fused CPU decode step against --enforce-eager on the real model: one request
    alone, then three together whose decode batch shrinks 3 → 2 → 1."""
    fused = smollm.engine.runner.fused_decoder
    assert fused is not None
    eager = LLM(enforce_eager=True, max_num_batched_tokens=512, kv_cache_memory=1 << 26)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    lengths = [24, 16, 8]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    alone = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    before = fused.num_steps
    assert smollm.generate(prompts[:1], alone)[0].outputs[0].token_ids == \
        eager.generate(prompts[:1], alone)[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in smollm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert fused.num_steps - before == 23 + 23  # every step after each prefill
