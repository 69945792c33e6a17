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
