"""Perplexity of a model on a fixed English text, through the engine's own model runner and
paged KV cache: what an `EngineConfig` changes (int8 weights, a quantized KV cache) is what
is measured.

    python -m pagedserve.bench.perplexity [--text FILE] [--max-tokens N] [--context 1024]
        [--stride 1024] [--chunk 256] [any engine flag: --model M --quantization int8 ...]

The text (default: bench/data/jekyll_hyde.txt, public domain, see bench/data/README.md) is
tokenized whole, without special tokens, and cut to its first `--max-tokens` tokens. It is
read in windows of `--context` tokens, `--stride` tokens apart (the last one ends at the
text's end). Each window is a fresh sequence in the KV cache, fed through the runner in
prefill chunks of `--chunk` tokens, so each chunk attends to the K/V that the earlier chunks
left in the cache, as a long prompt does in serving. A window scores the tokens no earlier
window scored, each from the logits of the position before it: with stride == context every
token but the first of each window, with a smaller stride every token but the text's first,
with at least context - stride tokens before it. perplexity = exp(summed NLL / tokens scored).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedserve.common.contracts import Request, ScheduledRequest
from pagedserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.engine import Engine

#: the default text: R. L. Stevenson, Strange Case of Dr Jekyll and Mr Hyde (1886), 35,740
#: tokens with the SmolLM2 tokenizer
DEFAULT_TEXT = "jekyll_hyde.txt"

_ids = count()


def default_text() -> str:
    return files("pagedserve.bench").joinpath(f"data/{DEFAULT_TEXT}").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Perplexity:
    """The result over one text."""

    nll: float  # summed negative log-likelihood of the scored tokens, in nats
    num_scored: int  # tokens scored
    num_tokens: int  # tokens of the text read
    num_windows: int  # windows run

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.num_scored)


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each window over a text of `num_tokens` tokens: tokens
    [begin, end) are fed, tokens [first, end) scored (the stride of transformers' guide to
    perplexity: each token is scored once, by the first window that holds it with context)."""
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context], got {stride} with context {context}")
    out = []
    scored_to = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        first = max(scored_to, begin + 1)
        if first < end:
            out.append((begin, end, first))
        scored_to = end
        if end == num_tokens:
            break
    return out


@torch.inference_mode()
def window_logits(engine: Engine, tokens: list[int], first: int, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The window `tokens` fed through the runner in chunks of `chunk` tokens, as one sequence
    in the engine's KV cache (freed after): per chunk, the logits of its positions that predict
    a token of tokens[first:] (first >= 1), and those tokens."""
    runner, kv = engine.runner, engine.kv_manager
    request = Request(f"perplexity-{next(_ids)}", tokens, SamplingParams(), frozenset(), max_tokens=1)
    try:
        # the window's last token predicts nothing inside it: it is never fed
        for start in range(0, len(tokens) - 1, chunk):
            n = min(chunk, len(tokens) - 1 - start)
            if not kv.allocate_slots(request, n):
                raise RuntimeError(f"the KV cache ({kv.num_blocks} blocks of {kv.block_size}) cannot hold a "
                                   f"window of {len(tokens)} tokens: give a larger --kv-cache-memory")
            batch = runner.prepare_inputs([ScheduledRequest(request, n, kv.block_ids(request))])
            hidden = runner.forward(batch)
            request.num_computed_tokens += n
            lo = max(0, first - 1 - start)  # row i (position start + i) predicts token start + i + 1
            if lo < n:
                logits = runner.compute_logits(hidden, list(range(lo, n)))
                yield logits, torch.tensor(tokens[start + lo + 1 : start + n + 1], device=logits.device)
    finally:
        kv.free(request)


def window_nll(engine: Engine, tokens: list[int], first: int, chunk: int) -> float:
    """Summed NLL of tokens[first:] (first >= 1), the window fed as `window_logits` does."""
    nll = 0.0
    for logits, targets in window_logits(engine, tokens, first, chunk):
        nll += torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item()
    return nll


def perplexity(engine: Engine, tokens: list[int], context: int, stride: int | None = None,
               chunk: int = 256) -> Perplexity:
    """Perplexity of `tokens` (see the module's docstring); stride None: the context."""
    if context < 2 or chunk < 1:
        raise ValueError("context must be >= 2 and chunk >= 1")
    if context > engine.max_model_len:
        raise ValueError(f"context {context} exceeds the engine's max_model_len {engine.max_model_len}")
    if len(tokens) < 2:
        raise ValueError("a text of fewer than 2 tokens has nothing to score")
    nll, scored = 0.0, 0
    spans = windows(len(tokens), context, stride or context)
    for begin, end, first in spans:
        nll += window_nll(engine, tokens[begin:end], first - begin, chunk)
        scored += end - first
    return Perplexity(nll, scored, len(tokens), len(spans))


def text_tokens(engine: Engine, text: str, max_tokens: int | None = None) -> list[int]:
    tokens = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokens[:max_tokens] if max_tokens else tokens


def main(argv: list[str] | None = None) -> int:
    from pagedserve.common import options
    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.engine.engine import Engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", default=None, metavar="FILE", help=f"UTF-8 text (default: {DEFAULT_TEXT})")
    parser.add_argument("--max-tokens", type=int, default=None, help="read only the text's first N tokens")
    parser.add_argument("--context", type=int, default=1024, help="tokens per window")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: context)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per prefill chunk")
    options.add_arguments(parser, EngineConfig)  # every engine option: --quantization, --dtype, ...
    args = parser.parse_args(argv)
    config = options.build(EngineConfig, args)

    started = time.perf_counter()
    engine = Engine(config)
    loaded = time.perf_counter() - started
    text = default_text() if args.text is None else Path(args.text).read_text(encoding="utf-8")
    tokens = text_tokens(engine, text, args.max_tokens)
    started = time.perf_counter()
    result = perplexity(engine, tokens, args.context, args.stride, args.chunk)
    elapsed = time.perf_counter() - started
    changed = " ".join(options.to_flags(config)) or "(defaults)"
    print(f"engine: {changed}  (loaded in {loaded:.1f} s, quantization and its calibration included)")
    print(f"text: {args.text or DEFAULT_TEXT}, {result.num_tokens} tokens; context {args.context}, "
          f"stride {args.stride or args.context}, chunk {args.chunk}: {result.num_windows} windows")
    print(f"perplexity {result.value:.4f}  (NLL {result.nll:.2f} nats over {result.num_scored} tokens, "
          f"{result.nll / result.num_scored:.5f} per token; {elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
