"""The default sampler: excluded tokens never come out, seeds hold, penalties are exact."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.contracts import SamplingMetadata
from pagedserve.plugins.default_sampler import DefaultSampler, apply_penalties, row_argmax

from engine_helpers import assert_pool_clean, mixed_prompts

VOCAB = 50


def metadata(rows: int, **kw) -> SamplingMetadata:
    base = dict(
        temperature=torch.full((rows,), 1.0), top_k=None, top_p=None, min_p=None, generators={},
        repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        prompt_token_ids=[[] for _ in range(rows)], output_token_ids=[[] for _ in range(rows)],
        banned_token_ids={}, max_num_logprobs=None,
    )
    base.update(kw)
    return SamplingMetadata(**base)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def test_top_k_never_emits_a_token_outside_the_top_k():
    logits = random_logits(8)
    sampler = DefaultSampler(seed=1)
    allowed = logits.topk(5, dim=-1).indices
    for _ in range(200):
        tokens = sampler.sample(logits.clone(), metadata(8, top_k=torch.full((8,), 5))).sampled_token_ids
        assert all(t in allowed[i] for i, t in enumerate(tokens.tolist()))


@pytest.mark.parametrize("width", [49152, 1000, 1031, 256, 3])
def test_row_argmax_is_torch_argmax(width):
    """The blocked argmax gives torch's ids: the first of tied maxima, a NaN before any
    number, rows of -inf; widths with a block (49152, 1000, 256) and without (1031, 3)."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g)
    x[1] = 0.5  # every index ties: 0
    x[2, width // 2] = x[2, width - 1] = 100.0  # tied across blocks: the first
    x[3, width - 1] = float("nan")  # a NaN in the last block beats every number
    x[4, width - 1] = float("nan")
    x[4, 1] = float("nan")  # the first NaN
    x[5] = float("-inf")
    x[6, 0] = float("inf")
    x[7, width - 1] = 10.0
    x[8] = x[8].round()  # many ties
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x.t().contiguous().t()), x.argmax(dim=-1))  # a strided view
    assert row_argmax(x[:0]).shape == (0,)


def test_top_p_keeps_exactly_the_nucleus():
    logits = random_logits(6, seed=3)
    probs = logits.softmax(-1)
    sampler = DefaultSampler(seed=2)
    seen = [set() for _ in range(6)]
    for _ in range(400):
        tokens = sampler.sample(logits.clone(), metadata(6, top_p=torch.full((6,), 0.6))).sampled_token_ids
        for i, t in enumerate(tokens.tolist()):
            seen[i].add(t)
    for i in range(6):
        order = probs[i].argsort(descending=True).tolist()
        cum, nucleus = 0.0, set()
        for t in order:  # smallest set of best tokens whose mass reaches 0.6
            nucleus.add(t)
            cum += probs[i, t].item()
            if cum >= 0.6:
                break
        assert seen[i] <= nucleus
        assert len(seen[i]) == len(nucleus)  # 400 draws see every nucleus token (the rarest: p 0.15)


def test_min_p_drops_tokens_below_the_threshold():
    logits = random_logits(4, seed=5)
    probs = logits.softmax(-1)
    sampler = DefaultSampler(seed=3)
    for _ in range(200):
        tokens = sampler.sample(logits.clone(), metadata(4, min_p=torch.full((4,), 0.2))).sampled_token_ids
        for i, t in enumerate(tokens.tolist()):
            assert probs[i, t] >= 0.2 * probs[i].max()


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = random_logits(4)
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0])
    tokens = DefaultSampler(seed=4).sample(logits.clone(), metadata(4, temperature=temps)).sampled_token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_penalties_follow_their_definitions_exactly():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    md = metadata(1, repetition_penalty=torch.tensor([2.0]), presence_penalty=torch.tensor([0.5]),
                  frequency_penalty=torch.tensor([0.25]), prompt_token_ids=[[0]], output_token_ids=[[1, 1, 3]])
    out = apply_penalties(logits, md)
    # token 0: in prompt, positive → /2; token 1: twice in output, negative → *2, then -0.5 - 2*0.25
    # token 2: unseen; token 3: once in output → 3/2 - 0.5 - 0.25
    assert out.tolist() == [[1.0, -2.0 - 0.5 - 0.5, 0.5, 1.5 - 0.5 - 0.25]]


def test_banned_tokens_and_logprobs():
    logits = random_logits(2)
    best = logits.argmax(-1)
    md = metadata(2, temperature=None, banned_token_ids={0: [int(best[0])]}, max_num_logprobs=3)
    out = DefaultSampler().sample(logits.clone(), md)
    assert out.sampled_token_ids[0] != best[0] and out.sampled_token_ids[1] == best[1]
    expected = torch.log_softmax(logits, -1)
    assert torch.equal(out.top_logprob_ids, expected.topk(3).indices)
    torch.testing.assert_close(out.logprobs[1], expected[1, best[1]])


def test_seeded_output_does_not_depend_on_the_batch(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 24)
    prompts = mixed_prompts()
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    other = SamplingParams(max_tokens=7, temperature=1.3, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded)[0].outputs[0].token_ids
    crowd = llm.generate(prompts[:8], [other] * 3 + [seeded] + [other] * 4)[3].outputs[0].token_ids
    later = llm.generate(prompts[2:6], [other, seeded, seeded, other])[1].outputs[0].token_ids
    assert alone == crowd == later
    assert len(alone) == 10
    # an unseeded request is not pinned to the seeded one's tokens
    assert llm.generate([prompts[3]], SamplingParams(max_tokens=10, seed=43, ignore_eos=True))[0].outputs[0].token_ids != alone
    assert_pool_clean(llm.engine)


def test_n_completions_share_the_prompt_blocks(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 24, enable_prefix_caching=False)
    prompt = mixed_prompts()[10]  # 37 + n tokens: at least 2 full blocks
    pool = llm.engine.kv_manager.pool
    shared = []
    original = pool.take

    def spy(blocks):
        blocks = list(blocks)
        shared.extend(blocks)
        original(blocks)

    pool.take = spy
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    # two siblings took the first sibling's full prompt blocks instead of computing them
    assert len(shared) == 2 * ((len(prompt) - 1) // 16)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate([prompt], SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_pool_clean(llm.engine)
