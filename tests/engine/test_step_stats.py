"""The engine's step and finished-request stats: exact counts for a known schedule."""

from __future__ import annotations

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _run(engine) -> list:
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
    return steps


def test_step_stats_count_tokens_requests_and_prefix_hits(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, block_size=16,
                 max_num_batched_tokens=64).engine
    engine.stats.keep_finished = True  # as the worker service does
    shared = list(range(3, 3 + 40))  # two full blocks and 8 tokens
    engine.add_request("a", shared, GREEDY)
    steps = _run(engine)
    # one prefill step (40 tokens, the first token), then three decodes
    assert [s.num_batched_tokens for s in steps] == [40, 1, 1, 1]
    assert [s.num_prompt_tokens for s in steps] == [40, 0, 0, 0]
    assert [s.num_generated_tokens for s in steps] == [1, 1, 1, 1]
    assert [len(s.inter_token_latencies) for s in steps] == [0, 1, 1, 1]
    assert all(s.request_ids == ("a",) for s in steps)
    assert [s.num_running for s in steps] == [1, 1, 1, 0]
    assert steps[0].prefix_cache_queries == 2 and steps[0].prefix_cache_hits == 0
    assert steps[-1].kv_cache_usage == 0.0  # the finished request's blocks are free (cached, reusable)
    (finished,) = engine.pop_finished()
    assert (finished.request_id, finished.finish_reasons, finished.num_prompt_tokens, finished.num_output_tokens,
            finished.num_cached_tokens, finished.num_preemptions) == ("a", ("length",), 40, 4, 0, 0)
    assert finished.time_to_first_token is not None and 0 < finished.time_to_first_token <= finished.e2e_latency
    assert engine.pop_finished() == []

    # the same prompt again: its two full blocks come from the prefix cache
    engine.add_request("b", shared + [99], GREEDY)
    steps = _run(engine)
    assert steps[0].prefix_cache_queries == 2 and steps[0].prefix_cache_hits == 2
    assert steps[0].num_batched_tokens == 41 - 32 and steps[0].num_prompt_tokens == 41
    (finished,) = engine.pop_finished()
    assert finished.num_cached_tokens == 32


def test_aborts_and_n_completions_are_recorded(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22).engine
    engine.stats.keep_finished = True
    engine.add_request("two", [5, 6, 7], SamplingParams(n=2, max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request("gone", [8, 9], GREEDY)
    engine.step()
    assert engine.last_step is not None
    assert set(engine.last_step.request_ids) == {"two", "gone"}
    # the second completion waits to share the first one's prompt blocks
    assert (engine.last_step.num_generated_tokens, engine.last_step.num_running, engine.last_step.num_waiting) == (2, 2, 1)
    engine.abort_request("gone")
    _run(engine)
    by_id = {f.request_id: f for f in engine.pop_finished()}
    assert by_id["gone"].finish_reasons == ("abort",) and by_id["gone"].num_output_tokens == 1
    assert by_id["two"].finish_reasons == ("length", "length") and by_id["two"].num_output_tokens == 6
    engine.step()  # nothing left: the step computes nothing
    assert engine.last_step is None


def test_in_process_use_keeps_no_finished_stats(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22)
    llm.generate([[4, 5, 6], [7, 8]], GREEDY)
    assert llm.engine.pop_finished() == []  # nobody pops them in-process: none are kept


def test_an_error_abort_and_an_unrecorded_abort(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22).engine
    engine.stats.keep_finished = True
    engine.add_request("failed", [4, 5, 6], GREEDY)
    engine.add_request("moved", [7, 8], GREEDY)
    engine.step()
    assert engine.abort_request("failed", "error").output.outputs[0].finish_reason == "error"
    assert engine.abort_request("moved", record=False) is not None  # another worker carries it on
    assert [(f.request_id, f.finish_reasons) for f in engine.pop_finished()] == [("failed", ("error",))]
