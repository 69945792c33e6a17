"""Bad input gets a typed error naming the field; nothing reaches the engine loop."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import (
    ContextLengthExceededError,
    InvalidParameterError,
    UnknownModelError,
)

from engine_helpers import assert_pool_clean


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
        ("max_tokens", 0), ("n", 0), ("n", 17), ("stop", 5), ("stop", ["ok", 3]), ("stop", [""]),
        ("top_k", -2), ("min_p", 2.0), ("logprobs", 50), ("seed", "x"), ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0), ("stop_token_ids", [-1]), ("min_tokens", -1),
    ],
)
def test_out_of_range_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert info.value.message.startswith(f"{field}:")


def test_engine_config_is_checked():
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(block_size=12)
    assert info.value.param == "block_size"
    with pytest.raises(InvalidParameterError):
        EngineConfig(dtype="int4")


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, max_model_len=64, max_n=4)


def test_prompt_longer_than_the_context_names_both_lengths(llm):
    with pytest.raises(ContextLengthExceededError) as info:
        llm.generate([list(range(3, 80))], SamplingParams(max_tokens=4))
    assert "64" in info.value.message and "77" in info.value.message
    assert info.value.code == "context_length_exceeded"


def test_bad_prompts_and_n_above_the_engine_limit(llm):
    with pytest.raises(InvalidParameterError) as info:
        llm.generate([[1, 2, 10_000]])
    assert info.value.param == "prompt"
    with pytest.raises(InvalidParameterError):
        llm.generate([[]])
    with pytest.raises(InvalidParameterError) as info:
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10_000]))
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidParameterError):
        llm.generate([[1, True]])
    with pytest.raises(InvalidParameterError) as info:
        llm.generate([[1, 2]], SamplingParams(n=5))
    assert info.value.param == "n"
    # a bad prompt in the middle of a batch leaves nothing queued
    with pytest.raises(InvalidParameterError):
        llm.generate([[1, 2], [1, -3]])
    assert_pool_clean(llm.engine)
    assert not llm.engine.has_unfinished_requests()


def test_numpy_token_ids_and_any_integer_seed_are_accepted(llm):
    import numpy as np

    prompt = np.array([5, 6, 7], dtype=np.int64)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    for seed in (-1, 2**70):
        out = llm.generate([[5, 6]], SamplingParams(max_tokens=3, seed=seed, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 3


def test_generation_stops_at_the_context_length(llm):
    out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 64 - 57
    assert out.outputs[0].finish_reason == "length"


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(UnknownModelError) as info:
        LLM("no-such-model")
    assert "smollm2-135m-instruct" in info.value.message


def test_top_k_beyond_64_bits_cuts_nothing_and_fails_nothing(tiny_checkpoint):
    """A top_k past the vocabulary means no cut; 2**63 once overflowed the runner's int64
    column and failed every request of the step."""
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22)
    base = dict(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    huge, none = (llm.generate([[4, 5, 6], [7, 8]], [SamplingParams(top_k=k, **base), SamplingParams(**base)])
                  for k in (2**63, 0))
    assert [o.outputs[0].token_ids for o in huge] == [o.outputs[0].token_ids for o in none]
    assert_pool_clean(llm.engine)
