"""Tensor parallelism end to end on the CPU (the all-reduce through shared memory, and once
through gloo): the greedy ids of N ranks are those of one, through chunked prefill,
preemption, prefix-cache hits, n = 2, ngram speculation and int8 weights; sizes and models
that cannot split are refused; N = 1 spawns nothing; a rank that dies or hangs fails the
step with an error naming it.

The models are tiny and the attention backend is torch's (the C++ extension is used only
for the shared memory's counters); every engine is closed, so no rank outlives its test."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from pagedserve import SamplingParams
from pagedserve.bench.step_profile import format_profiles, profile_decode
from pagedserve.common.contracts import CausalLMPlugin
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine import model_loader, tensor_parallel
from pagedserve.engine.llm import LLM
from pagedserve.engine.tensor_parallel import RankFailure

from engine_helpers import assert_same_completions, mixed_prompts
from tiny_models import build_checkpoint

#: both sides alike: torch attention (the fused CPU step does not run under TP), small
#: steps so that prompts prefill in chunks
OPTIONS = dict(attention_backend="torch", max_num_batched_tokens=32, num_threads=1)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> Path:
    """8 query heads and 2 KV heads: 2 ranks split the KV heads, 4 ranks replicate them."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama8"), hidden_size=128, head_dim=16,
                            num_attention_heads=8, num_key_value_heads=2, intermediate_size=192)


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory) -> Path:
    """SmolLM2's head layout (9 heads, 3 KV heads, tied embeddings), tiny."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("smol"), hidden_size=144, head_dim=16,
                            num_attention_heads=9, num_key_value_heads=3, intermediate_size=192,
                            tie_word_embeddings=True)


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if anything starts a rank process."""
    def refuse(*args, **kwargs):
        raise AssertionError("a rank process was started")
    monkeypatch.setattr(tensor_parallel.subprocess, "Popen", refuse)


def _rank_pids(llm: LLM) -> list[int]:
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    return [p.pid for p in ranks.processes]


def test_two_ranks_match_one_through_chunked_prefill_preemption_prefix_hits_n2_and_ngram(llama8):
    prompts = mixed_prompts(8, seed=3)  # up to 126 tokens: several 32-token chunks; half share a prefix
    prompts += [list(range(40, 52)) * 4, list(range(100, 107)) * 5]  # repeats: the ngram proposer drafts
    params = [GREEDY] * 8 + [SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)] * 2
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "max_batch": 16}
    # one token's K/V is half as large on each of 2 ranks: the same budget in blocks (16),
    # too few for the batch, so sequences are preempted
    one = LLM(str(llama8), kv_cache_memory=1 << 17, speculative=speculative, **OPTIONS)
    expected = one.generate(prompts, params)
    two = LLM(str(llama8), kv_cache_memory=1 << 16, speculative=speculative, tensor_parallel_size=2, **OPTIONS)
    try:
        assert two.engine.runner.num_blocks == one.engine.runner.num_blocks == 16
        got = two.generate(prompts, params)
        assert_same_completions(expected, got)
        engine = two.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv_manager.pool.stats.num_hits > 0
        assert engine.speculator is not None and engine.speculator.counters.num_drafts > 0
        assert engine.runner.fused_decoder is None and engine.runner.decode_graphs is None
        assert engine.runner.ranks.group.backend == "shared memory"  # `auto` on the CPU
    finally:
        two.close()


def test_four_ranks_replicate_kv_heads_and_a_killed_rank_fails_the_step(llama8):
    prompts = mixed_prompts(6, seed=5)
    expected = LLM(str(llama8), kv_cache_memory=1 << 20, **OPTIONS).generate(prompts, GREEDY)
    four = LLM(str(llama8), kv_cache_memory=1 << 19, tensor_parallel_size=4, **OPTIONS)
    try:
        assert four.engine.runner.kv_pool.spec.num_kv_heads == 1  # 2 KV heads over 4 ranks: each holds one
        assert_same_completions(expected, four.generate(prompts, GREEDY))
        profile = profile_decode(four.engine, 2, prompt_len=20, steps=2)  # `bench offline --profile`
        assert profile.all_reduce > 0 and profile.broadcast > 0
        assert "all-reduce (TP)" in format_profiles([profile])
        pids = _rank_pids(four)
        os.kill(pids[1], signal.SIGKILL)  # rank 2
        started = time.monotonic()
        four.engine.add_request("after-kill", prompts[0], GREEDY)
        with pytest.raises(RankFailure, match="rank 2 .* exited with code -9"):
            for _ in range(1000):  # bounded: a step that swallowed the failure fails the test
                four.engine.step()
        assert time.monotonic() - started < 10
    finally:
        four.close()
    assert all(_exited(pid) for pid in pids)  # close() left no rank behind


def test_three_ranks_on_a_smollm2_shaped_model_and_a_hung_rank_times_out(smollm2_shaped):
    prompts = mixed_prompts(6, seed=9)
    expected = LLM(str(smollm2_shaped), kv_cache_memory=1 << 20, **OPTIONS).generate(prompts, GREEDY)
    three = LLM(str(smollm2_shaped), kv_cache_memory=1 << 20, tensor_parallel_size=3,
                tensor_parallel_timeout=2.0, **OPTIONS)
    try:
        assert_same_completions(expected, three.generate(prompts, GREEDY))
        pids = _rank_pids(three)
        os.kill(pids[0], signal.SIGSTOP)  # rank 1 hangs
        started = time.monotonic()
        three.engine.add_request("after-hang", prompts[0], GREEDY)
        with pytest.raises(RankFailure, match="timed out after 2 s"):  # the step broadcast or the all-reduce
            for _ in range(1000):  # bounded: a step that swallowed the failure fails the test
                three.engine.step()
        assert time.monotonic() - started < 10
    finally:
        three.close()
    assert all(_exited(pid) for pid in pids)


def test_int8_weights_split_across_two_ranks_are_the_unsplit_ones(llama8):
    """Rank 0's int8 shards and scales are exactly the unsplit model's, so with the float
    product (the int8 weights times their scales, `int8_kernel="float"`) 16 greedy tokens of
    every prompt are the unsplit engine's, here with gloo carrying the all-reduce. With the
    CPU's integer kernel the first token and its top logprobs agree; longer runs are not
    asserted there: that kernel quantizes activations per block of 32, and the all-reduce's
    other summation order can round one differently (seen on an AVX2 CPU: 3 of 4 prompts
    identical over 16 tokens)."""
    import torch

    prompts = mixed_prompts(6, seed=11)
    one = LLM(str(llama8), kv_cache_memory=1 << 20, quantization="int8", int8_kernel="float", **OPTIONS)
    expected = one.generate(prompts, GREEDY)
    two = LLM(str(llama8), kv_cache_memory=1 << 19, quantization="int8", int8_kernel="float", tensor_parallel_size=2,
              tensor_parallel_all_reduce="gloo", **OPTIONS)
    try:
        assert two.engine.runner.ranks.group.backend == "gloo"
        assert_same_completions(expected, two.generate(prompts, GREEDY))
        dense, shard = one.engine.runner.model.layers[1], two.engine.runner.model.layers[1]
        o_dense, o_shard = dense.self_attn.o_proj, shard.self_attn.o_proj.linear  # row-parallel: columns 0..63
        assert torch.equal(o_shard.weight, o_dense.weight[:, :64])
        assert torch.equal(o_shard.weight_scale, o_dense.weight_scale)
        up_dense, up_shard = dense.mlp.gate_up_proj, shard.mlp.gate_up_proj.linear  # column-parallel: rows
        assert torch.equal(up_shard.weight[:96], up_dense.weight[:96])  # gate rows 0..95
        assert torch.equal(up_shard.weight[96:], up_dense.weight[192:288])  # up rows 0..95
        assert torch.equal(up_shard.weight_scale[96:], up_dense.weight_scale[192:288])
    finally:
        two.close()

    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    # one integer kernel on every rank and in both engines (not each process's own timed choice)
    expected = LLM(str(llama8), kv_cache_memory=1 << 20, quantization="int8", int8_kernel="flags",
                   **OPTIONS).generate(prompts, first)
    two = LLM(str(llama8), kv_cache_memory=1 << 19, quantization="int8", int8_kernel="flags", tensor_parallel_size=2,
              **OPTIONS)
    try:
        for e, g in zip(expected, two.generate(prompts, first)):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            e_top, g_top = e.outputs[0].logprobs[0].top, g.outputs[0].logprobs[0].top
            assert [t.token_id for t in g_top] == [t.token_id for t in e_top]
            torch.testing.assert_close(torch.tensor([t.logprob for t in g_top]),
                                       torch.tensor([t.logprob for t in e_top]), atol=2e-2, rtol=0)

        # gloo's error in the LM head's gather (a rank's socket closed) is a plain RuntimeError:
        # it still takes the worker down, rather than failing the step's requests and going on
        def reset(tensor):
            raise RuntimeError("Read error: Connection reset by peer")

        two.engine.runner.ranks.group.gather_last_dim = reset
        two.engine.add_request("gather-fails", prompts[0], first)
        with pytest.raises(RankFailure, match="collective failed .*out of step: Read error: Connection reset by peer"):
            two.engine.step()
    finally:
        two.close()


def test_two_ranks_on_nine_heads_are_refused_naming_the_sizes_that_work(smollm2_shaped, no_spawn):
    with pytest.raises(InvalidParameterError, match=r"tensor_parallel_size 2 does not divide num_attention_heads "
                                                    r"\(9\).*sizes that work for this model: 1, 3$"):
        LLM(str(smollm2_shaped), tensor_parallel_size=2, **OPTIONS)


class _NotOptedIn(CausalLMPlugin):
    """A model plugin that says nothing about tensor parallelism (the contract's default)."""


def test_a_model_that_has_not_opted_in_is_refused(llama8, no_spawn, monkeypatch):
    monkeypatch.setattr(model_loader, "load_plugin", lambda group, name: _NotOptedIn)
    with pytest.raises(InvalidParameterError, match="_NotOptedIn does not support tensor parallelism"):
        LLM(str(llama8), tensor_parallel_size=2, **OPTIONS)


def test_one_rank_spawns_nothing(llama8, no_spawn):
    llm = LLM(str(llama8), kv_cache_memory=1 << 20, tensor_parallel_size=1, **OPTIONS)
    assert llm.engine.runner.ranks is None
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 16


def _exited(pid: int) -> bool:
    """Whether the process is gone (a reaped child no longer exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_rank_that_stopped_after_its_own_collective_failed_is_not_named_as_the_cause():
    """Rank 0's collective timed out on a hung rank: a healthy rank whose collective then
    failed too exits with EXIT_AFTER_COLLECTIVE_FAILURE, and the failure names the timeout,
    not it; a rank that died on its own (killed) is still named."""
    import datetime
    import subprocess
    import sys
    from types import SimpleNamespace

    def exited(code: int) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", f"import os; os._exit({code})"])
        process.wait()
        return process

    ranks = object.__new__(tensor_parallel.ShardRanks)  # only what `failure` reads
    ranks.group = SimpleNamespace(timeout=datetime.timedelta(seconds=2))
    follower = exited(tensor_parallel.EXIT_AFTER_COLLECTIVE_FAILURE)
    ranks.processes, ranks.failed = [follower], False
    failure = ranks.failure(RuntimeError("Timed out waiting 2000ms for recv"))
    assert ranks.failed
    assert str(failure).startswith("a tensor-parallel collective failed or timed out after 2 s (a rank hung?)")
    with pytest.raises(RankFailure, match=f"rank 1 \\(pid {follower.pid}\\) exited with code 3"):
        ranks.check_alive()  # outside a failure every exit counts

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait()
    ranks.processes = [follower, killed]
    assert str(ranks.failure(RuntimeError("Connection closed by peer"))) == (
        f"tensor-parallel rank 2 (pid {killed.pid}) exited with code -9")
