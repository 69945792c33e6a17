"""The GPU checks and figures that gpu_e2e.py does not take: batch invariance with CUDA
graphs, int8 / int4 weights and an fp8 KV cache against bf16, int4 calibration on the GPU,
and ngram speculation at batch 1.

    python benchmarks/gpu_checks.py            # on an NVIDIA GPU (issue #36, items 3 and 4)
    python benchmarks/gpu_checks.py --smoke    # a tiny model; runs anywhere (TRITON_INTERPRET=1 on CPU)

Every model here has random weights (`load_format="dummy"`, normal(0, 0.02)): no real
checkpoint fits the GPU machine's transfer. So the greedy agreement of int8 / fp8 with bf16
is a lower bound of what a trained model shows (near-flat logits flip on small errors),
and ngram's acceptance is whatever a random model's own repetitions give it.

1. Batch invariance: one greedy and one seeded (temperature 0.8) request, alone, then inside
   a batch of 40 others of other lengths, decode steps from CUDA graphs: ids must be equal.
2. Quantization, a Llama-3.2-1B-shaped model: batch-1 decode step and batch-64 output tok/s
   for bf16, `quantization="int8"`, `kv_cache_dtype="fp8_e4m3"` and int4 at group 32 and 128
   (the w4a16 GEMM), and the share of greedy tokens equal to bf16's (position by position,
   8 requests). Then int4 calibration on the GPU: its codes against the CPU's (`calibration`).
3. ngram speculation at batch 1: prompts that hold a passage twice, 128 output tokens;
   speed-up against no speculation, acceptance, greedy ids identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_e2e import TINY, _free, _llm, _model_dir, _prompts, _sync, run_pagedserve  # noqa: E402

from gpu_kernels import pick_device  # noqa: E402

LLAMA32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def batch_invariance(model_dir: Path, device, vocab: int, others: int, out_len: int) -> bool:
    from pagedserve import SamplingParams

    # no prefix caching: the batch would reuse the KV the lone run computed for the target
    llm = _llm(model_dir, device, False, dtype="bfloat16", load_format="dummy", max_num_seqs=64,
               kv_cache_memory=1 << 30 if device.type == "cuda" else 1 << 24, enable_prefix_caching=False)
    target = _prompts(1, 45, vocab)[0]
    params = [SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=out_len, temperature=0.8, seed=7, ignore_eos=True)]
    alone = [llm.generate([target], p)[0].outputs[0].token_ids for p in params]
    fillers = [p[: 20 + 7 * i % 90] for i, p in enumerate(_prompts(others, 120, vocab))]
    ok = True
    for p, want in zip(params, alone):
        mixed = llm.generate(fillers[: others // 2] + [target] + fillers[others // 2:],
                             [SamplingParams(max_tokens=out_len // 2 + i % out_len, temperature=0.8, seed=i,
                                             ignore_eos=True) for i in range(others // 2)]
                             + [p] + [SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)]
                             * (others - others // 2))
        got = mixed[others // 2].outputs[0].token_ids
        same = sum(a == b for a, b in zip(got, want))
        kind = "greedy" if p.temperature == 0 else "seeded"
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        print(f"batch invariance, {kind}: alone vs among {others} others: {same}/{len(want)} tokens equal"
              f"{'' if got == want else f'  DIFFERENT from token {first}'}")
        ok &= got == want
    graphs = llm.engine.runner.decode_graphs
    print(f"  decode graphs: {'CUDA graphs' if graphs is not None and graphs.cuda_graphs else 'eager'}, "
          f"replays {sum(graphs.replays.values()) if graphs else 0}")
    del llm
    _free(device)
    return ok


def invariance_probes(device) -> None:
    """Where a row's bits could depend on its batch, checked one part at a time: torch's
    bf16 matmul (cuBLAS picks its kernel by shape), and the Triton attention of one decode
    row alone, in a decode batch with longer contexts, and beside a prefill chunk."""
    from pagedserve.kernels.triton_attention import TritonAttentionBackend, paged_attention

    g = torch.Generator().manual_seed(3)
    for k, n in ((2048, 6144), (2048, 8192)):
        w = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
        x = torch.randn(2048, k, generator=g).to(device, torch.bfloat16)
        full = torch.nn.functional.linear(x, w)
        for m in (1, 45, 64, 256):
            part = torch.nn.functional.linear(x[:m], w)
            print(f"probe: bf16 linear K={k} N={n}: rows of M={m} == the same rows of M=2048: "
                  f"{torch.equal(part, full[:m])} (max |diff| {(part.float() - full[:m].float()).abs().max().item():.2e})")
    from attention_helpers import metadata_in_order  # tests/, on the path through gpu_e2e

    heads, kv_heads, head_dim, block_size = 32, 8, 64, 16
    cache = torch.randn(2, 1024, block_size, kv_heads, head_dim, generator=g).to(device, torch.bfloat16)
    query = torch.randn(256, heads, head_dim, generator=g).to(device, torch.bfloat16)
    cases = {"alone": ([1], [300]), "decodes of 300..5000": ([1] * 4, [300, 5000, 2000, 700]),
             "beside a 200-token prefill": ([1, 200], [300, 200])}
    outs = {}
    for name, (query_lens, seq_lens) in cases.items():
        meta = metadata_in_order(query_lens, seq_lens, block_size, device)  # the 300-token row keeps its blocks
        TritonAttentionBackend().prepare(meta, block_size)
        q = query[: sum(query_lens)]
        outs[name] = paged_attention(q, cache, meta, head_dim**-0.5, torch.empty_like(q))[:1]
    for name in list(cases)[1:]:
        print(f"probe: Triton attention, a 300-token decode row alone == {name}: "
              f"{torch.equal(outs['alone'], outs[name])}")


def greedy_ids(model_dir: Path, device, vocab: int, num: int, prompt_len: int, out_len: int, **options):
    from pagedserve import SamplingParams

    llm = _llm(model_dir, device, False, dtype="bfloat16", load_format="dummy", max_num_seqs=num,
               kv_cache_memory=1 << 30 if device.type == "cuda" else 1 << 24, **options)
    outs = llm.generate(_prompts(num, prompt_len, vocab), SamplingParams(max_tokens=out_len, temperature=0.0,
                                                                         ignore_eos=True))
    del llm
    _free(device)
    return [o.outputs[0].token_ids for o in outs]


def quantization(model_dir: Path, device, vocab: int, smoke: bool, only: list[str] | None = None) -> dict:
    batches, prompt_len, out_len = ([1, 2], 8, 4) if smoke else ([1, 64], 128, 128)
    kv_bytes = 1 << 24 if smoke else 8 << 30
    variants = {"bf16": {}, "int8": {"quantization": "int8"}, "fp8 KV": {"kv_cache_dtype": "fp8_e4m3"},
                "int4": {"quantization": "int4"}, "int4 g128": {"quantization": "int4_g128"}}
    unknown = sorted(set(only or []) - set(variants))
    if unknown:  # a misspelt name would leave a variant out of the figures unnoticed
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; choices: {', '.join(variants)}")
    variants = {k: v for k, v in variants.items() if k == "bf16" or not only or k in only}
    figures: dict = {}
    reference = greedy_ids(model_dir, device, vocab, 8, prompt_len, 32 if not smoke else 4)
    for name, options in variants.items():
        figs = run_pagedserve(model_dir, device, batches, prompt_len, out_len, vocab, kv_bytes, warm_up=not smoke,
                              **options)
        ids = reference if name == "bf16" else greedy_ids(model_dir, device, vocab, 8, prompt_len,
                                                          32 if not smoke else 4, **options)
        equal = sum(a == b for x, y in zip(ids, reference) for a, b in zip(x, y))
        total = sum(len(x) for x in reference)
        figs["greedy_equal_share"] = equal / total
        figures[name] = figs
        b1, bn = figs["batches"][batches[0]], figs["batches"][batches[-1]]
        print(f"{name:8} batch-{batches[0]} step {b1['decode_step_ms']:.3f} ms, batch-{batches[-1]} "
              f"{bn['output_tok_s']:.0f} tok/s; greedy tokens equal to bf16: {equal}/{total}")
    base = figures["bf16"]["batches"]
    for name in list(figures)[1:]:
        mine = figures[name]["batches"]
        print(f"{name:8} vs bf16: batch-{batches[0]} step {base[batches[0]]['decode_step_ms'] / mine[batches[0]]['decode_step_ms']:.2f}x "
              f"faster, batch-{batches[-1]} tok/s {mine[batches[-1]]['output_tok_s'] / base[batches[-1]]['output_tok_s']:.2f}x")
    return figures


def calibration(workdir: Path, device, smoke: bool) -> tuple[bool, dict]:
    """int4 calibration on the GPU.
    1. The quantization math on CUDA tensors against the same on the CPU, from the same
       inputs: imatrix's weighted scale search (`quantize` with an importance vector) of a
       4096 x 4096 weight, and GPTQ (`gptq_quantize`) of a 1024 x 1024 one from one Hessian.
       The share of equal codes and each device's seconds. Checked: >= 99% equal (a float
       rounding in the search may move a tie to its neighbour).
    2. An LLM on the GPU with `quantization="int4", quantization_calibration="imatrix"`: the
       calibration passes run on CUDA tensors. Calibration needs a checkpoint's own weights,
       so a random tiny-Llama checkpoint (tests/tiny_models.py) stands in for the dummy
       model; checked that it loads and generates, with its load seconds."""
    from pagedserve import SamplingParams
    from pagedserve.plugins.int4_gptq import gptq_quantize
    from pagedserve.plugins.int4_quantization import quantize, unpack_codes

    from tiny_models import VOCAB_SIZE, build_checkpoint

    g = torch.Generator().manual_seed(3)
    n = 256 if smoke else 4096
    weight, importance = torch.randn(n, n, generator=g) * 0.02, torch.rand(n, generator=g) * 4 + 0.1
    m = 128 if smoke else 1024
    x = torch.randn(4 * m, m, generator=g) * (torch.rand(m, generator=g) * 2)  # inputs of unequal scales
    small, hessian = torch.randn(m, m, generator=g) * 0.02, x.t() @ x
    codes, seconds = {}, {}
    for where in (torch.device("cpu"), device):
        start = time.perf_counter()
        w = quantize(weight.to(where), 32, True, importance=importance.to(where))
        _sync(where)
        seconds[f"imatrix search {where.type}"] = time.perf_counter() - start
        start = time.perf_counter()
        gptq_codes, _, _ = gptq_quantize(small.to(where), hessian.to(where), 32, True)
        _sync(where)
        seconds[f"gptq {where.type}"] = time.perf_counter() - start
        codes[where.type] = (unpack_codes(w.qweight.cpu()), gptq_codes.cpu())
    cpu, gpu = codes["cpu"], codes[device.type]
    figures: dict = {"imatrix_codes_equal": (cpu[0] == gpu[0]).float().mean().item(),
                     "gptq_codes_equal": (cpu[1] == gpu[1]).float().mean().item(), "seconds": seconds}

    model_dir = build_checkpoint("llama", workdir / "calibration-llama")
    start = time.perf_counter()
    llm = _llm(model_dir, device, False, dtype="float32", max_num_seqs=4, kv_cache_memory=1 << 24,
               quantization="int4", quantization_calibration="imatrix", quantization_calibration_tokens=1024)
    figures["llm_load_seconds"] = time.perf_counter() - start
    outs = llm.generate(_prompts(4, 16, VOCAB_SIZE), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    figures["llm_generated"] = all(len(o.outputs[0].token_ids) == 8 for o in outs)
    del llm
    _free(device)
    print("calibration: codes equal on {dev} and CPU: imatrix search {imatrix_codes_equal:.4%}, GPTQ "
          "{gptq_codes_equal:.4%}; an LLM calibrated on {dev} loaded in {llm_load_seconds:.1f} s and generated: "
          "{llm_generated}; seconds ".format(dev=device.type, **figures)
          + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
    ok = figures["imatrix_codes_equal"] >= 0.99 and figures["gptq_codes_equal"] >= 0.99 and figures["llm_generated"]
    return ok, figures


def ngram(model_dir: Path, device, vocab: int, smoke: bool) -> tuple[bool, dict]:
    from pagedserve import SamplingParams

    passage_len, out_len, num = (12, 6, 2) if smoke else (192, 128, 4)
    passages = _prompts(num, passage_len, vocab)
    prompts = [p + [13] + p[: passage_len // 2] for p in passages]  # the passage, then its first half again
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    results, figures = {}, {}
    for method in (None, "ngram"):
        spec = {"method": method, "num_speculative_tokens": 4} if method else None
        llm = _llm(model_dir, device, False, dtype="bfloat16", load_format="dummy", max_num_seqs=4,
                   kv_cache_memory=1 << 30 if device.type == "cuda" else 1 << 24, speculative=spec)
        llm.generate(prompts[:1], params)  # compiles, captures graphs
        ids, start = [], time.perf_counter()
        for p in prompts:  # batch 1: one request at a time
            ids.append(llm.generate([p], params)[0].outputs[0].token_ids)
        _sync(device)
        elapsed = time.perf_counter() - start
        results[method] = ids
        figures[method or "none"] = {"seconds": elapsed, "output_tok_s": num * out_len / elapsed}
        if llm.engine.speculator is not None:
            c = llm.engine.speculator.counters
            figures["ngram"].update(acceptance_rate=c.acceptance_rate, mean_accepted_length=c.mean_accepted_length)
        del llm
        _free(device)
    same = results[None] == results["ngram"]
    spec_figs = figures["ngram"]
    print(f"ngram at batch 1, {num} requests of {out_len} tokens: {figures['none']['output_tok_s']:.1f} -> "
          f"{spec_figs['output_tok_s']:.1f} tok/s ({spec_figs['output_tok_s'] / figures['none']['output_tok_s']:.2f}x), "
          f"acceptance {spec_figs.get('acceptance_rate', 0):.1%}, mean accepted {spec_figs.get('mean_accepted_length', 0):.2f}; "
          f"greedy ids identical: {same}")
    return same, figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, to check the script itself")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--only", choices=["invariance", "quantization", "calibration", "ngram"], action="append")
    parser.add_argument("--variants", help="the quantization variants beside bf16, comma-separated "
                        "(int8, fp8 KV, int4, int4 g128); default all")
    args = parser.parse_args()
    picked = pick_device(args.smoke)
    if picked is None:
        return 2
    device, name = picked
    print(f"device: {name}; torch {torch.__version__}")
    shape = TINY if args.smoke else LLAMA32_1B
    parts = args.only or ["invariance", "quantization", "calibration", "ngram"]
    ok, figures = True, {"device": name}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(shape, Path(tmp))
        if "invariance" in parts:
            invariance_probes(device)
            ok &= batch_invariance(model_dir, device, shape["vocab_size"], 40, 8 if args.smoke else 48)
        if "quantization" in parts:
            figures["quantization"] = quantization(model_dir, device, shape["vocab_size"], args.smoke,
                                                   args.variants.split(",") if args.variants else None)
        if "calibration" in parts:
            same, figures["calibration"] = calibration(Path(tmp), device, args.smoke)
            ok &= same
        if "ngram" in parts:
            same, figures["ngram"] = ngram(model_dir, device, shape["vocab_size"], args.smoke)
            ok &= same
    if args.json:
        Path(args.json).write_text(json.dumps(figures, default=str))
    print("all checks passed" if ok else "CHECK FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
