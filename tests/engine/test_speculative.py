"""Speculative decoding: drafts verified in one step give exactly the target's tokens.

Greedy ids must equal decoding without speculation whatever the drafts (accepted, rejected
at any position, cut by stops, max_tokens, preemption, chunked prefill, prefix hits, n > 1);
sampled tokens must follow the target's distribution (chi-square over seeded runs); every
block goes back to the pool, and no cached block holds a rejected token.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.contracts import ProposerPlugin
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.sampling_inputs import position_seed
from pagedserve.engine.speculator import verify
from pagedserve.plugins.ngram_proposer import lookup

from engine_helpers import assert_pool_clean, assert_same_completions, mixed_prompts

VOCAB = 320


class OracleProposer(ProposerPlugin):
    """Proposes the true greedy continuation, with every `wrong_every`-th output position
    replaced by a wrong token: so drafts are accepted, rejected at every offset, and cut."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
        self.truth = truth
        self.wrong_every = wrong_every
        self.num_proposed = 0
        self.finished: list[str] = []

    def propose(self, requests, max_tokens):
        out = []
        for request, k in zip(requests, max_tokens):
            ref = self.truth[tuple(request.prompt_token_ids)]
            pos = request.num_output_tokens
            drafts = [t if (pos + j) % self.wrong_every else (t + 1) % VOCAB for j, t in enumerate(ref[pos : pos + k])]
            self.num_proposed += len(drafts)
            out.append(drafts)
        return out

    def finish(self, request_ids):
        self.finished += list(request_ids)


class ConstantProposer(ProposerPlugin):
    """Always proposes the same tokens."""

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, requests, max_tokens):
        return [self.drafts[:k] for k in max_tokens]


def speculative_llm(model, proposer: ProposerPlugin, max_batch: int = 64, **options) -> LLM:
    llm = LLM(str(model), speculative={"method": "ngram", "num_speculative_tokens": 4, "max_batch": max_batch},
              **options)
    assert llm.engine.speculator is not None
    llm.engine.speculator.proposer = proposer
    return llm


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert lookup(seq, 2, 4, 3) == [4, 5, 9]  # the 3-gram [1, 2, 3] occurred at the start
    assert lookup(seq, 1, 1, 2) == [4, 5]
    assert lookup([7, 1, 2, 8, 1, 2, 6, 1, 2], 2, 3, 2) == [6, 1]  # the most recent of two matches
    assert lookup([7, 1, 2, 8, 3, 1, 2], 3, 4, 2) == []  # only a 2-gram matches, 3 is the minimum
    assert lookup([1, 2, 3], 2, 4, 3) == []
    assert lookup([5, 5, 5, 5], 2, 3, 4) == [5]  # the match runs into the end of the sequence


def test_verify_keeps_drafts_until_the_first_disagreement():
    assert verify([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]  # the third draft rejected: the target's own token
    assert verify([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted, plus one token
    assert verify([5, 6, 7], [4, 6, 7, 1]) == [4]  # the first rejected: one token, as without drafts
    assert verify([], [3]) == [3]


def test_position_seed_depends_on_seed_and_position_only():
    assert position_seed(42, 3) == position_seed(42, 3)
    assert len({position_seed(s, p) for s in range(50) for p in range(50)}) == 2500
    assert 0 <= position_seed(2**64 - 1, 10**6) < 2**64


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "eager"])
def test_greedy_ids_identical_to_no_speculation(tiny_checkpoint, fused):
    model = tiny_checkpoint("llama-gqa")
    prompts = mixed_prompts()
    # a small step budget chunks the prompts; a small pool preempts
    options = dict(kv_cache_memory=1 << 17, max_num_batched_tokens=64, fused_decode_max_batch=16 if fused else 0)
    plain = LLM(str(model), **options)
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain.generate(prompts, long))}
    oracle = OracleProposer(truth)
    spec = speculative_llm(model, oracle, **options)
    fused_query_lens: list[int] = []  # the longest query of each step the fused step ran
    if fused:
        decoder = spec.engine.runner.fused_decoder
        forward = decoder.forward

        def recording(batch):
            fused_query_lens.append(max(batch.query_lens))
            return forward(batch)

        decoder.forward = recording

    cases = [
        SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True),  # 37: max_tokens cuts a draft run
        SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[truth[tuple(prompts[0])][9]]),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2),
    ]
    for i, params in enumerate(cases if fused else cases[:1]):
        some = prompts if i == 0 else prompts[::3]  # the first case preempts; the others check their feature
        expected = plain.generate(some, params)
        got = spec.generate(some, params)
        assert_same_completions(expected, got)
        if params.logprobs:
            for e, g in zip(expected, got):
                for ce, cg in zip(e.outputs, g.outputs):
                    assert [lp.sampled.token_id for lp in cg.logprobs] == [lp.sampled.token_id for lp in ce.logprobs]
                    torch.testing.assert_close(torch.tensor([lp.sampled.logprob for lp in cg.logprobs]),
                                               torch.tensor([lp.sampled.logprob for lp in ce.logprobs]),
                                               atol=1e-4, rtol=1e-4)
                    assert [[t.token_id for t in lp.top] for lp in cg.logprobs] == \
                        [[t.token_id for t in lp.top] for lp in ce.logprobs]
        assert_pool_clean(spec.engine)
    counters = spec.engine.speculator.counters
    assert counters.num_proposed == oracle.num_proposed >= counters.num_drafts  # some never got verified
    assert 0 < counters.num_accepted < counters.num_drafts  # drafts were both accepted and rejected
    assert spec.engine.scheduler.num_preemptions > 0 and plain.engine.scheduler.num_preemptions > 0
    if fused:  # verification steps ran in the fused step, each draft a row
        assert spec.engine.runner.fused_decoder.max_query_len == 1 + spec.engine.config.speculative_tokens()
        assert max(fused_query_lens) > 1  # (steps of more than 16 rows, max_batch, ran eagerly)


def test_stop_string_inside_an_accepted_run(tiny_checkpoint):
    model = tiny_checkpoint("llama-gqa")
    plain = LLM(str(model), kv_cache_memory=1 << 24)
    prompt = [9, 8, 7, 6]
    free = plain.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].outputs[0]
    truth = {tuple(prompt): free.token_ids}
    tok = plain.get_tokenizer()
    pieces = [tok.decode([t]) for t in free.token_ids]
    # a stop string that ends inside token 6, which an all-correct oracle delivers mid-run
    boundary = sum(len(p) for p in pieces[:6])
    stop = free.text[boundary - 2 : boundary]
    assert stop and stop not in free.text[: boundary - 2]
    spec = speculative_llm(model, OracleProposer(truth, wrong_every=10**6))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    expected = plain.generate([prompt], params)[0].outputs[0]
    got = spec.generate([prompt], params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (expected.text, expected.token_ids, "stop", stop)
    assert spec.engine.speculator.counters.num_accepted > 0
    assert_pool_clean(spec.engine)


def test_no_cached_block_holds_a_rejected_token(tiny_checkpoint):
    model = tiny_checkpoint("llama-gqa")
    prompts = mixed_prompts()
    plain = LLM(str(model), kv_cache_memory=1 << 24)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain.generate(prompts, params))}
    spec = speculative_llm(model, OracleProposer(truth, wrong_every=2))
    outputs = spec.generate(prompts, params)
    assert spec.engine.speculator.counters.num_accepted < spec.engine.speculator.counters.num_drafts
    assert_pool_clean(spec.engine)
    bs = spec.engine.config.block_size
    true_blocks = set()
    for out in outputs:
        seq = out.prompt_token_ids + out.outputs[0].token_ids
        true_blocks.update(tuple(seq[i : i + bs]) for i in range(0, len(seq) - bs + 1, bs))
    cached = [b for b in spec.engine.kv_manager.pool.blocks if b.block_hash is not None]
    assert len(cached) > len(prompts)  # output blocks were cached too
    assert all(b.token_ids in true_blocks for b in cached)
    # and their K/V is right: the same prompts again, served from the cache, give the same ids
    again = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > bs)


def test_seeded_sampling_is_the_same_with_and_without_speculation(tiny_checkpoint):
    model = tiny_checkpoint("llama-gqa")
    prompts = mixed_prompts()[:6]
    plain = LLM(str(model), kv_cache_memory=1 << 24)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_k=5, seed=100 + i, ignore_eos=True) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    truth = {tuple(p): e for p, e in zip(prompts, expected)}
    spec = speculative_llm(model, OracleProposer(truth, wrong_every=4))
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.speculator.counters.num_accepted > 0


def _chi_square_p(observed: Counter, expected: dict, total: int) -> float:
    """p-value of Pearson's chi-square test (cells with expected count < 5 are pooled)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * total
        if e < 5:
            pooled_obs += observed.get(key, 0)
            pooled_exp += e
            continue
        stat += (observed.get(key, 0) - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    assert sum(observed[k] for k in observed if k not in expected) == 0, "a token the target cannot give"
    dof = cells - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_tokens_follow_the_target_distribution(tiny_checkpoint):
    """20,000 seeded sequences, temperature 0.9 and top-k 6 over an 8-token vocabulary. The
    first verified token (output 1) comes from a draft that is accepted or rejected; its
    joint distribution with output 0 must be the target's, and so must output 1 given a
    rejection (the residual distribution)."""
    from transformers import AutoModelForCausalLM

    model = tiny_checkpoint("llama-vocab8")
    prompt = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 7, 2, 7, 1, 0, 4]  # a full block the sequences share
    temperature, top_k, runs = 0.9, 6, 20_000
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def target(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0, -1].double() / temperature
        cut = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < cut, float("-inf")), -1)

    p0 = target(prompt)
    joint = {(t0, t1): float(p0[t0] * p) for t0 in range(8) if p0[t0] > 0
             for t1, p in enumerate(target(prompt + [t0]).tolist())}
    # the draft: the likeliest output 1, so that it is accepted often and rejected often
    draft = max(range(8), key=lambda t: sum(p for (_, t1), p in joint.items() if t1 == t))
    accept = sum(p for (_, t1), p in joint.items() if t1 == draft)
    assert 0.2 < accept < 0.8

    llm = speculative_llm(model, ConstantProposer([draft, draft]), max_batch=1024, kv_cache_memory=1 << 26,
                          max_num_seqs=1024, max_num_batched_tokens=4096)
    # n = 16 sequences a request, sequence i seeded with seed + i: seeds 0 .. runs - 1
    params = [SamplingParams(n=16, max_tokens=3, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True)
              for s in range(0, runs, 16)]
    outputs = llm.generate([prompt] * len(params), params)
    pairs = Counter(tuple(c.token_ids[:2]) for o in outputs for c in o.outputs)
    assert sum(pairs.values()) == runs
    counters = llm.engine.speculator.counters
    assert counters.num_drafts == runs  # one draft verified per sequence (max_tokens 3 leaves room for one)
    assert abs(counters.num_accepted / runs - accept) < 4 * math.sqrt(accept * (1 - accept) / runs)
    assert _chi_square_p(pairs, joint, runs) > 1e-3
    rejected = Counter({k: v for k, v in pairs.items() if k[1] != draft})
    residual = {k: p / (1 - accept) for k, p in joint.items() if k[1] != draft}
    assert _chi_square_p(rejected, residual, sum(rejected.values())) > 1e-3


def test_adaptivity_pauses_rejected_drafts_and_large_batches(tiny_checkpoint):
    model = tiny_checkpoint("llama-gqa")
    prompts = mixed_prompts()
    never = ConstantProposer([0, 0, 0, 0])  # token 0 never comes out of greedy decoding here
    llm = speculative_llm(model, never, kv_cache_memory=1 << 24)
    outputs = llm.generate(prompts[:1], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    assert 0 not in outputs[0].outputs[0].token_ids
    counters = llm.engine.speculator.counters
    # 4 verifications (the moving average, from 1, is under 0.25 after the fourth), a 16-step
    # pause, 4 more, 32 steps, 4 more, 64 steps (past the 100 tokens): 12 and 3, not 20 and 5
    assert (counters.num_accepted, counters.num_verifications, counters.num_paused) == (0, 12, 3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    small = LLM(str(model), kv_cache_memory=1 << 24, speculative={"method": "ngram", "max_batch": 2})
    small.generate(prompts[:8], params)
    assert small.engine.speculator.counters.num_steps_off > 0
    # ngram's default: 8 drafts a sequence, so the fused step takes 9 rows of one sequence
    assert small.engine.speculator.num_tokens == 8
    assert small.engine.runner.fused_decoder.max_query_len == 9


def test_drafts_per_step_default_to_the_method():
    assert EngineConfig(speculative_method="ngram").speculative_tokens() == 8
    assert EngineConfig(speculative_method="draft", speculative_model="m").speculative_tokens() == 4
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=3).speculative_tokens() == 3
    assert EngineConfig().speculative_tokens() == 4  # and any method without an entry of its own


def test_speculative_settings_are_checked():
    with pytest.raises(InvalidParameterError, match="speculative_method"):
        LLM("unused", speculative={"method": "medusa"})
    with pytest.raises(InvalidParameterError, match="unknown keys"):
        LLM("unused", speculative={"method": "ngram", "tokens": 3})
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens"):
        LLM("unused", speculative={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(InvalidParameterError, match="prompt_lookup_min"):
        LLM("unused", speculative={"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 4})
