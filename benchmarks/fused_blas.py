"""Decode steps at larger batches: the eager forward, the fused CPU step with our own
products, and the fused step with torch's BLAS for its float32 products, alternated round by
round in one process.

    python benchmarks/fused_blas.py [--batches 16,32,64] [--blas-rows 17] [--rounds 3]
        [--steps 8] [--threads 2]

Each engine is loaded once; each round profiles every batch size on every engine in turn
(pagedserve/bench/step_profile.py's `profile_decode`: a batch of 128-token prompts, then
`--steps` decode steps of all of them), so a change in the machine's load falls on all three.
Printed: per batch size and engine, the median step time over the rounds, its linear /
attention / other split, and each engine's ratio to the eager forward per round.
"""

from __future__ import annotations

import argparse
from statistics import median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="16,32,64")
    parser.add_argument("--blas-rows", type=int, default=17)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from pagedserve import LLM
    from pagedserve.bench.step_profile import profile_decode

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    # unpacked float32 weights (packed ones ignore blas rows); the packed default is `bench offline --profile`
    common = dict(max_num_seqs=max(batches), enable_prefix_caching=False, kv_cache_memory=1 << 30,
                  pack_cpu_weights=False)
    engines = {
        "eager": LLM(args.model, enforce_eager=True, **common),
        "fused": LLM(args.model, fused_decode_max_batch=max(batches), **common),
        f"fused+blas{args.blas_rows}": LLM(args.model, fused_decode_max_batch=max(batches),
                                           fused_decode_blas_rows=args.blas_rows, **common),
    }
    for llm in engines.values():
        profile_decode(llm.engine, 1, 128, 2, seed=99)  # warm-up
    runs: dict[tuple[str, int], list] = {(name, b): [] for name in engines for b in batches}
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
        for b in batches:
            for name in order:
                runs[name, b].append(profile_decode(engines[name].engine, b, 128, args.steps, seed=round_))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\nthreads={args.threads} torch={torch.__version__}; ms per decode step, median of {args.rounds} rounds "
          f"(linear / attention / other); ratio to eager per round")
    for b in batches:
        for name in engines:
            ps = runs[name, b]
            ratios = [p.step / e.step for p, e in zip(ps, runs["eager", b])]
            print(f"batch {b:3d} {name:16} {median(p.step for p in ps) * 1e3:8.1f} ms "
                  f"({median(p.linear for p in ps) * 1e3:.1f} / {median(p.attention for p in ps) * 1e3:.1f} / "
                  f"{median(p.other_model for p in ps) * 1e3:.1f})  x eager {median(ratios):.2f} "
                  f"[{min(ratios):.2f}, {max(ratios):.2f}]  fused={ps[0].fused}")
    for llm in engines.values():
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
