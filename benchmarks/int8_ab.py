"""Batch-1 decode, float32 against int8 weights, interleaved round by round in one process.

    python benchmarks/int8_ab.py [--rounds 8] [--tokens 32] [--threads 2]
        [--quantize-lm-head] [--no-float-kernel] [--llama-cpp DIR --gguf MODEL-Q8_0.gguf]

On a shared machine the load changes from second to second, so one figure after the other
(`pagedserve bench latency`) compares two different machines. Here both engines are loaded
once and each round times one request of `--tokens` greedy tokens on each (and
`llama-bench -n TOKENS -r 1` on the GGUF, when given), in turn; the per-round ratios are
printed with their range.

Where the CPU has an int8 × int8 kernel (kernels/csrc/cpu_int8_gemv.cpp: avx512vnni, avxvnni
or avx2, the best one on by default), each int8 engine is timed twice per round: `int8` with
it, and `int8/fma` with the float path of cpu_decode.cpp (the process-wide `set_int8_kernel`
switch, flipped around that engine's request); `--no-float-kernel` leaves the `fma` runs out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from statistics import median


def _decode_tok_s(llm, tokens: int, token_id: int) -> float:
    from pagedserve import SamplingParams

    engine = llm.engine
    engine.add_request(f"ab-{time.monotonic_ns()}", [token_id],
                       SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # the one-token prompt and the first token
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - started)


def _cpu_kernels():
    """The CPU extension (None where it cannot be built: then every int8 run is the fallback)."""
    from pagedserve.kernels.cpu_attention import cpu_kernels

    return cpu_kernels()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize-lm-head", action="store_true", help="also an int8 engine with the LM head int8")
    parser.add_argument("--no-float-kernel", action="store_true",
                        help="no int8/fma runs (the float path beside the int8 × int8 kernel)")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR")
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args(argv)

    import torch

    from pagedserve import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    engines = {"float32": LLM(args.model, dtype="float32", enable_prefix_caching=False, num_threads=args.threads)}
    # int8_kernel="flags": the CPU's best int8 x int8 kernel stays selected, to be A/B'd against
    # the float path below (what `auto` would choose is printed first)
    engines["int8"] = LLM(args.model, dtype="float32", enable_prefix_caching=False, num_threads=args.threads,
                          quantization="int8", int8_kernel="flags")
    if args.quantize_lm_head:
        engines["int8+head"] = LLM(args.model, dtype="float32", enable_prefix_caching=False,
                                   num_threads=args.threads, quantization="int8", quantize_lm_head=True,
                                   int8_kernel="flags")
    for llm in engines.values():
        llm.generate([[11] * 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    # (engine, the int8 kernel to select, or None to leave the switch as it is) per figure
    runs: dict[str, tuple[str, str | None]] = {name: (name, None) for name in engines}
    kernels = _cpu_kernels()
    if kernels is not None:
        from pagedserve.kernels.int8_kernel_choice import choose_int8_kernel, int8_layers

        last = list(engines.values())[-1]
        print("what --int8-kernel auto chooses here:",
              choose_int8_kernel(kernels, int8_layers(last.engine.runner.model), "auto").describe())
        kernels.set_int8_kernel(kernels.int8_kernels()[0])
    best = kernels.int8_kernel() if kernels is not None else "float"
    if best != "float":
        print(f"int8: the {best} kernel; int8/fma: the float path")
        for name in [n for n in engines if n != "float32"]:
            runs[name] = (name, best)
            if not args.no_float_kernel:
                runs[name + "/fma"] = (name, "float")
    figures: dict[str, list[float]] = {name: [] for name in runs}
    if args.llama_cpp:
        figures["llama.cpp"] = []
    for i in range(args.rounds):
        if args.llama_cpp:
            out = subprocess.run([str(Path(args.llama_cpp) / "llama-bench"), "-m", args.gguf, "-p", "0", "-n",
                                  str(args.tokens), "-t", str(args.threads), "-r", "1", "-o", "json"],
                                 check=True, capture_output=True, text=True).stdout
            figures["llama.cpp"].append(float(json.loads(out)[0]["avg_ts"]))
        for name, (engine, kernel) in runs.items():
            if kernel is not None:
                kernels.set_int8_kernel(kernel)
            try:
                figures[name].append(_decode_tok_s(engines[engine], args.tokens, 100 + i))
            finally:
                if kernel is not None:
                    kernels.set_int8_kernel(best)
        print("round", i, " ".join(f"{n}={v[-1]:.1f}" for n, v in figures.items()), flush=True)
    print(f"batch-1 decode tok/s, {args.tokens} tokens, {args.threads} threads, {args.rounds} rounds "
          f"(median [min, max]); ratios per round against float32:")
    base = figures["float32"]
    for name, values in figures.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"{name:14} {median(values):7.1f} [{min(values):.1f}, {max(values):.1f}]   "
              f"x float32 {median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
    if args.llama_cpp:
        for name in runs:
            ratios = [v / b for v, b in zip(figures[name], figures["llama.cpp"])]
            print(f"{name} / llama.cpp: {median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
