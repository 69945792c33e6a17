"""float32 KV cache against int8 KV (`--kv-cache-dtype int8`), interleaved round by round in
one process, on the default model.

    python benchmarks/kv_int8_ab.py [--rounds 3] [--threads 1] [--context 1024]

Both engines are loaded once (same weights, same --kv-cache-memory); each round runs on
each in turn: the `fixed` offline workload (64 requests, 128 prompt + 64 output tokens,
total tok/s), and one request decoding 32 tokens after a `--context`-token prompt (batch-1
decode tok/s, where the KV read is largest). Then it prints the KV bytes per token and
blocks each pool got, and the greedy ids of a few chat prompts on both (agreement: tokens
equal up to each sequence's first difference).

`--kernel-only`: instead, the C++ decode attention kernel alone on the default model's shape
(9 heads, 3 KV heads, head_dim 64), float32 against int8 rows, min of 30 calls each,
interleaved, per batch size and context.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU cache do?",
    "Give me a short tip for learning to cook.",
]


def _fixed_tok_s(llm, prompts: list[list[int]], output_lens: list[int]) -> float:
    from pagedserve import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    started = time.perf_counter()
    llm.generate(prompts, params)
    return (sum(len(p) for p in prompts) + sum(output_lens)) / (time.perf_counter() - started)


def _long_decode_tok_s(llm, context: int, tokens: int, seed: int) -> float:
    from pagedserve import SamplingParams

    engine = llm.engine
    ids = [100 + (seed * 7919 + i * 104729) % 40000 for i in range(context)]
    engine.add_request(f"ab-{time.monotonic_ns()}", ids,
                       SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
    # the prompt's chunks, up to its first token: decode steps only from here
    while not any(c.token_ids for delta in engine.step() for c in delta.deltas):
        pass
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - started)


def kernel_only(threads: int) -> None:
    import torch

    from pagedserve.kernels.cpu_attention import cpu_kernels
    from pagedserve.kernels.reference_ops import quantize_kv_rows

    torch.set_num_threads(threads)
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels could not be built"
    print(f"paged_decode_attention, 9 heads / 3 KV heads / head_dim 64, block 16, {threads} thread(s), "
          "min of 30 calls, microseconds")
    print(f"{'batch':>5} {'context':>7} {'float32':>9} {'int8':>9} {'int8/float32':>13}")
    for batch, context in ((1, 1024), (1, 4096), (16, 1024), (64, 512)):
        blocks = -(-context // 16)
        cache = torch.randn(2, batch * blocks, 16, 3, 64)
        int8_cache = quantize_kv_rows(cache, torch.int8)
        tables = torch.randperm(batch * blocks, dtype=torch.int32).view(batch, blocks)
        lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, 9, 64)
        best = {"float32": float("inf"), "int8": float("inf")}
        for _ in range(30):
            for name, kv in (("float32", cache), ("int8", int8_cache)):
                started = time.perf_counter()
                kernels.paged_decode_attention(q, kv[0], kv[1], tables, lens, 0.125)
                best[name] = min(best[name], time.perf_counter() - started)
        print(f"{batch:5} {context:7} {best['float32'] * 1e6:9.1f} {best['int8'] * 1e6:9.1f} "
              f"{best['int8'] / best['float32']:13.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before the batch-1 decode")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--kernel-only", action="store_true", help="only the attention kernel, float32 against int8")
    args = parser.parse_args(argv)
    if args.kernel_only:
        kernel_only(args.threads)
        return 0

    import torch

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.workloads import workload

    torch.set_num_threads(args.threads)
    engines = {kv: LLM(args.model, dtype="float32", kv_cache_memory=args.kv_cache_memory, num_threads=args.threads,
                       enable_prefix_caching=False, kv_cache_dtype=kv) for kv in ("auto", "int8")}
    prompts, output_lens = workload("fixed")
    for llm in engines.values():
        llm.generate([[11] * 16], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    figures: dict[str, dict[str, list[float]]] = {kv: {"fixed": [], "decode": []} for kv in engines}
    for i in range(args.rounds):
        for kv, llm in engines.items():
            figures[kv]["fixed"].append(_fixed_tok_s(llm, prompts, output_lens))
            figures[kv]["decode"].append(_long_decode_tok_s(llm, args.context, 32, i))
        print("round", i, " ".join(f"{kv}: fixed {f['fixed'][-1]:.1f} decode {f['decode'][-1]:.1f}"
                                   for kv, f in figures.items()), flush=True)
    print(f"model={args.model} threads={args.threads} rounds={args.rounds} torch={torch.__version__} "
          f"(median [min, max]; ratios per round, int8 / float32)")
    for what, label in (("fixed", "fixed workload, total tok/s"),
                        ("decode", f"batch-1 decode after {args.context} tokens, tok/s")):
        base, int8 = figures["auto"][what], figures["int8"][what]
        ratios = [b / a for a, b in zip(base, int8)]
        print(f"{label:45} float32 {median(base):7.1f} [{min(base):.1f}, {max(base):.1f}]  int8 "
              f"{median(int8):7.1f} [{min(int8):.1f}, {max(int8):.1f}]  x {median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    for kv, llm in engines.items():
        spec = llm.engine.runner.kv_pool.spec
        print(f"KV {kv:5}: {spec.bytes_per_token} bytes per token, {llm.engine.runner.num_blocks} blocks "
              f"of {llm.engine.config.block_size} in {args.kv_cache_memory / 2**20:.0f} MiB")
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    outputs = {}
    for kv, llm in engines.items():
        chats = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        outputs[kv] = [o.outputs[0].token_ids for o in llm.generate(chats, greedy)]
    agreed = identical = total = 0
    for a, b in zip(outputs["auto"], outputs["int8"]):
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed += same
        total += max(len(a), len(b))
        identical += a == b
    print(f"greedy agreement, {len(PROMPTS)} chat prompts x up to 32 tokens: {agreed}/{total} tokens before the "
          f"first difference, {identical}/{len(PROMPTS)} sequences identical")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
