"""`pagedserve bench offline`: throughput on the reference workloads (bench/workloads.py)
(pagedserve.bench.workloads), in this process.

    pagedserve bench offline --workload fixed|mixed|shared-prefix [--dtype D] [--compare transformers]
        [--vllm-python PEER-VENV/bin/python] [--llama-cpp DIR --gguf MODEL-F32.gguf]   # peers in other processes
    pagedserve bench offline --workload structured [--structured-batches 1,16,64]   # bench/structured.py
    pagedserve bench offline --profile [--profile-batches 1,64]   # where a decode step's time goes

Prints output and total tok/s for pagedserve and, in the same run, for transformers'
static-batch `generate` and `generate_batch`; the ratios; TTFT; and the share of the
wall time spent outside the model forward. `shared-prefix` runs with the prefix cache on
and off. vLLM's CPU engine (bench/vllm_peer.py, in its own interpreter) and llama.cpp's
`llama-batched-bench` (bench/llama_batched.py, `fixed` only) run before pagedserve, in child
processes, before this process starts torch's threads: their idle OpenMP threads would
otherwise spin on the cores the peers measure on. Their rows follow pagedserve's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.bench.request_stats import latency_stats
from pagedserve.bench.workloads import grounded_workload, workload


def run_pagedserve(args, prompts, out_lens):
    from pagedserve import LLM, SamplingParams
    from pagedserve.common.planner import parse_bytes

    kv_bytes = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=int(str(args.max_num_seqs).split(",")[0]), enable_prefix_caching=not args.no_prefix_caching,
              kv_cache_memory=kv_bytes, quantization=getattr(args, "quantization", None),
              quantize_lm_head=getattr(args, "quantize_lm_head", False),
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
              pack_cpu_weights=not getattr(args, "no_pack_cpu_weights", False), **speculative_options(args))
    engine = llm.engine
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    # warm-up on tokens no workload uses, so it leaves nothing in the prefix cache to hit
    llm.generate([[i + 1] * 16 for i in range(4)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    # Where the wall time goes: the model forward (the fused CPU decode step's included), the
    # rest of ModelRunner.run (batch building, the LM head, sampling), and everything else
    # (scheduling, detokenizing, bookkeeping).
    spent = {"forward": 0.0, "runner": 0.0}
    calls = {"forward": 0, "runner": 0}
    model_forward = engine.runner.model.forward
    runner_run = engine.runner.run
    fused = engine.runner.fused_decoder

    def timed(key, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            result = fn(*a, **kw)
            spent[key] += time.perf_counter() - t
            calls[key] += 1
            return result
        return wrapper

    engine.runner.model.forward = timed("forward", model_forward)
    engine.runner.run = timed("runner", runner_run)
    if fused is not None:
        fused.forward = timed("forward", fused.forward)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    del engine.runner.model.forward, engine.runner.run
    if fused is not None:
        del fused.forward
    extra: dict[str, Any] = {"outside_forward_share": 1 - spent["forward"] / elapsed, "outside_runner_share": 1 - spent["runner"] / elapsed,
                             "model_steps": calls["runner"]}  # the runner's steps (each one batch through the model)
    ttft = [o.metrics.time_to_first_token for o in outs]
    e2e = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
    tpot = [(f - t) / (len(o.outputs[0].token_ids) - 1) for o, f, t in zip(outs, e2e, ttft) if len(o.outputs[0].token_ids) > 1]
    extra.update(ttft=latency_stats(ttft), tpot=latency_stats(tpot), e2e=latency_stats(e2e),
                 cached_prompt_tokens=sum(o.num_cached_tokens for o in outs))
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    if engine.speculator is not None:
        c = engine.speculator.counters
        extra["speculative"] = {"proposer": engine.speculator.name, "proposed": c.num_proposed, "verified": c.num_drafts,
                                "accepted": c.num_accepted, "acceptance_rate": c.acceptance_rate,
                                "mean_accepted_length": c.mean_accepted_length, "paused": c.num_paused,
                                "steps_off": c.num_steps_off}
        draft = getattr(engine.speculator.proposer, "num_forwards", None)
        if draft is not None:  # the draft model's own work
            extra["speculative"].update(draft_forwards=draft, draft_tokens=engine.speculator.proposer.num_tokens_fed)
    return elapsed, extra


def speculative_options(args) -> dict[str, Any]:
    """The LLM options of the bench's --speculative-* flags (none without a method)."""
    method = getattr(args, "speculative_method", None)
    if not method:
        return {}
    options = {"speculative_method": method, "num_speculative_tokens": args.num_speculative_tokens,
               "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.speculative_max_batch is not None:
        options["speculative_max_batch"] = args.speculative_max_batch
    if getattr(args, "speculative_model", None):
        options["speculative_model"] = args.speculative_model
    return options


def load_hf(args):
    from transformers import AutoModelForCausalLM

    from pagedserve.common.model_store import resolve_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # every request produces exactly its length
    model.generation_config.pad_token_id = 0
    return model


def run_hf_generate(args, prompts, out_lens, batch_size=16):
    """Static batches with left padding; each batch runs to its longest output, and only
    each request's own tokens are counted."""
    model = load_hf(args)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        chunk, lens = prompts[start : start + batch_size], out_lens[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens), do_sample=False)
    return time.perf_counter() - t0, {"batch_size": batch_size}


def run_hf_generate_batch(args, prompts, out_lens):
    """transformers' continuous batching, one max_new_tokens per request."""
    model = load_hf(args)
    from transformers import GenerationConfig

    gen_config = GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen_config)
    manager.start()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    got = 0
    for _ in range(len(prompts)):
        result = manager.get_result(timeout=3600)
        got += len(result.generated_tokens)
    manager.stop(block=True)
    elapsed = time.perf_counter() - t0
    assert got == sum(out_lens), (got, sum(out_lens))
    return elapsed, {}


def external_peers(args) -> dict[str, Callable[..., tuple[float, dict[str, Any]]]]:
    """The peers that run in child processes, by row name: vLLM's CPU engine with
    `--vllm-python`, llama-batched-bench with `--llama-cpp`."""
    peers: dict[str, Callable[..., tuple[float, dict[str, Any]]]] = {}
    if getattr(args, "vllm_python", None):
        from pagedserve.bench.vllm_peer import run_vllm

        peers["vLLM CPU"] = run_vllm
    if getattr(args, "llama_cpp", None):
        from pagedserve.bench.llama_batched import run_llama_batched

        peers["llama.cpp batched-bench"] = run_llama_batched
    return peers


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.profile:
        from pagedserve.bench.step_profile import run_profile

        return run_profile(args)
    if args.workload == "structured":  # its own runner: structured against unstructured, in rounds
        from pagedserve.bench.structured import run as run_structured

        return run_structured(args)
    if args.compare == "transformers" and not args.peers:
        args.peers = "generate,generate_batch"
    from transformers import AutoConfig

    from pagedserve.common.model_store import resolve_model

    if args.workload == "grounded":
        from transformers import AutoTokenizer

        prompts, out_lens = grounded_workload(AutoTokenizer.from_pretrained(resolve_model(args.model)))
    else:
        prompts, out_lens = workload(args.workload, AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size)
    num_out, num_total = sum(out_lens), sum(out_lens) + sum(len(p) for p in prompts)
    # name → (args, prompts, out_lens) -> (seconds, extra figures)
    systems: dict[str, Callable[..., tuple[float, dict[str, Any]]]] = {"pagedserve": run_pagedserve, "generate": run_hf_generate, "generate_batch": run_hf_generate_batch}
    names = ["pagedserve"] + [p for p in args.peers.split(",") if p]
    external = external_peers(args)  # run first; their rows go last
    systems.update(external)
    if args.workload == "shared-prefix":  # the point of this workload: caching on against off
        systems["pagedserve (no prefix cache)"] = lambda a, p, o: run_pagedserve(argparse.Namespace(**{**vars(a), "no_prefix_caching": True}), p, o)
        names.insert(1, "pagedserve (no prefix cache)")
    if getattr(args, "compare_speculation", False) and getattr(args, "speculative_method", None):
        # speculation on and off, alternated round by round so drift hits both alike
        plain = argparse.Namespace(**{**vars(args), "speculative_method": None})
        names = []
        for i in range(args.rounds):
            on, off = f"pagedserve +{args.speculative_method} #{i + 1}", f"pagedserve #{i + 1}"
            systems[on] = run_pagedserve
            systems[off] = lambda a, p, o: run_pagedserve(plain, p, o)
            names += [on, off]
        names += [p for p in args.peers.split(",") if p]
    sweep = [int(n) for n in str(args.max_num_seqs).split(",")]
    if len(sweep) > 1:  # a concurrency sweep of pagedserve; peers run once
        for n in sweep:
            name = f"pagedserve max_num_seqs={n}"
            systems[name] = lambda a, p, o, n=n: run_pagedserve(argparse.Namespace(**{**vars(a), "max_num_seqs": n}), p, o)
        names = [f"pagedserve max_num_seqs={n}" for n in sweep] + names[1:]
    rows = []
    for name in [*external, *names]:
        elapsed, extra = systems[name](args, prompts, out_lens)
        rows.append({"system": name, "seconds": elapsed, "output_tok_s": num_out / elapsed, "total_tok_s": num_total / elapsed, **extra})
    rows = rows[len(external):] + rows[:len(external)]
    if args.plot:
        from pagedserve.bench.plots import plot_latency_curve

        points = [{"label": r["system"].removeprefix("pagedserve "), "output_throughput": r["output_tok_s"], **r}
                  for r in rows if "ttft" in r]
        plot_latency_curve(points, args.plot, f"pagedserve bench offline: {args.workload}, {args.dtype}")
    from pagedserve.kernels.cpu_attention import build_arch

    base = rows[0]
    print(f"workload={args.workload} model={args.model} dtype={args.dtype} "
          f"pack_cpu_weights={not getattr(args, 'no_pack_cpu_weights', False)} quantization={getattr(args, 'quantization', None)} kv_cache_dtype={getattr(args, 'kv_cache_dtype', 'auto')} "
          f"threads={args.threads} torch={torch.__version__} cpu_march={build_arch()}")
    print(f"{'system':30} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>12} {'pagedserve x':>13} {'TTFT mean/median/p99 s':>24}")
    for r in rows:
        t = r.get("ttft")
        ttft = f"{t['mean_ms'] / 1000:.2f}/{t['median_ms'] / 1000:.2f}/{t['p99_ms'] / 1000:.2f}" if t else "-"
        print(f"{r['system']:30} {r['seconds']:8.1f} {r['output_tok_s']:10.1f} {r['total_tok_s']:12.1f} "
              f"{base['output_tok_s'] / r['output_tok_s']:13.2f} {ttft:>24}")
    for r in rows:
        if "peer_version" in r:
            print(f"{r['system']}: {r['peer_version']}; total tok/s pagedserve {base['total_tok_s']:.1f} / "
                  f"{r['system']} {r['total_tok_s']:.1f} = {base['total_tok_s'] / r['total_tok_s']:.2f}x")
    for r in rows:
        if spec := r.get("speculative"):
            print(f"{r['system']}: {spec['proposer']} proposed {spec['proposed']}, verified {spec['verified']}, "
                  f"accepted {spec['accepted']} ({spec['acceptance_rate']:.1%}), mean accepted length "
                  f"{spec['mean_accepted_length']:.2f}, pauses {spec['paused']}, steps off {spec['steps_off']}"
                  + (f", draft model forwards {spec['draft_forwards']} over {spec['draft_tokens']} tokens"
                     if "draft_forwards" in spec else ""))
    print(f"pagedserve wall time outside the model forward (eager or fused): {base['outside_forward_share']:.1%} "
          f"(of which outside ModelRunner.run, i.e. scheduling/detokenizing/bookkeeping: {base['outside_runner_share']:.1%})")
    if args.json:
        print(json.dumps(rows))
    return 0
