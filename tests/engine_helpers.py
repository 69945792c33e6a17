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


def assert_pool_clean(engine) -> None:
    """Every block is back in the free queue with no references."""
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not engine.scheduler.has_unfinished_requests()
