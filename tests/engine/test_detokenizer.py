"""Incremental text: deltas join to the final text, never split a character; stop strings."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.detokenizer import IncrementalDetokenizer, StopStringChecker

from engine_helpers import assert_pool_clean
from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_deltas_never_split_a_character_and_join_to_the_text(tokenizer):
    text = "ñ 中文 🎉 Καλημέρα, the capital of France is Paris."
    ids = tokenizer.encode(text)
    # characters the merges never saw are split into one token per UTF-8 byte
    assert len(tokenizer.encode("中文🎉")) > 3  # more tokens than characters
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Say: "))
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert "" in deltas  # some tokens only started a character


def test_stop_string_found_across_token_boundaries():
    checker = StopStringChecker(["END", "x"])
    assert checker.hold_back == 2
    text = ""
    found = None
    for piece in ["abc E", "N", "D more"]:
        text += piece
        found = checker.find(text, len(piece))
        if found:
            break
    assert found == (4, "END")
    assert checker.find("xyz", 3) == (0, "x")
    assert checker.find("abc", 3) is None


def test_stop_strings_end_generation_and_are_not_in_the_output(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 24)
    tok = llm.get_tokenizer()
    prompt = [5, 17, 33, 80]
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 6
    # pick a stop string that spans the boundary between two generated tokens
    pieces = [tok.decode([t]) for t in free.token_ids]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 1 : boundary + 1]
    assert len(stop) == 2
    expected = text[: text.index(stop)]
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 24
    # stop token ids end it too, and the reason says which
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[free.token_ids[4]]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:5] and out.stop_reason == free.token_ids[4] and out.finish_reason == "stop"
    # min_tokens holds back a stop token id until enough tokens exist
    out = llm.generate([prompt], SamplingParams(max_tokens=24, min_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[free.token_ids[0]]))[0].outputs[0]
    assert len(out.token_ids) >= 8 and free.token_ids[0] not in out.token_ids[:8]
    assert_pool_clean(llm.engine)


def test_streamed_deltas_join_to_the_final_text(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 24)
    engine = llm.engine
    engine.add_request("s", [9, 8, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=["zzzz"]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas += [d.text for d in out.deltas]
            final = out.output
    assert final is not None and final.finished
    assert "".join(deltas) == final.outputs[0].text
    assert final.outputs[0].text == llm.get_tokenizer().decode(final.outputs[0].token_ids)
