"""Reference outputs from transformers for the engine tests."""

from __future__ import annotations

import numpy as np
import torch


def mixed_prompts(num: int = 16, seed: int = 0, vocab: int = 320) -> list[list[int]]:
    """Prompts of mixed lengths, none a multiple of 16; the second half share a 37-token prefix."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(1, 90, size=num)]
    lengths = [n + 1 if n % 16 == 0 else n for n in lengths]
    prefix = rng.integers(3, vocab, size=37).tolist()
    prompts = []
    for i, n in enumerate(lengths):
        body = rng.integers(3, vocab, size=n).tolist()
        prompts.append(prefix + body if i >= num // 2 else body)
    return prompts


def hf_greedy(model_dir, prompts, max_new_tokens: int, dtype=torch.float32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # compare full lengths
    model.generation_config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
            out.append(ids[0, len(p) :].tolist())
    return out


def assert_same_completions(expected, got) -> None:
    """Each request's completions agree: token ids, finish reasons and text."""
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in e.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in e.outputs]


def assert_pool_clean(engine) -> None:
    """Every block is back in the free queue with no references."""
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not engine.scheduler.has_unfinished_requests()


def decode_batch_of_three(engine):
    """The runner's inputs for one decode step of 3 sequences at different positions (5, 17
    and 40 tokens: odd block counts), their blocks allocated in the engine's KV cache."""
    from pagedserve import SamplingParams
    from pagedserve.common.contracts import Request, ScheduledRequest

    entries = []
    for i, length in enumerate([5, 17, 40]):
        request = Request(f"r{i}", list(range(3 + i, 3 + i + length)), SamplingParams(), frozenset(), max_tokens=4)
        assert engine.kv_manager.allocate_slots(request, length)
        request.num_computed_tokens = length - 1  # its last prompt token is this step's decode
        entries.append(ScheduledRequest(request, 1, engine.kv_manager.block_ids(request)))
    return engine.runner.prepare_inputs(entries)


def eager_then_fused(engine):
    """`decode_batch_of_three` through the model's forward, then (from the same caches)
    through the fused CPU step: (eager hidden, the caches the forward left, the caches
    before, fused hidden); the caches end as the fused step left them. Call under
    inference_mode."""
    runner = engine.runner
    assert runner.fused_decoder is not None
    batch = decode_batch_of_three(engine)
    before = [c.clone() for c in runner.kv_caches]
    input_ids, positions, metadata = runner._tensors(batch)
    eager = runner.model(input_ids, positions, metadata, runner.kv_caches)
    eager_kv = [c.clone() for c in runner.kv_caches]
    for cache, old in zip(runner.kv_caches, before):
        cache.copy_(old)
    return eager, eager_kv, before, runner.fused_decoder.forward(batch)


def assert_fused_step_equals_eager(engine) -> None:
    """One decode step of 3 sequences at different positions (5, 17 and 40 tokens): the
    hidden states, the KV written and the logits of the engine's fused CPU step against the
    model's own forward, to float rounding; the greedy tokens exactly."""
    runner = engine.runner
    fused = runner.fused_decoder
    with torch.inference_mode():
        eager, eager_kv, _, hidden = eager_then_fused(engine)
        torch.testing.assert_close(hidden, eager, rtol=1e-4, atol=1e-4)
        for cache, expected in zip(runner.kv_caches, eager_kv):
            torch.testing.assert_close(cache, expected, rtol=1e-5, atol=1e-5)
        eager_logits = runner.model.compute_logits(eager)
        torch.testing.assert_close(fused.logits(hidden), eager_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(fused.logits(hidden).argmax(-1), eager_logits.argmax(-1))
