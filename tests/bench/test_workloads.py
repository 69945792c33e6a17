"""The reference workloads of WORKLOADS.md, shared by `bench offline` and `bench serve`."""

from __future__ import annotations

import hashlib
import json

import pytest

from pagedserve.bench.workloads import serve_workload, workload
from pagedserve.common.errors import InvalidParameterError


def test_workloads_follow_their_definition():
    prompts, outputs = workload("fixed", 49152)
    assert len(prompts) == 64 and {len(p) for p in prompts} == {128} and outputs == [64] * 64
    prompts, outputs = workload("mixed", 49152)
    assert len(prompts) == 64 and all(16 <= len(p) <= 512 for p in prompts) and all(16 <= n <= 256 for n in outputs)
    assert all(100 <= t < 49052 for p in prompts for t in p)
    prompts, outputs = workload("shared-prefix", 49152)
    assert {tuple(p[:512]) for p in prompts} == {tuple(prompts[0][:512])} and {len(p) for p in prompts} == {544}
    assert len({tuple(p[512:]) for p in prompts}) == 64 and outputs == [32] * 64


def test_serve_workload_has_the_mixed_shapes():
    prompts, outputs = serve_workload(200)
    assert len(prompts) == len(outputs) == 200
    assert all(16 <= len(p) <= 512 for p in prompts) and all(16 <= n <= 256 for n in outputs)
    assert workload("serve") == serve_workload() and workload("serve", 32000, 12) == serve_workload(12, 32000)
    # `mixed` is the first 64 requests' draw of the same generators
    assert workload("mixed", 49152) == serve_workload(64, 49152)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


# sha256 of json.dumps((prompts, output lengths)), taken from the definitions in
# worker/offline_bench.py and common/serve_bench.py before they moved here: figures of
# earlier sessions were measured on exactly these token ids.
PINNED = {
    ("fixed", 49152, None): "14c30ab44f9df0a9",
    ("mixed", 49152, None): "1e473b3b40617fb0",
    ("shared-prefix", 49152, None): "06a343b404dedde2",
    ("serve", 49152, None): "532a4fad737b971d",
    ("serve", 49152, 12): "02de99d672667d5d",
    ("fixed", 32000, None): "2fe773f6176b1da2",
    ("mixed", 32000, None): "c3145d2d572ca54b",
    ("shared-prefix", 32000, None): "123b67a158862468",
    ("serve", 32000, None): "9c083bbcc8f426e5",
}


@pytest.mark.parametrize(("name", "vocab_size", "num_requests"), list(PINNED))
def test_token_ids_are_those_measured_before(name, vocab_size, num_requests):
    assert _digest(workload(name, vocab_size, num_requests)) == PINNED[name, vocab_size, num_requests]


def test_unknown_workload_is_refused():
    with pytest.raises(InvalidParameterError):
        workload("uniform")


def test_multi_turn_turns_grow_from_the_conversation_so_far():
    from pagedserve.bench.workloads import conversations, multi_turn_conversations

    work = multi_turn_conversations()
    assert len(work) == 16 and all(len(c) == 6 for c in work)
    for conversation in work:
        for (before, n), (after, _) in zip(conversation, conversation[1:]):
            # the next prompt is this one, a 32-token answer, and a new user message of 32..256
            assert n == 32 and after[: len(before)] == before
            assert 32 + 32 <= len(after) - len(before) <= 32 + 256
    assert work == multi_turn_conversations()  # seeded: the same every time
    assert conversations("multi-turn", num_requests=2) == work[:2]
    assert conversations("serve", num_requests=3) == [[(p, n)] for p, n in zip(*workload("serve", num_requests=3))]


def test_many_prefixes_share_only_their_system_prompts():
    prompts, outputs = workload("many-prefixes")
    assert len(prompts) == 256 and outputs == [32] * 256
    prefixes = {tuple(p[:-32]) for p in prompts}
    assert len(prefixes) == 32  # every system prompt drawn at least once in 256 draws (seeded)
    assert all(1024 <= len(p) <= 2048 for p in prefixes)
    assert len({tuple(p[-32:]) for p in prompts}) == 256


def test_grounded_prompts_quote_a_passage_of_the_text(tiny_checkpoint):
    """16 chat prompts, each an instruction and a passage of 128..512 tokens of whole
    paragraphs of the Stevenson text, in triple quotes; the same every time."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from pagedserve.bench.workloads import GROUNDED_INSTRUCTIONS, grounded_workload

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("llama-gqa"))
    prompts, outputs = grounded_workload(tok)
    assert len(prompts) == 16 and outputs == [256] * 16 and grounded_workload(tok) == (prompts, outputs)
    text = " ".join((Path(__file__).parents[2] / "pagedserve/bench/data/jekyll_hyde.txt").read_text().split())
    for i, prompt in enumerate(prompts):
        rendered = tok.decode(prompt)
        passage = rendered.split(GROUNDED_INSTRUCTIONS[i % 4] + '\n\n"""\n')[1].split('\n"""')[0]
        assert 128 <= len(tok.encode(passage, add_special_tokens=False)) <= 512
        assert all(" ".join(p.split()) in text for p in passage.split("\n\n"))
