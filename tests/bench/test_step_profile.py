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


def test_the_profile_runs_the_quantization_it_is_given(tiny_checkpoint, monkeypatch, capsys):
    """`--profile --quantization int8 --quantize-lm-head` profiles int8 engines (it once ran
    float32 whatever it was given), and its header says which."""
    from argparse import Namespace

    import pagedserve
    from pagedserve.bench.step_profile import run_profile

    made: list[dict] = []

    def recording_llm(model, **options):
        made.append(options)
        return LLM(model, kv_cache_memory=1 << 22, **options)

    monkeypatch.setattr(pagedserve, "LLM", recording_llm)
    args = Namespace(model=str(tiny_checkpoint("llama-gqa")), dtype="float32", threads=1, profile_batches="1",
                     profile_prompt=8, profile_steps=2, quantization="int8", quantize_lm_head=True)
    assert run_profile(args) == 0
    assert [(o["quantization"], o["quantize_lm_head"], o["enforce_eager"]) for o in made] == \
        [("int8", True, False), ("int8", True, True)]
    assert "quantization=int8 quantize_lm_head=True" in capsys.readouterr().out.splitlines()[0]
