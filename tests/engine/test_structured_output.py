"""Structured output in the engine (issue #31) on a tiny random checkpoint: exact constrained
greedy ids against a reference made outside the engine, every engine feature keeps them,
jump-forward on == off, and every failure is visible (never unconstrained tokens)."""

from __future__ import annotations

import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.contracts import GrammarMatcher
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.structured_outputs import StructuredOutputsParams
from pagedserve.engine.engine import Engine, ResumedCompletion
from pagedserve.plugins.llguidance_backend import LLGuidanceBackend

from engine_helpers import assert_pool_clean

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["color", "ok", "n", "tags"],
    "additionalProperties": False,
}
SPEC = StructuredOutputsParams(json=SCHEMA)
PROMPTS = [[5, 17, 33, 101, 7, 250, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9, 8]]
MAX_TOKENS = 96
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=SPEC)
ENGINE = dict(attention_backend="torch", kv_cache_memory=1 << 22)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama-gqa")


def reference(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy ids outside the engine: transformers' logits, masked by llguidance step by step;
    a token the grammar forces is taken without sampling; stop at a completed grammar or EOS."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    backend = LLGuidanceBackend(model_dir, hf.config.vocab_size, frozenset({0}), 1)
    matcher = backend.compile(SPEC).matcher()
    bitmask = backend.allocate_bitmask(1, torch.device("cpu"))
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_tokens and not matcher.is_finished:
            forced = matcher.forced_tokens()
            if forced:
                tokens = forced
            else:
                logits = hf(torch.tensor([prompt + out])).logits[0, -1:].float()
                matcher.fill_bitmask(bitmask, 0)
                backend.apply_bitmask(logits, bitmask, [0])
                tokens = [int(logits.argmax())]
            assert matcher.accept_tokens(tokens)
            out += tokens
            if tokens[-1] == 0:
                break
    return out[:max_tokens]


def ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def baseline(model):
    llm = LLM(str(model), **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY)
    return ids(outputs), [c.finish_reason for o in outputs for c in o.outputs]


def test_constrained_greedy_ids_equal_the_masked_transformers_reference(model, baseline):
    expected = [reference(model, p, MAX_TOKENS) for p in PROMPTS]
    assert baseline[0] == expected
    assert "stop" in baseline[1]  # at least one completes its grammar (the rest run to max_tokens)


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 8},  # chunked prefill, and forced tokens computed in chunks
    {"kv_cache_memory": 8 * 16 * 512},  # 8 blocks for 3 sequences of about 5 blocks each: preemption
    {"attention_backend": "auto"},  # the fused CPU decode step (its logits are masked alike)
    {"attention_backend": "auto", "enforce_eager": True},
    {"structured_output_jump_forward": False},  # forced tokens one per step: the same ids
], ids=["chunked", "preempt", "fused", "eager", "no-jump-forward"])
def test_each_feature_keeps_the_constrained_output(model, baseline, options):
    llm = LLM(str(model), **{**ENGINE, **options})
    outputs = llm.generate(PROMPTS, GREEDY)
    assert ids(outputs) == baseline[0]
    if "kv_cache_memory" in options:
        assert max(o.metrics.num_preemptions for o in outputs) > 0
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_speculative_drafts_are_cut_masked_and_rolled_back(model, baseline, jump_forward):
    """Drafts: the expected continuation with the third draft wrong (verification rows are
    masked per position, rejected drafts roll the matcher back)."""
    expected = {tuple(p): out for p, out in zip(PROMPTS, baseline[0])}

    class Oracle:
        def propose(self, requests, limits):
            drafts = []
            for request, k in zip(requests, limits):
                rest = expected[tuple(request.prompt_token_ids)][request.num_output_tokens :]
                drafts.append([t if j != 2 else (t + 1) % 300 for j, t in enumerate(rest[:k])])
            return drafts

        def finish(self, request_ids):
            pass

    llm = LLM(str(model), speculative={"method": "ngram", "num_speculative_tokens": 3},
              structured_output_jump_forward=jump_forward, **ENGINE)
    assert llm.engine.speculator is not None
    llm.engine.speculator.proposer = Oracle()  # type: ignore[assignment]
    assert ids(llm.generate(PROMPTS, GREEDY)) == baseline[0]
    counters = llm.engine.speculator.counters
    # drafts the grammar rejects are cut before verification, the target rejects others
    assert 0 < counters.num_accepted < counters.num_proposed


def test_n2_seeded_prefix_hit_and_resume(model):
    llm = LLM(str(model), **ENGINE)
    prompt = list(range(20, 60))  # two full blocks: the second run finds them cached
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, structured_outputs=SPEC)
    alone = [ids(llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s,
                                                             structured_outputs=SPEC)))[0] for s in (7, 8)]
    pair = llm.generate([prompt], SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                                                     structured_outputs=SPEC))
    assert ids(pair) == alone  # one matcher per sequence
    again = llm.generate([prompt], sampled)  # the prompt is in the prefix cache now
    assert again[0].num_cached_tokens > 0 and ids(again)[0] == alone[0]

    engine = llm.engine
    for cut in (1, 6, 15):  # resumed after a takeover: the matcher replays the sent tokens
        prior = ResumedCompletion(alone[0][:cut], 0)
        engine.add_request(f"r{cut}", prompt, sampled, resume=[prior])
        final = None
        while engine.has_unfinished_requests():
            for delta in engine.step():
                final = delta.output or final
        assert final is not None and final.outputs[0].token_ids == alone[0]


def test_jump_forward_takes_fewer_steps_for_the_same_ids(model):
    def run(jump_forward: bool) -> tuple[list[int], int, int]:
        engine = Engine(model=str(model), structured_output_jump_forward=jump_forward, **ENGINE)
        engine.add_request("a", PROMPTS[1], GREEDY)
        steps, final = 0, None  # steps that gave the request tokens (not those that waited for its grammar)
        while engine.has_unfinished_requests():
            deltas = engine.step()
            steps += bool(deltas)
            final = next((d.output for d in deltas if d.output is not None), final)
        assert final is not None
        return final.outputs[0].token_ids, steps, engine.structured.counters.num_steps_saved

    on_ids, on_steps, saved = run(True)
    off_ids, off_steps, off_saved = run(False)
    assert on_ids == off_ids
    assert off_saved == 0 and saved > 0
    assert off_steps - on_steps == saved  # each forced token appended beyond one per step saves a step


def _run_engine(engine: Engine, request_id: str, prompt, params):
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == request_id and delta.output is not None:
                final = delta
    return final


def test_a_failing_matcher_ends_the_request_with_an_error(model, baseline, monkeypatch):
    engine = Engine(model=str(model), **ENGINE)
    calls = {"n": 0}
    real_accept = type(engine.structured.backend.compile(SPEC).matcher()).accept_tokens

    def accept(self: GrammarMatcher, tokens):
        calls["n"] += 1
        return False if calls["n"] == 4 else real_accept(self, tokens)

    monkeypatch.setattr(type(engine.structured.backend.compile(SPEC).matcher()), "accept_tokens", accept)
    final = _run_engine(engine, "a", PROMPTS[0], GREEDY)
    assert final.error is not None and "rejected" in final.error
    tokens = final.output.outputs[0].token_ids
    assert tokens == baseline[0][0][: len(tokens)]  # only constrained tokens, none after the failure
    assert engine.structured.counters.num_failed == 1
    assert_pool_clean(engine)


def test_compile_errors_size_limit_and_timeout_are_visible(model):
    engine = Engine(model=str(model), max_structured_output_chars=400, structured_output_compile_timeout=0.2, **ENGINE)
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    for request_id in ("bad1", "bad2"):  # the second finds the error in the cache
        final = _run_engine(engine, request_id, PROMPTS[0], bad)
        assert final.error is not None and final.error.startswith("structured_outputs")
        assert final.output.outputs[0].token_ids == []
    assert engine.structured.counters.num_cache_misses == 1 and engine.structured.counters.num_cache_hits == 1
    with pytest.raises(InvalidParameterError, match="limit is 400"):
        engine.add_request("big", PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(
            choice=["x" * 250, "y" * 250])))
    assert "big" not in engine.output_processor

    backend = engine.structured.backend
    slow_compile = backend.compile
    engine.structured._backend.compile = lambda spec: (time.sleep(0.6), slow_compile(spec))[1]  # type: ignore[union-attr]
    final = _run_engine(engine, "slow", PROMPTS[0], GREEDY)
    assert final.error is not None and "did not compile within 0.2 s" in final.error
    assert final.output.outputs[0].token_ids == []
    assert_pool_clean(engine)


def test_a_slow_grammar_makes_only_its_request_wait(model):
    engine = Engine(model=str(model), **ENGINE)
    backend = engine.structured.backend
    real_compile = backend.compile
    engine.structured._backend.compile = lambda spec: (time.sleep(0.5), real_compile(spec))[1]  # type: ignore[union-attr]
    engine.add_request("slow", PROMPTS[1], GREEDY)
    engine.add_request("plain", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    plain_tokens = 0
    started = time.monotonic()
    while time.monotonic() - started < 0.3:
        for delta in engine.step():
            assert delta.request_id == "plain"
            plain_tokens += sum(len(d.token_ids) for d in delta.deltas)
    slow = engine.scheduler.requests["slow"]
    assert plain_tokens >= 3  # the other request kept producing tokens
    assert not slow.grammar_ready and slow.num_output_tokens == 0
    assert slow.num_computed_tokens == slow.num_prompt_tokens - 1  # prefilled up to the sampling chunk
    engine.abort_request("plain")
    final = _run_engine(engine, "tail", PROMPTS[2], SamplingParams(max_tokens=1))
    assert final is not None
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_clean(engine)
