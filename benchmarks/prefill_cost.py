"""Where a CPU prefill step goes, against the machine's float32 FMA peak.

    python benchmarks/prefill_cost.py [--lengths 512,2048] [--threads 2] [--rounds 3]

For each prompt length n, one request of n random tokens is prefilled in one step (the step
budget is n) and timed with the hooks of `bench offline --profile` (pagedserve/bench/step_profile.py):
the linear layers, the attention backend, and the rest of the step. Printed per length (median
of the rounds): the step, linear and attention times, the linear layers' GFLOP/s
(2 · n · their weights, the LM head included when it runs on the last row only: it is left out),
and the attention's share of the step.

The FMA peak is computed, not measured: threads × the cores' clock (the highest "cpu MHz" in
/proc/cpuinfo, which reads the current clock, not the boost) × float32 FLOP per cycle: 32 for
AVX2 + FMA (two 256-bit FMA pipes, 8 lanes, 2 FLOP) and for AMD's AVX-512 up to Zen 4 (family
25, which runs a 512-bit FMA on both 256-bit pipes), 64 for an Intel core with AVX-512 (two
512-bit FMA units assumed) and for AMD family 26 and later (Zen 5: two 512-bit FMA pipes on the
EPYC and desktop parts; its laptop parts split them in two, and `--flop-per-cycle 32` says so).
A core that boosts above the reported clock can exceed it.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from statistics import median


def fma_peak(threads: int, info: str | None = None, per_cycle: int | None = None) -> tuple[float, str]:
    """(GFLOP/s, how it was computed) of `threads` cores in float32 FMAs, from `info` (the text
    of /proc/cpuinfo, read when None); `per_cycle` overrides the FLOP a cycle the flags imply."""
    if info is None:
        info = Path("/proc/cpuinfo").read_text()
    mhz = max((float(v) for v in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)), default=0.0)
    found = re.search(r"^flags\s*:(.*)$", info, re.M)
    flags = set(found.group(1).split()) if found else set()
    family = re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
    amd = "AuthenticAMD" in info
    full_width = not amd or (family is not None and int(family.group(1)) >= 26)  # two 512-bit FMA pipes
    if per_cycle is None:
        per_cycle = (64 if full_width else 32) if "avx512f" in flags else 32 if "fma" in flags else 8
    how = f"{threads} threads x {mhz:.0f} MHz x {per_cycle} FLOP/cycle ({'AMD' if amd else 'Intel'}" \
          f"{f' family {family.group(1)}' if amd and family else ''}, " \
          f"{'avx512f' if 'avx512f' in flags else 'avx2+fma' if 'fma' in flags else 'no fma'})"
    return threads * mhz * 1e6 * per_cycle / 1e9, how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flop-per-cycle", type=int, default=None,
                        help="float32 FLOP a core does a cycle, instead of what the CPU's flags imply")
    parser.add_argument("--no-pack-cpu-weights", action="store_true",
                        help="torch's BLAS on the [out, in] weights instead of the packed product (the default)")
    args = parser.parse_args(argv)

    import torch

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.step_profile import _instrumented, _Timers
    from pagedserve.kernels.cpu_packed import PackedLinear

    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(args.model, max_num_batched_tokens=max(lengths), enable_prefix_caching=False,
              kv_cache_memory=1 << 30, num_threads=args.threads, pack_cpu_weights=not args.no_pack_cpu_weights)
    engine = llm.engine
    model = engine.runner.model
    head = getattr(model, "lm_head", None)
    linear_params = sum(m.in_features * m.out_features for m in model.modules()
                        if isinstance(m, (torch.nn.Linear, PackedLinear)) and m is not head)
    peak, how = fma_peak(args.threads, per_cycle=args.flop_per_cycle)
    vocab = engine.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    print(f"{args.model}: {linear_params / 1e6:.1f} M weights in the decoder's linear layers; threads={args.threads} "
          f"torch={torch.__version__} pack_cpu_weights={not args.no_pack_cpu_weights}; FMA peak {peak:.0f} GFLOP/s = {how}")
    for n in lengths:
        steps, linears, attentions = [], [], []
        for r in range(args.rounds + 1):  # the first round warms up
            prompt = torch.randint(100, vocab - 100, (n,), generator=generator).tolist()
            engine.add_request(f"prefill-{n}-{r}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
            timers = _Timers()
            with _instrumented(engine, timers):
                timers.on = True
                started = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - started
                timers.on = False
            assert engine.last_step is not None and engine.last_step.num_batched_tokens == n, "one step, the whole prompt"
            while engine.has_unfinished_requests():
                engine.step()
            if r:
                steps.append(elapsed)
                linears.append(timers.seconds.get("linear", 0.0) - timers.seconds.get("lm_head", 0.0))
                attentions.append(timers.seconds.get("attention", 0.0))
        step, linear, attention = median(steps), median(linears), median(attentions)
        gflops = 2 * n * linear_params / linear / 1e9
        print(f"prefill {n:5d} tokens: step {step * 1e3:8.1f} ms; linear {linear * 1e3:8.1f} ms "
              f"({gflops:6.1f} GFLOP/s, {gflops / peak:.0%} of the peak); attention {attention * 1e3:7.1f} ms "
              f"({attention / step:.0%} of the step); rest {(step - linear - attention) * 1e3:6.1f} ms")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
