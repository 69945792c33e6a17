"""`bench offline --profile`'s profiler on the tiny model: every profiled step decodes the
whole batch (also after a chunked prefill), each path is named, and the engine is left empty."""

from __future__ import annotations

from pagedserve import LLM
from pagedserve.bench.step_profile import format_profiles, profile_decode


def test_profiles_of_a_fused_and_an_eager_batch(tiny_checkpoint):
    # a 32-token budget: 4 prompts of 20 tokens take 3 prefill steps, while the first decode
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, max_num_batched_tokens=32,
              max_num_seqs=4, fused_decode_max_batch=2, enable_prefix_caching=False)
    engine = llm.engine
    one = profile_decode(engine, 1, prompt_len=20, steps=3)
    four = profile_decode(engine, 4, prompt_len=20, steps=3)
    assert (one.fused, four.fused) == (True, False)
    assert (one.steps, four.steps) == (3, 3)
    for p in (one, four):
        assert p.linear > 0 and p.attention > 0 and p.step > p.linear
        assert p.host_overhead == p.step - p.linear
    assert not engine.has_unfinished_requests()
    table = format_profiles([one, four])
    assert "batch 1 fused" in table and "batch 4 eager" in table
    assert table.splitlines()[1].startswith("linear layers")
