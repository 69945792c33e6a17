"""Scheduling: budgets, chunking, the preemption victim, no starvation, aborts free blocks."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.contracts import Request, RequestStatus, RunnerOutput
from pagedserve.common.engine_config import EngineConfig
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.plugins.fcfs_scheduler import FCFSScheduler

from engine_helpers import assert_pool_clean, mixed_prompts

GREEDY = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def make(num_blocks=8, budget=32, max_seqs=8):
    kv = KVCacheManager(num_blocks, 4, enable_caching=True, model_id="m")
    return FCFSScheduler(EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=4), kv)


def req(rid, n_prompt, t, max_tokens=100):
    """A request whose prompt shares no block with another arrival time's."""
    start = 1 + 1000 * int(t)
    return Request(rid, list(range(start, start + n_prompt)), GREEDY, frozenset(), max_tokens=max_tokens, arrival_time=t)


def step(s, token=7):
    out = s.schedule()
    s.update(out, RunnerOutput([[token] if e.request.num_computed_tokens + e.num_new_tokens == e.request.num_tokens else [] for e in out.scheduled], None))
    return out


def test_budget_chunks_prefill_and_mixes_decodes():
    s = make(num_blocks=16, budget=10)
    s.add_request(req("a", 6, 0.0))
    s.add_request(req("b", 9, 1.0))
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 6), ("b", 4)]
    out = step(s)  # a decodes, b's remaining 5 prompt tokens in the same step
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 5)]
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 1)]


def test_victim_is_the_cheapest_to_recompute_and_never_the_oldest():
    s = make(num_blocks=6, budget=64)
    s.add_request(req("old", 8, 0.0))  # 2 blocks
    s.add_request(req("big", 8, 1.0))  # 2 blocks
    s.add_request(req("small", 3, 2.0))  # 1 block
    step(s)
    assert s.kv.pool.num_free_blocks == 1
    # old and big each need a third block, one is free: big's costs 3 computed tokens (small)
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["small"]
    assert [e.request.request_id for e in out.scheduled] == ["old", "big"]
    preempted = []
    for _ in range(10):
        preempted += [r.request_id for r in step(s).preempted]
    assert preempted[0] == "big"  # at 13 tokens old needs a 4th block; big is the only candidate
    assert "old" not in preempted


def test_preempted_request_goes_back_to_the_front_and_finishes():
    s = make(num_blocks=5, budget=64)
    for i in range(4):
        s.add_request(req(f"r{i}", 5, float(i), max_tokens=10))  # 15 tokens: 4 of the 5 blocks
    finished_order = []
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        tokens = [[7] if e.request.num_computed_tokens + e.num_new_tokens == e.request.num_tokens else [] for e in out.scheduled]
        for u in s.update(out, RunnerOutput(tokens, None)):
            if u.request.is_finished:
                finished_order.append(u.request.request_id)
        if out.preempted:  # preempted requests wait at the very front of the queue
            front = list(s.waiting)[: len(out.preempted)]
            assert set(front) == set(out.preempted)
            assert all(r.status == RequestStatus.PREEMPTED and not s.kv.block_ids(r) for r in front)
    assert sorted(finished_order) == ["r0", "r1", "r2", "r3"]
    assert finished_order[0] == "r0"  # the oldest is never preempted, so it ends first
    assert s.num_preemptions == 3  # each pair running together (r0 r1, r1 r2, r2 r3) outgrows 5 blocks once
    assert s.kv.pool.num_free_blocks == 5


def test_abort_anywhere_frees_blocks(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, max_num_batched_tokens=40)
    engine = llm.engine
    prompts = mixed_prompts()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["%%"]))
    engine.abort_request("r15")  # still waiting
    engine.step()
    engine.abort_request("r0")  # running
    seen_finish = {}
    for _ in range(3):
        for out in engine.step():
            if out.finished:
                seen_finish[out.request_id] = out.output.outputs[0].finish_reason
    for i in range(1, 8):
        aborted = engine.abort_request(f"r{i}")
        if aborted is not None:
            assert aborted.finished and aborted.output.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                seen_finish[out.request_id] = out.output.outputs[0].finish_reason
    assert all(seen_finish[f"r{i}"] == "length" for i in range(8, 15))
    assert engine.abort_request("r3") is None  # already gone
    assert_pool_clean(engine)


def test_a_failing_step_fails_its_requests_not_the_engine(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22)
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = llm.generate([[4, 5, 6]], params)[0].outputs[0].token_ids
    real_forward = engine.runner.forward  # the decode step runs fused or eagerly: fail either
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated device fault")
        return real_forward(*args, **kwargs)

    engine.runner.forward = broken
    engine.add_request("a", [4, 5, 6], params)
    outputs = engine.step() + engine.step()
    failed = [o for o in outputs if o.finished]
    assert len(failed) == 1 and failed[0].error == "RuntimeError: simulated device fault"
    assert failed[0].output.outputs[0].finish_reason == "error"
    assert_pool_clean(engine)
    del engine.runner.forward
    # the engine goes on serving
    assert llm.generate([[4, 5, 6]], params)[0].outputs[0].token_ids == expected


def test_a_prefix_computed_this_step_is_not_computed_twice():
    s = make(num_blocks=32, budget=64)
    shared = list(range(1, 10))  # 2 full blocks of 4 + 1 token
    first = Request("first", shared + [50, 51], GREEDY, frozenset(), max_tokens=10, arrival_time=0.0)
    second = Request("second", shared + [60, 61, 62], GREEDY, frozenset(), max_tokens=10, arrival_time=1.0)
    other = Request("other", [90, 91, 92, 93, 94], GREEDY, frozenset(), max_tokens=10, arrival_time=2.0)
    for r in (first, second, other):
        s.add_request(r)
    out = step(s)
    # second shares first's two full blocks, which first computes now: it waits a step
    assert [e.request.request_id for e in out.scheduled] == ["first", "other"]
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("first", 1), ("other", 1), ("second", 4)]
    assert second.num_cached_tokens == 8
    assert s.kv.block_ids(second)[:2] == s.kv.block_ids(first)[:2]


def test_the_step_budget_defaults_by_device_and_keeps_a_given_one(tiny_checkpoint, tmp_path):
    from pagedserve.common.engine_config import DEFAULT_TOKEN_BUDGET
    from pagedserve.common.errors import InvalidParameterError

    from tiny_models import build_checkpoint

    assert DEFAULT_TOKEN_BUDGET == {"cpu": 2048, "cuda": 8192}
    assert EngineConfig().token_budget("cuda") == 8192 and EngineConfig(max_num_batched_tokens=77).token_budget("cuda") == 77
    model = str(tiny_checkpoint("llama-gqa"))
    # on CPU at most 1024 tokens per torch thread: a step's time stays about the same
    assert [EngineConfig().token_budget("cpu", n) for n in (None, 1, 2, 16)] == [2048, 1024, 2048, 2048]
    assert EngineConfig(max_num_batched_tokens=4096).token_budget("cpu", 1) == 4096  # a given one is kept
    import torch

    engine = LLM(model, device="cpu", kv_cache_memory=1 << 22).engine
    default = min(2048, 1024 * torch.get_num_threads())
    assert engine.config.max_num_batched_tokens == default and engine.scheduler.max_num_batched_tokens == default
    engine = LLM(model, device="cpu", kv_cache_memory=1 << 22, max_num_batched_tokens=300).engine
    assert engine.scheduler.max_num_batched_tokens == 300
    # without chunked prefill a whole prompt must fit one step: the default grows to the context
    long_model = str(build_checkpoint("llama", tmp_path, max_position_embeddings=4096))
    engine = LLM(long_model, device="cpu", kv_cache_memory=1 << 24, enable_chunked_prefill=False).engine
    assert engine.max_model_len == 4096 and engine.scheduler.max_num_batched_tokens == 4096
    with pytest.raises(InvalidParameterError, match="max_num_batched_tokens"):
        LLM(long_model, device="cpu", kv_cache_memory=1 << 24, enable_chunked_prefill=False, max_num_batched_tokens=1024)
