"""Resuming a request another worker began: the client's tokens and text go on seamlessly."""

from __future__ import annotations

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.engine import Engine, ResumedCompletion

from engine_helpers import assert_pool_clean

PROMPT = [5, 17, 33, 101, 7, 250, 3]


def _run(engine: Engine, request_id: str, params: SamplingParams, resume=None) -> list[list[tuple[list[int], str, str | None]]]:
    """Per completion, every (new tokens, text delta, finish reason) the engine emits."""
    engine.add_request(request_id, PROMPT, params, resume=resume)
    seen = {i: len(r.token_ids) for i, r in enumerate(resume or [])}  # the client has these
    events: list[list] = [[] for _ in range(params.n)]
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.deltas:
                assert d.start == seen.get(d.index, 0)  # each delta continues exactly where the last ended
                seen[d.index] = d.start + len(d.token_ids)
                if d.token_ids or d.text:
                    events[d.index].append((d.token_ids, d.text, d.finish_reason))
    return events


def test_greedy_resume_continues_exactly(tiny_checkpoint):
    engine = Engine(model=str(tiny_checkpoint("llama-gqa")), attention_backend="torch", kv_cache_memory=1 << 22)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = _run(engine, "a", params)[0]
    tokens = [t for new, _, _ in full for t in new]
    text = "".join(d for _, d, _ in full)
    for cut in (1, 9, 23):  # the client had `cut` tokens when the first worker died
        sent = full[:cut]
        prior = ResumedCompletion([t for new, _, _ in sent for t in new], sum(len(d) for _, d, _ in sent))
        rest = _run(engine, f"b{cut}", params, resume=[prior])[0]
        assert prior.token_ids + [t for new, _, _ in rest for t in new] == tokens
        assert "".join(d for _, d, _ in sent) + "".join(d for _, d, _ in rest) == text
        assert rest[-1][2] == "length"
    assert_pool_clean(engine)


def test_sampled_resume_keeps_the_sent_tokens_and_the_length(tiny_checkpoint):
    engine = Engine(model=str(tiny_checkpoint("llama-gqa")), attention_backend="torch", kv_cache_memory=1 << 22)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, n=2, logprobs=2)
    prior = [ResumedCompletion([11, 12, 13], 0), ResumedCompletion([21, 22, 23, 24], 0)]
    engine.add_request("s", PROMPT, params, resume=prior)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished
    final = outs[-1].output
    assert final.outputs[0].token_ids[:3] == [11, 12, 13] and len(final.outputs[0].token_ids) == 12
    assert final.outputs[1].token_ids[:4] == [21, 22, 23, 24] and len(final.outputs[1].token_ids) == 12
    # logprobs are given for the new tokens only: the client has the others
    assert [len(c.logprobs) for c in final.outputs] == [9, 8]
    assert_pool_clean(engine)


def test_resume_skips_completions_that_had_ended(tiny_checkpoint):
    engine = Engine(model=str(tiny_checkpoint("llama-gqa")), attention_backend="torch", kv_cache_memory=1 << 22)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    prior = [ResumedCompletion([1, 2, 3, 4, 5, 6], 4, finish_reason="length"), ResumedCompletion([7], 1)]
    events = _run(engine, "e", params, resume=prior)
    assert events[0] == []  # nothing more for the finished one
    assert sum(len(new) for new, _, _ in events[1]) == 5 and events[1][-1][2] == "length"
    assert_pool_clean(engine)
