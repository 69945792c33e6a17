"""The `draft` proposer: a smaller model with its own paged KV proposes; the output is the
target's exactly, its KV follows the accepted tokens, and its blocks all come back."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from pagedserve import LLM, SamplingParams
from pagedserve.common.contracts import Request
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.draft_proposer import DraftProposer

from engine_helpers import assert_pool_clean, assert_same_completions, mixed_prompts


def draft_llm(model, draft, **options) -> LLM:
    speculative = {"method": "draft", "model": str(draft), "num_speculative_tokens": 4, "max_batch": 64}
    speculative.update(options.pop("speculative", {}))
    return LLM(str(model), speculative=speculative, **options)


def assert_draft_pool_clean(proposer: DraftProposer) -> None:
    assert not proposer._sequences
    assert sorted(proposer._free) == list(range(proposer.runner.num_blocks))


@pytest.mark.parametrize("draft_name", ["llama-gqa", "llama-draft"], ids=["self-draft", "small-draft"])
def test_greedy_ids_identical_to_no_speculation(tiny_checkpoint, draft_name):
    """The target drafting for itself has its drafts nearly all accepted (whole runs and the
    extra token); a smaller random model has most rejected. Chunked prefill (64-token steps),
    preemption (a small pool), prefix hits (the prompts' shared prefix), n = 2 and a stop
    token id and a stop string act at the exact accepted token."""
    model, draft = tiny_checkpoint("llama-gqa"), tiny_checkpoint(draft_name)
    prompts = mixed_prompts()
    options = dict(kv_cache_memory=1 << 17, max_num_batched_tokens=64)
    plain = LLM(str(model), **options)
    spec = draft_llm(model, draft, **options)
    first = plain.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    text = first[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string inside the run
    cases = [
        (prompts, SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True)),
        (prompts[::3], SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True)),
        (prompts[:1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                     stop_token_ids=[first[0].outputs[0].token_ids[9]])),
        (prompts[:1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])),
    ]
    for some, params in cases:
        expected = plain.generate(some, params)
        got = spec.generate(some, params)
        assert_same_completions(expected, got)
        assert_pool_clean(spec.engine)
        if params.stop_token_ids:
            assert got[0].outputs[0].finish_reason == "stop" and len(got[0].outputs[0].token_ids) == 10
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].stop_reason == stop
    speculator = spec.engine.speculator
    proposer = speculator.proposer
    assert isinstance(proposer, DraftProposer)
    assert_draft_pool_clean(proposer)
    counters = speculator.counters
    assert counters.num_drafts > 0 and spec.engine.scheduler.num_preemptions > 0
    if draft_name == "llama-gqa":
        assert counters.num_accepted > 0.9 * counters.num_drafts
    else:
        assert counters.num_accepted < 0.5 * counters.num_drafts


def test_draft_cache_follows_the_accepted_tokens(tiny_checkpoint):
    """After every propose, each drafting sequence's draft K/V holds exactly its tokens then
    the drafts fed back: rejected drafts were rolled back before it."""
    model, draft = tiny_checkpoint("llama-gqa"), tiny_checkpoint("llama-draft")
    prompts = mixed_prompts()[:4]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = LLM(str(model), kv_cache_memory=1 << 24)
    spec = draft_llm(model, draft, kv_cache_memory=1 << 24)
    proposer = spec.engine.speculator.proposer
    checked = []
    propose = proposer.propose

    def checking(requests, max_tokens):
        drafts = propose(requests, max_tokens)
        for request, d in zip(requests, drafts):
            state = proposer._sequences[request.request_id]
            assert state.tokens == request.token_ids + d[:-1]
            assert len(state.blocks) * 16 >= len(state.tokens)
            checked.append(len(d))
        return drafts

    proposer.propose = checking
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert len(checked) > 20 and max(checked) == 4
    assert spec.engine.speculator.counters.num_accepted < spec.engine.speculator.counters.num_drafts
    assert_draft_pool_clean(proposer)


def test_a_sequence_without_draft_blocks_takes_the_least_recent(tiny_checkpoint):
    """A draft pool of 8 blocks holds one 100-token sequence: the next sequence takes its
    blocks, unless both propose in the same step; when the first proposes again alone, it
    catches up from its prompt and drafts the same."""
    model, draft = tiny_checkpoint("llama-gqa"), tiny_checkpoint("llama-draft")
    # the llama-draft layout: 1 layer, 2 KV heads of 16, float32: 4096 bytes a 16-token block
    spec = draft_llm(model, draft, kv_cache_memory=1 << 24, speculative={"kv_memory": 8 * 4096})
    proposer = spec.engine.speculator.proposer
    assert proposer.runner.num_blocks == 8
    a, b = (Request(name, prompt, SamplingParams(), frozenset(), max_tokens=50)
            for name, prompt in (("a", [3 + i * 7 % 300 for i in range(100)]), ("b", [5 + i * 11 % 300 for i in range(100)])))
    first = proposer.propose([a], [4])
    assert len(first[0]) == 4 and len(proposer._sequences["a"].blocks) == 7
    assert len(proposer.propose([b], [4])[0]) == 4
    assert proposer.num_evicted == 1 and "a" not in proposer._sequences
    second = proposer.propose([a, b], [4, 4])  # b keeps its blocks while both propose
    assert second[0] == [] and len(second[1]) == 4 and proposer.num_evicted == 1
    assert proposer.propose([a], [4]) == first  # a takes them back and catches up from its prompt
    assert proposer.num_evicted == 2
    proposer.finish(["a", "b"])
    assert_draft_pool_clean(proposer)


def test_draft_settings_are_checked(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama-gqa")
    with pytest.raises(InvalidParameterError, match="speculative_model"):
        LLM(str(model), speculative={"method": "draft"})
    with pytest.raises(InvalidParameterError, match="speculative_kv_memory"):
        LLM(str(model), speculative={"method": "draft", "model": str(model), "kv_memory": 0})
    # a draft whose tokenizer has one more token
    odd = tmp_path / "odd"
    shutil.copytree(tiny_checkpoint("llama-draft"), odd)
    tokenizer = AutoTokenizer.from_pretrained(odd)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(str(odd))
    with pytest.raises(InvalidParameterError, match="different tokenizer"):
        LLM(str(model), speculative={"method": "draft", "model": str(odd)})
