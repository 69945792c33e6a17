"""`quantization="int8"` on the real default model (SmolLM2-135M-Instruct): its weights
within the rounding bound, and greedy tokens close to float32's."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.bench.perplexity import window_logits
from pagedserve.common.errors import InvalidParameterError

#: 16 fixed prompts of different kinds (prose, code, lists, questions)
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "import numpy as np\n\n", "Water boils at a temperature of",
    "The best way to learn a new language is", "SELECT name, age FROM users WHERE",
    "In 1969, the first humans", "A recipe for pancakes:\n1.", "The theory of relativity states that",
    "for i in range(10):\n    ", "My favourite book is", "The largest planet in the solar system is",
    "Photosynthesis is the process by which", "<html>\n  <head>\n    <title>",
]
TOKENS = 64


def test_unknown_quantization_is_refused_before_loading():
    with pytest.raises(InvalidParameterError, match="quantization: unknown method 'int3'; choices: int4, int4_asym, int4_g128, int4_g128_asym, int8"):
        LLM(quantization="int3")


@pytest.mark.slow
def test_default_model_weights_within_the_int8_rounding_bound():
    from pagedserve.common.model_store import resolve_model
    from pagedserve.engine.model_loader import iter_safetensors
    from pagedserve.plugins.int8_quantization import dequantize, quantize_per_channel

    checked = 0
    for name, w in iter_safetensors(resolve_model("smollm2-135m-instruct")):
        if w.dim() == 2 and "proj" in name:
            q, scale = quantize_per_channel(w)
            error = (dequantize(q, scale) - w.float()).abs()
            assert bool((error <= scale[:, None] / 2 + w.float().abs() * 2 ** -22).all()), name
            checked += 1
    assert checked == 30 * 7


@pytest.fixture(scope="module")
def float32_greedy() -> list[list[int]]:
    llm = LLM(max_num_batched_tokens=512, kv_cache_memory=1 << 27)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


@pytest.mark.slow
@pytest.mark.parametrize("lm_head", [False, True])
def test_default_model_int8_greedy_agrees_with_float32(float32_greedy, lm_head):
    """Greedy ids of 16 prompts × 64 tokens, int8 against float32, two ways:
    - teacher-forced (asserted, >= 90%): after the prompt and float32's first i tokens,
      int8's greedy token is float32's token i (one causal prefill of prompt + float32's
      tokens per prompt: the logits at every position, as the perplexity harness reads them);
    - free-running (printed): both generate alone and are compared position by position.
      Once a sequence takes another token it follows another text, and every later position
      counts as a miss: on this 135M model one near-tie flipped by the int8 rounding early in
      a sequence costs the rest of it (measured 52% int8, 35% int8+head; 3 and 1 of the 16
      sequences identical), while teacher-forced agreement was 97-98%."""
    llm = LLM(quantization="int8", quantize_lm_head=lm_head, max_num_batched_tokens=512, kv_cache_memory=1 << 27)
    assert llm.engine.runner.fused_decoder is not None  # decode steps of <= 16 run the int8 GEMV
    assert llm.engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    tok = llm.get_tokenizer()
    # teacher-forced: each prompt and float32's tokens fed as one sequence; the greedy token
    # after each prefix is the argmax of the logits at its last position
    predicted = []
    for p, ref in zip(PROMPTS, float32_greedy):
        prompt = tok.encode(p)
        for logits, _ in window_logits(llm.engine, prompt + ref, len(prompt), chunk=TOKENS + len(prompt)):
            predicted += logits.argmax(-1).tolist()
    expected = [t for ref in float32_greedy for t in ref]
    assert len(predicted) == len(expected)
    forced = sum(a == b for a, b in zip(predicted, expected))
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    free = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    same = sum(a == b for ours, theirs in zip(free, float32_greedy) for a, b in zip(ours, theirs))
    identical = sum(ours == theirs for ours, theirs in zip(free, float32_greedy))
    total = len(PROMPTS) * TOKENS
    print(f"int8{'+head' if lm_head else ''} vs float32: teacher-forced {forced}/{total} ({forced / total:.1%}); "
          f"free-running {same}/{total} ({same / total:.1%}), {identical}/{len(PROMPTS)} sequences identical")
    assert forced / total >= 0.9
