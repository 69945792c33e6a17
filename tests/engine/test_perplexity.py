"""Perplexity through the engine's runner and paged KV cache (pagedserve/bench/perplexity.py):
the harness against transformers' own loss on a tiny random model, then the default model's
perplexity with int8 weights against float32 on the public-domain text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.bench.perplexity import default_text, perplexity, text_tokens, windows
from pagedserve.engine.engine import Engine

from engine_helpers import assert_pool_clean


def test_windows_score_every_token_once():
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert windows(8, 4, 4) == [(0, 4, 1), (4, 8, 5)]
    assert windows(5, 8, 8) == [(0, 5, 1)]
    with pytest.raises(ValueError, match="stride"):
        windows(10, 4, 5)


def hf_window_nll(model, tokens: list[int], begin: int, end: int, first: int) -> float:
    """transformers' own loss (mean over the labels that are not -100), times their count:
    the summed NLL of tokens [first, end) of the window [begin, end)."""
    ids = torch.tensor([tokens[begin:end]])
    labels = ids.clone()
    labels[0, : first - begin] = -100
    with torch.inference_mode():
        loss = model(input_ids=ids, labels=labels).loss
    return float(loss) * (end - first)


@pytest.mark.parametrize(("context", "stride", "chunk"), [(256, 256, 64), (256, 96, 100), (64, 48, 1)])
def test_nll_equals_transformers_loss(tiny_checkpoint, context, stride, chunk):
    """700 random tokens: the harness's summed NLL against transformers' loss on the same
    windows, within float32 rounding. Chunks of 64 and 100 tokens (the later ones attend to
    the cache the earlier ones wrote, across block boundaries), and chunks of one token (every
    position a decode step: the fused CPU decode step and its LM head)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint("llama-tied")
    tokens = np.random.default_rng(7).integers(3, 320, size=700).tolist()
    engine = Engine(model=str(model_dir), kv_cache_memory=1 << 22, max_model_len=512)
    fused = engine.runner.fused_decoder
    assert fused is not None
    fused_steps = fused.num_steps
    result = perplexity(engine, tokens, context, stride, chunk)
    assert_pool_clean(engine)
    spans = windows(len(tokens), context, stride)
    # every window feeds all its tokens but the last; one-token chunks are decode steps
    assert fused.num_steps - fused_steps == (sum(end - begin - 1 for begin, end, _ in spans) if chunk == 1 else 0)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = sum(hf_window_nll(hf, tokens, *span) for span in spans)
    assert result.num_scored == sum(end - first for _, end, first in spans)
    assert result.num_scored == (len(tokens) - 1 if stride < context else len(tokens) - len(spans))
    assert result.num_windows == len(spans)
    assert result.nll == pytest.approx(expected, rel=1e-6)
    print(f"\nNLL {result.nll:.4f} transformers {expected:.4f} over {result.num_scored} tokens")


def test_window_longer_than_the_context_is_refused(tiny_checkpoint):
    """A pool of 4 blocks of 16 tokens caps max_model_len at 64 (2 layers × K and V × 2 heads
    × 16 dims × 4 bytes = 512 bytes a token): a window of 100 tokens is refused before it runs."""
    engine = Engine(model=str(tiny_checkpoint("llama-tied")), kv_cache_memory=4 * 16 * 512, max_model_len=512)
    with pytest.raises(ValueError, match="context 100 exceeds the engine's max_model_len 64"):
        perplexity(engine, list(range(3, 203)), context=100)
    assert perplexity(engine, list(range(3, 203)), context=64, chunk=16).num_windows == 4
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        perplexity(engine, [5], context=64)
    assert_pool_clean(engine)


#: the default model's test reads the text's first 6 windows of 1024 tokens: 6,138 tokens
#: scored (each window's first token has no context). The figures in docs/performance-history.md
#: ("Perplexity") are the CLI's over 20 windows; 6 keep the suite's three runs of the model
#: (float32, int8 weights, int8 KV) to about a third of the time, with the ratios they assert
#: still far inside the bounds (see the printed figures).
CONTEXT = 1024
NUM_WINDOWS = 6
NUM_TOKENS = NUM_WINDOWS * CONTEXT
CHUNK = 256  # each window in 4 prefill chunks: the later ones read the K/V the earlier ones cached


def default_model_perplexity(**overrides):
    engine = Engine(max_model_len=CONTEXT, kv_cache_memory=1 << 27, **overrides)
    tokens = text_tokens(engine, default_text(), NUM_TOKENS)
    assert len(tokens) == NUM_TOKENS
    return perplexity(engine, tokens, CONTEXT, chunk=CHUNK)


@pytest.fixture(scope="module")
def float32_perplexity():
    return default_model_perplexity()


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "bound"), [
    pytest.param({"quantization": "int8"}, 1.02, id="int8-weights"),
    pytest.param({"kv_cache_dtype": "int8"}, 1.01, id="int8-kv"),  # measured: 27.4268 against 27.4194, 1.0003
])
def test_default_model_perplexity_within_bound(float32_perplexity, overrides, bound):
    """Perplexity of the default model on Jekyll and Hyde (its first 6,144 tokens), float32 against
    a quantized engine: at most `bound` times float32's (issue #17: int8 weights 2%, int8
    KV 1%). Both figures are printed (docs/performance-history.md, "Perplexity")."""
    base = float32_perplexity
    result = default_model_perplexity(**overrides)
    ratio = result.value / base.value
    print(f"\nperplexity over {base.num_scored} tokens: float32 {base.value:.4f}, {overrides} {result.value:.4f}, "
          f"ratio {ratio:.4f}")
    assert base.num_scored == result.num_scored == NUM_TOKENS - NUM_WINDOWS == 6_138
    # a broken harness could make both equal and meaningless: a uniform guess scores 49,152
    assert base.value < 100
    assert ratio <= bound
