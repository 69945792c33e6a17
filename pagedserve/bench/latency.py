"""`pagedserve bench latency`: one request alone, against llama.cpp in the same run.

    pagedserve bench latency --llama-cpp DIR --gguf MODEL-F32.gguf[,MODEL-Q8_0.gguf] [--threads 2] [--tokens 64]
        [--prompt 128] [--depth 0] [--quantization int8 [--quantize-lm-head]]

Two figures, the ones a single chat user feels:
- batch-1 decode: output tok/s of one request generating `--tokens` tokens after a one-token
  prompt, against `llama-bench -p 0 -n TOKENS` (decode from an empty context); with `--depth N`,
  after an N-token prompt of random ids, against `llama-bench -p 0 -n TOKENS -d N` (decode
  after N tokens in llama.cpp's cache, its default f16 one: a long chat's turn);
- time to first token of one `--prompt`-token prompt, against llama.cpp's time to process a
  prompt of the same length (`llama-bench -p PROMPT -n 0`, which samples nothing).

llama.cpp runs first, in a child process, before this process creates torch's threads:
torch's idle OpenMP threads would otherwise spin on the cores llama.cpp measures on.
pagedserve runs as configured (the fused decode step on CPU float32) and, in the same run,
with `--enforce-eager`; with `--quantization`, both again with the weights quantized. Each
figure is the mean of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from statistics import mean


def llama_bench_commands(binary: str, gguf: str, threads: int, prompt: int, tokens: int, repeat: int,
                         depth: int = 0) -> dict[str, list[str]]:
    """The `llama-bench` command lines for decode (`tg`, after `depth` tokens) and prompt processing (`pp`)."""
    common = ["-t", str(threads), "-r", str(repeat), "-o", "json"]
    tg = [binary, "-m", gguf, "-p", "0", "-n", str(tokens)] + (["-d", str(depth)] if depth else []) + common
    return {"tg": tg, "pp": [binary, "-m", gguf, "-p", str(prompt), "-n", "0"] + common}


def llama_bench(binary_dir: str, gguf: str, threads: int, prompt: int, tokens: int, repeat: int,
                depth: int = 0) -> dict[str, float]:
    """llama.cpp's mean tok/s for decode (`tg`) and prompt processing (`pp`)."""
    binary = Path(binary_dir) / "llama-bench"
    if not binary.exists():
        raise SystemExit(f"no llama-bench in {binary_dir}")
    figures = {}
    for key, command in llama_bench_commands(str(binary), gguf, threads, prompt, tokens, repeat, depth).items():
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        figures[key] = float(json.loads(out)[0]["avg_ts"])
    return figures


def measure_pagedserve(model: str, threads: int, prompt: int, tokens: int, repeat: int, eager: bool,
                       quantization: str | None = None, quantize_lm_head: bool = False,
                       depth: int = 0) -> dict[str, float]:
    """Mean batch-1 decode tok/s and TTFT (seconds) of the in-process engine."""
    import torch

    from pagedserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, dtype="float32", enforce_eager=eager, enable_prefix_caching=False, num_threads=threads,
              quantization=quantization, quantize_lm_head=quantize_lm_head)
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    # warm-up with a prompt of the measured length, so the first TTFT is not a cold one
    llm.generate([[11] * prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    decode, ttft = [], []
    for i in range(repeat):
        ids = torch.randint(100, vocab - 100, (max(depth, 1),), generator=generator).tolist()
        engine.add_request(f"decode-{i}", ids, SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
        first_token = False
        while not first_token:  # the prompt (in chunks beyond a step's budget) and the first token
            for d in engine.step():
                if d.error:
                    raise SystemExit(f"the decode request failed: {d.error}")
                first_token = first_token or bool(d.deltas and d.deltas[0].token_ids)
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
    peers: list[tuple[str, dict[str, float]]] = []
    if args.llama_cpp:
        if not args.gguf:
            raise SystemExit("--llama-cpp needs --gguf (the same model, f32; a comma list runs each)")
        for gguf in args.gguf.split(","):
            figures = llama_bench(args.llama_cpp, gguf, args.threads, args.prompt, args.tokens, args.repeat, args.depth)
            peers.append((f"llama.cpp {Path(gguf).stem[-24:]}", figures))
    rows = []
    quantizations: list[str | None] = [None] + ([args.quantization] if args.quantization else [])
    for quantization in quantizations:
        for eager in (False, True):
            figures = measure_pagedserve(args.model, args.threads, args.prompt, args.tokens, args.repeat, eager,
                                         quantization, args.quantize_lm_head, args.depth)
            name = "pagedserve" + (f" {quantization}" if quantization else "") + (
                "+head" if quantization and args.quantize_lm_head else "") + (" --enforce-eager" if eager else "")
            rows.append((name, figures["decode_tok_s"], figures["ttft_s"]))
    peer = peers[0][1] if peers else None
    float_tok_s = rows[0][1]
    rows = [(name, figures["tg"], args.prompt / figures["pp"]) for name, figures in peers] + rows
    import torch

    from pagedserve.kernels.cpu_attention import build_arch

    print(f"model={args.model} float32 activations threads={args.threads} torch={torch.__version__} "
          f"cpu_march={build_arch()} "
          f"decode: {args.tokens} tokens after a {max(args.depth, 1)}-token prompt; TTFT: {args.prompt}-token prompt; "
          f"mean of {args.repeat}")
    first = peers[0][0] if peers else "llama.cpp"
    print(f"{'system':36} {'decode tok/s':>13} {'ms/token':>9} {'x ' + first:>24} {'x ours f32':>11} "
          f"{'TTFT ms':>9} {'x ' + first:>24}")
    for name, tok_s, ttft in rows:
        ratio = f"{tok_s / peer['tg']:.2f}" if peer else "-"
        ttft_ratio = f"{(args.prompt / peer['pp']) / ttft:.2f}" if peer else "-"
        print(f"{name:36} {tok_s:13.1f} {1e3 / tok_s:9.1f} {ratio:>24} {tok_s / float_tok_s:11.2f} "
              f"{ttft * 1e3:9.1f} {ttft_ratio:>24}")
    print(f"x {first}: its time over ours (above 1: faster than it); x ours f32: decode tok/s over "
          "pagedserve float32 (fused) in this run")
    return 0
