"""`pagedserve bench latency`: one request alone, against llama.cpp in the same run.

    pagedserve bench latency --llama-cpp DIR --gguf MODEL-F32.gguf [--threads 2] [--tokens 64] [--prompt 128]

Two figures, the ones a single chat user feels:
- batch-1 decode: output tok/s of one request generating `--tokens` tokens after a one-token
  prompt, against `llama-bench -p 0 -n TOKENS` (decode from an empty context);
- time to first token of one `--prompt`-token prompt, against llama.cpp's time to process a
  prompt of the same length (`llama-bench -p PROMPT -n 0`, which samples nothing).

llama.cpp runs first, in a child process, before this process creates torch's threads:
torch's idle OpenMP threads would otherwise spin on the cores llama.cpp measures on.
pagedserve runs as configured (the fused decode step on CPU float32) and, in the same run,
with `--enforce-eager`. Each figure is the mean of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from statistics import mean


def llama_bench(binary_dir: str, gguf: str, threads: int, prompt: int, tokens: int, repeat: int) -> dict[str, float]:
    """llama.cpp's mean tok/s for decode (`tg`) and prompt processing (`pp`)."""
    binary = Path(binary_dir) / "llama-bench"
    if not binary.exists():
        raise SystemExit(f"no llama-bench in {binary_dir}")
    figures = {}
    for key, p, n in (("tg", 0, tokens), ("pp", prompt, 0)):
        out = subprocess.run([str(binary), "-m", gguf, "-p", str(p), "-n", str(n), "-t", str(threads),
                              "-r", str(repeat), "-o", "json"], check=True, capture_output=True, text=True).stdout
        figures[key] = float(json.loads(out)[0]["avg_ts"])
    return figures


def measure_pagedserve(model: str, threads: int, prompt: int, tokens: int, repeat: int, eager: bool) -> dict[str, float]:
    """Mean batch-1 decode tok/s and TTFT (seconds) of the in-process engine."""
    import torch

    from pagedserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, dtype="float32", enforce_eager=eager, enable_prefix_caching=False, num_threads=threads)
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    # warm-up with a prompt of the measured length, so the first TTFT is not a cold one
    llm.generate([[11] * prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    decode, ttft = [], []
    for i in range(repeat):
        engine.add_request(f"decode-{i}", [int(torch.randint(100, vocab - 100, (1,), generator=generator))],
                           SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
        engine.step()  # the one-token prompt and the first token
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        decode.append(tokens / (time.perf_counter() - started))

        ids = torch.randint(100, vocab - 100, (prompt,), generator=generator).tolist()
        engine.add_request(f"ttft-{i}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        started = time.perf_counter()
        while not any(d.finished for d in engine.step()):
            pass  # the prompt's chunks, then its one token
        ttft.append(time.perf_counter() - started)
    return {"decode_tok_s": mean(decode), "ttft_s": mean(ttft)}


def run(args: argparse.Namespace) -> int:
    peer = None
    if args.llama_cpp:
        if not args.gguf:
            raise SystemExit("--llama-cpp needs --gguf (the same model, f32)")
        peer = llama_bench(args.llama_cpp, args.gguf, args.threads, args.prompt, args.tokens, args.repeat)
    rows = []
    for eager in (False, True):
        figures = measure_pagedserve(args.model, args.threads, args.prompt, args.tokens, args.repeat, eager)
        rows.append(("pagedserve" + (" --enforce-eager" if eager else ""), figures["decode_tok_s"], figures["ttft_s"]))
    if peer is not None:
        rows.insert(0, ("llama.cpp f32", peer["tg"], args.prompt / peer["pp"]))
    import torch

    print(f"model={args.model} float32 threads={args.threads} torch={torch.__version__} "
          f"decode: {args.tokens} tokens after a 1-token prompt; TTFT: {args.prompt}-token prompt; "
          f"mean of {args.repeat}")
    print(f"{'system':28} {'decode tok/s':>13} {'ms/token':>9} {'x llama.cpp':>12} {'TTFT ms':>9} {'x llama.cpp':>12}")
    for name, tok_s, ttft in rows:
        ratio = f"{tok_s / peer['tg']:.2f}" if peer else "-"
        ttft_ratio = f"{(args.prompt / peer['pp']) / ttft:.2f}" if peer else "-"
        print(f"{name:28} {tok_s:13.1f} {1e3 / tok_s:9.1f} {ratio:>12} {ttft * 1e3:9.1f} {ttft_ratio:>12}")
    print("x llama.cpp: its time over ours (above 1: pagedserve is faster)")
    return 0
