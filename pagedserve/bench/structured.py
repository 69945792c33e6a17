"""`pagedserve bench offline --workload structured`: what structured output (issue #31) costs.

JSON extraction prompts, one per schema of bench/structured_schemas.py, through the model's
chat template, greedy. At each batch size (requests submitted at once: 1 means one after
another; the prompts repeat to fill a batch) every request runs structured, then the same
prompts run unstructured with `max_tokens` = each structured answer's length and
`ignore_eos`, so both passes produce the same tokens. Rounds alternate which goes first;
figures are medians over rounds, the ratio the median of each round's pair.

Also: the backend's mask fill time per structured row (its `fill_bitmasks` timed here, not in
the engine), grammar-ready time per schema (a compile by a fresh backend, then the first
mask), and the decode steps jump-forward saved over the structured output tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from pagedserve.bench.structured_schemas import SCHEMAS

#: the text every prompt extracts from: something for each schema of the suite
TEXT = ("Maria Lopez, 34, ordered 3 blue mugs and 2 red plates at 12.50 each on 2024-03-18 "
        "(order code Abcd-123, zip 94107, email maria.lopez@example.com). She lives in Lyon, "
        "population 522000, and rated the service positive. Task 'ship order' is not done yet.")
BATCH_SIZES = (1, 16, 64)


def extraction_prompt(schema: dict) -> str:
    return f"Extract the facts of this text as JSON following this schema: {json.dumps(schema)}\n\nText: {TEXT}"


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "n": 0}
    ms = np.array(values) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(values)}


def grammar_ready_times(manager, specs, rounds: int) -> list[float]:
    """Seconds from a spec to its first mask: compile by a fresh backend (nothing cached),
    a matcher, one mask row; each spec once per round."""
    import torch

    from pagedserve.plugins import load_plugin

    factory = load_plugin("structured_output", manager.config.structured_output_backend)
    times = []
    for _ in range(rounds):
        backend = factory(manager.tokenizer_dir, manager.vocab_size, manager.eos_token_ids,
                          manager.config.structured_output_threads)
        bitmask = backend.allocate_bitmask(1, torch.device("cpu"))
        for spec in specs:
            t = time.perf_counter()
            matcher = backend.compile(spec).matcher()
            backend.fill_bitmasks([(matcher, 0)], bitmask)
            times.append(time.perf_counter() - t)
    return times


def run_structured(llm, prompts: list[list[int]], schemas: list[dict], batch_sizes=BATCH_SIZES, rounds: int = 3,
                   max_tokens: int = 256) -> dict[str, Any]:
    """The figures of the module docstring, on `llm` (an LLM with max_num_seqs ≥ the largest batch)."""
    from pagedserve import SamplingParams
    from pagedserve.common.structured_outputs import StructuredOutputsParams

    specs = [StructuredOutputsParams(json=s) for s in schemas]
    manager = llm.engine.structured
    backend = manager.backend
    fill_times: list[float] = []  # seconds per row, one entry per row filled
    fill = backend.fill_bitmasks

    def timed_fill(rows, bitmask):
        t = time.perf_counter()
        fill(rows, bitmask)
        per_row = (time.perf_counter() - t) / len(rows)
        fill_times.extend([per_row] * len(rows))

    def run_pass(batch: int, lengths: list[int] | None) -> tuple[float, int, list[int]]:
        """(seconds, prompt + output tokens, output lengths) of one pass; structured when lengths is None."""
        n = max(batch, len(prompts))
        reqs = [(prompts[i % len(prompts)], specs[i % len(specs)]) for i in range(n)]
        if lengths is None:
            params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=s) for _, s in reqs]
        else:
            params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in lengths]
        out_lens: list[int] = []
        finish: list[str | None] = []
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            outs = llm.generate([p for p, _ in reqs[start:start + batch]], params[start:start + batch])
            out_lens += [len(o.outputs[0].token_ids) for o in outs]
            finish += [o.outputs[0].finish_reason for o in outs]
        elapsed = time.perf_counter() - t0
        if lengths is not None:
            assert out_lens == lengths, (out_lens, lengths)
        if lengths is None:
            cut_at_max[batch] = finish.count("length")
        return elapsed, sum(len(p) for p, _ in reqs) + sum(out_lens), out_lens

    cut_at_max: dict[int, int] = {}  # structured requests cut at max_tokens, by batch size
    backend.fill_bitmasks = timed_fill
    try:
        counters = manager.counters
        saved0, forced0 = counters.num_steps_saved, counters.num_forced_tokens
        lengths = {b: run_pass(b, None)[2] for b in batch_sizes}  # warm-up: grammars compiled, lengths known
        structured_out = sum(sum(v) for v in lengths.values())
        forced = {"steps_saved": counters.num_steps_saved - saved0, "forced_tokens": counters.num_forced_tokens - forced0,
                  "output_tokens": structured_out, "cut_at_max_tokens": sum(cut_at_max.values())}
        # (the engine counts forced tokens before a max_tokens cut: the share is exact only
        # when no answer was cut, `cut_at_max_tokens` 0)
        forced["share"] = forced["steps_saved"] / max(structured_out, 1)
        results: dict[int, dict[str, list[float]]] = {b: {"structured": [], "unstructured": []} for b in batch_sizes}
        for r in range(rounds):
            for b in batch_sizes:
                order = ("structured", "unstructured") if r % 2 == 0 else ("unstructured", "structured")
                for kind in order:
                    seconds, tokens, out_lens = run_pass(b, None if kind == "structured" else lengths[b])
                    if kind == "structured":
                        lengths[b] = out_lens  # greedy: the same unless batching changed a near tie
                    results[b][kind].append(tokens / seconds)
    finally:
        del backend.fill_bitmasks
    batches = {}
    for b, res in results.items():
        s, u = res["structured"], res["unstructured"]
        batches[b] = {"structured_tok_s": statistics.median(s), "unstructured_tok_s": statistics.median(u),
                      "ratio": statistics.median(x / y for x, y in zip(s, u)),
                      "structured_rounds": s, "unstructured_rounds": u, "output_tokens": sum(lengths[b])}
    return {"batches": batches, "rounds": rounds, "mask_fill_per_row": _pct(fill_times),
            "grammar_ready": _pct(grammar_ready_times(manager, specs, rounds)), "forced": forced}


def print_report(result: dict[str, Any]) -> None:
    print(f"{'batch':>5} {'structured tok/s':>17} {'unstructured tok/s':>19} {'ratio':>6} {'output tokens':>14}"
          f"   (total tok/s = prompt + output; medians of {result['rounds']} alternated rounds)")
    for b, row in result["batches"].items():
        print(f"{b:>5} {row['structured_tok_s']:17.1f} {row['unstructured_tok_s']:19.1f} {row['ratio']:6.3f} "
              f"{row['output_tokens']:14d}")
    m, g, f = result["mask_fill_per_row"], result["grammar_ready"], result["forced"]
    print(f"mask fill per row: p50 {m['p50_ms']:.3f} ms, p99 {m['p99_ms']:.3f} ms ({m['n']} rows)")
    print(f"grammar ready (compile, cold, + first mask): p50 {g['p50_ms']:.2f} ms, p99 {g['p99_ms']:.2f} ms "
          f"({g['n']} compiles)")
    print(f"jump-forward: {f['steps_saved']} decode steps saved of {f['output_tokens']} output tokens "
          f"({f['share']:.1%}); {f['forced_tokens']} tokens forced; {f['cut_at_max_tokens']} answers cut at max_tokens")


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedserve import LLM
    from pagedserve.common.planner import parse_bytes

    batch_sizes = [int(b) for b in args.structured_batches.split(",")]
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=max(int(str(args.max_num_seqs).split(",")[0]), max(batch_sizes)),
              enable_prefix_caching=not args.no_prefix_caching,
              kv_cache_memory=parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None)
    schemas = SCHEMAS[: args.num_schemas] if args.num_schemas else SCHEMAS
    prompts = [llm.apply_chat_template([{"role": "user", "content": extraction_prompt(s)}]) for s in schemas]
    result = run_structured(llm, prompts, schemas, batch_sizes, args.structured_rounds, args.structured_max_tokens)
    print(f"workload=structured model={args.model} dtype={args.dtype} threads={args.threads} torch={torch.__version__} "
          f"schemas={len(schemas)} prefix_caching={not args.no_prefix_caching}")
    print_report(result)
    if args.json:
        print(json.dumps(result))
    return 0
