"""End-to-end figures of the engine on a GPU, and the checks behind them, in one call.

    python benchmarks/gpu_e2e.py            # on an NVIDIA GPU (issue #4's end-to-end figures)
    python benchmarks/gpu_e2e.py --smoke    # a tiny model; runs anywhere (TRITON_INTERPRET=1 on CPU)

1. Check: greedy token ids of a tiny random Llama through the engine (Triton backend,
   decode steps from CUDA graphs on a GPU) equal the same engine with --enforce-eager and
   transformers' `generate`. On CPU the graph path runs eagerly (there are no CUDA graphs).
2. Figures: a random-weight Llama-3-8B-shaped model in bf16 (`load_format="dummy"`; the
   smoke run uses a tiny shape), `batch` requests of 128 prompt + 128 output tokens
   (greedy, EOS ignored):
   - output tok/s of pagedserve beside transformers `generate_batch` on the same device,
     at batch 1 and 64;
   - pagedserve's median decode step, and at batch 1 that step against the time to read
     the weights once at the measured copy bandwidth (memory-bandwidth utilisation).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: a small tokenizer and checkpoints

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=512,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _llm(model_dir: Path, device: torch.device, eager: bool, **options):
    """An LLM on the Triton backend; on CPU with the graph path enabled by hand (run eagerly)."""
    from pagedserve import LLM

    llm = LLM(str(model_dir), device=device.type, attention_backend="triton", enforce_eager=eager, **options)
    if device.type == "cpu" and not eager:
        llm.engine.runner.enable_decode_graphs(min(256, llm.engine.config.max_num_seqs), llm.engine.max_model_len,
                                               cuda_graphs=False)
    return llm


def check_graphs(device: torch.device, workdir: Path, num_prompts: int) -> bool:
    from pagedserve import SamplingParams

    from engine_helpers import hf_greedy, mixed_prompts
    from tiny_models import build_checkpoint

    model_dir = build_checkpoint("llama", workdir / "tiny-llama")
    prompts = mixed_prompts(2 * num_prompts, seed=5)[:num_prompts]  # no shared prefix: one prefill step
    lengths = [3 + 2 * i for i in range(len(prompts))]  # the decode batch shrinks through the buckets
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    expected = [ids[:n] for ids, n in zip(hf_greedy(model_dir, prompts, max(lengths)), lengths)]
    results = {}
    for eager in (False, True):
        llm = _llm(model_dir, device, eager, dtype="float32", max_num_seqs=16, kv_cache_memory=1 << 24)
        results[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.decode_graphs
        if not eager:
            replays = {b: n for b, n in graphs.replays.items() if n} if graphs else {}
            kind = "CUDA graphs" if graphs is not None and graphs.cuda_graphs else "graph path run eagerly"
        del llm
        _free(device)
    ok = results[False] == expected and results[True] == expected and sum(replays.values()) > 0
    print(f"check: tiny Llama, {len(prompts)} requests, greedy ids == transformers: graphs {results[False] == expected}, "
          f"eager {results[True] == expected}; {kind}, replays per bucket {replays}")
    return ok


def _model_dir(shape: dict, workdir: Path) -> Path:
    from transformers import LlamaConfig

    from tiny_models import build_tokenizer

    out = workdir / "llama-shaped"
    config = LlamaConfig(**shape, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    build_tokenizer(out)
    return out


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, vocab - 100, (batch, prompt_len), generator=g).tolist()


def run_pagedserve(model_dir: Path, device: torch.device, batches, prompt_len, out_len, vocab, kv_bytes,
                   warm_up: bool = True, latency: tuple[int, int] | None = None, profile_batch: int = 0,
                   **options) -> dict:
    """`latency`: (batch, prompt length) of a whole-request latency run; `profile_batch`: the
    batch whose steps torch.profiler splits into GPU time and the rest; `options`: more LLM
    options (quantization, kv_cache_dtype, ...)."""
    from pagedserve import SamplingParams

    # no prefix caching: the warm-ups send the timed prompts, which would otherwise come back
    # mostly cached, while transformers computes every prompt
    llm = _llm(model_dir, device, False, dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
               kv_cache_memory=kv_bytes, enable_prefix_caching=False, **options)
    runner = llm.engine.runner
    model = llm.engine.runner.model  # parameters and buffers (int8 / int4 weights), not the rotary tables
    weight_bytes = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                       if (not n.startswith("embed_tokens") or model.lm_head is None)
                       and n.rsplit(".", 1)[-1] not in ("cos", "sin"))
    steps: list[float] = []
    original = runner.run

    def timed_run(output):
        _sync(device)
        start = time.perf_counter()
        result = original(output)  # ends with the sampled ids on the host: the step is done
        if all(e.num_new_tokens == 1 for e in output.scheduled):
            steps.append(time.perf_counter() - start)
        return result

    runner.run = timed_run
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    if warm_up:
        llm.generate(_prompts(2, prompt_len, vocab), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    figures: dict = {}
    for batch in batches:
        if warm_up:  # compiles, captures this size's graph
            llm.generate(_prompts(batch, prompt_len, vocab), SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True))
        steps.clear()
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(_prompts(batch, prompt_len, vocab), params)
        _sync(device)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == batch * out_len
        figures[batch] = {"seconds": elapsed, "output_tok_s": batch * out_len / elapsed,
                          "decode_step_ms": 1e3 * statistics.median(steps)}
    try:  # (the figures above stand whatever happens here)
        if latency is not None:  # whole-request latency of a batch with its own prompt length
            batch, length = latency
            llm.generate(_prompts(batch, length, vocab), SamplingParams(max_tokens=8, temperature=0.0,
                                                                        ignore_eos=True))
            _sync(device)
            start = time.perf_counter()
            llm.generate(_prompts(batch, length, vocab), params)
            _sync(device)
            figures["latency"] = {"batch": batch, "prompt_len": length, "out_len": out_len,
                                  "seconds": time.perf_counter() - start}
        if device.type == "cuda" and profile_batch:
            figures["gpu_idle_share"] = gpu_idle_share(llm, _prompts(profile_batch, prompt_len, vocab),
                                                       SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    except Exception as e:
        print(f"latency / profile run failed: {type(e).__name__}: {e}")
    del runner.run
    del llm
    _free(device)
    return {"weight_bytes": weight_bytes, "batches": figures}


def gpu_idle_share(llm, prompts, params) -> dict:
    """One generate under torch.profiler: the share of its wall time in which no GPU kernel
    ran (host work between launches, syncs, sampling on the host), prefill included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    # the kernels themselves: a CPU op's row also carries the time of the kernels it launched
    kernel_s = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    return {"wall_s": wall, "kernel_s": kernel_s, "idle_share": max(0.0, 1 - kernel_s / wall)}


def run_transformers(shape: dict, device: torch.device, batches, prompt_len, out_len, vocab,
                     warm_up: bool = True, small_cache: bool = False) -> dict:
    """`small_cache`: a paged cache of 64 blocks and 64-token batches, not one sized from free
    memory (on a CPU that sizing alone takes tens of seconds a call)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = LlamaConfig(**shape, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: an 8B model in float32 first would need 32 GB more
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=64) if small_cache else None
    figures = {}
    if warm_up:  # once, small: its first call sets up what later calls reuse
        model.generate_batch(inputs=_prompts(4, prompt_len, vocab), continuous_batching_config=cb_config,
                             generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None,
                                                                pad_token_id=0), progress_bar=False)
    for batch in batches:
        prompts = _prompts(batch, prompt_len, vocab)
        _sync(device)
        start = time.perf_counter()
        # (not under inference_mode: the manager's thread updates its own tensors in place)
        results = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb_config,
                                       progress_bar=False)
        _sync(device)
        elapsed = time.perf_counter() - start
        produced = sum(len(r.generated_tokens) for r in results.values())
        assert produced == batch * out_len, (produced, batch * out_len)
        figures[batch] = {"seconds": elapsed, "output_tok_s": batch * out_len / elapsed}
    del model
    _free(device)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, to check the script itself")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    from gpu_kernels import copy_bandwidth, pick_device

    picked = pick_device(args.smoke)
    if picked is None:
        return 2
    device, name = picked

    if args.smoke:
        shape, batches, prompt_len, out_len, kv_bytes, copy_bytes = TINY, [1, 2], 8, 4, 1 << 24, 1 << 20
    else:
        shape, batches, prompt_len, out_len, kv_bytes, copy_bytes = LLAMA3_8B, [1, 64, 256], 128, 128, 16 << 30, 1 << 30
    copy_bw = copy_bandwidth(device, copy_bytes, 3 if args.smoke else 20)
    print(f"device: {name}; torch {torch.__version__}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        # smoke: 3 requests still fill the 4-row bucket with a padding row, then the 2 and 1 rows
        ok = check_graphs(device, Path(tmp), 3 if args.smoke else 12)
        print(f"  ({time.perf_counter() - t:.0f} s)")
        model_dir = _model_dir(shape, Path(tmp))
        # (a smoke run's figures mean nothing: it skips the warm-ups that compile and capture graphs)
        ours = run_pagedserve(model_dir, device, batches, prompt_len, out_len, shape["vocab_size"], kv_bytes,
                              warm_up=not args.smoke, latency=(8, 32) if not args.smoke else (2, 4),
                              profile_batch=batches[-1])
    if args.json:  # ours now, in case the peer's run does not finish
        Path(args.json).write_text(json.dumps({"device": name, "copy_bandwidth": copy_bw, "pagedserve": ours}))
    try:
        theirs = run_transformers(shape, device, batches, prompt_len, out_len, shape["vocab_size"],
                                  warm_up=not args.smoke, small_cache=args.smoke)
    except Exception as e:  # the peer's API moves between transformers versions: keep our own figures
        print(f"transformers generate_batch failed: {type(e).__name__}: {e}")
        theirs = {b: {"output_tok_s": float("nan")} for b in batches}
        _free(device)
    label = "Llama-3-8B-shaped" if not args.smoke else "tiny Llama-shaped"
    print(f"{label}, bf16, random weights ({ours['weight_bytes'] / 1e9:.2f} GB read per step); "
          f"{prompt_len} prompt + {out_len} output tokens per request")
    print(f"{'batch':>6}{'pagedserve tok/s':>18}{'generate_batch tok/s':>22}{'ratio':>8}{'decode step ms':>16}")
    for batch in batches:
        mine, peer = ours["batches"][batch], theirs[batch]
        print(f"{batch:6d}{mine['output_tok_s']:18.1f}{peer['output_tok_s']:22.1f}"
              f"{mine['output_tok_s'] / peer['output_tok_s']:8.2f}{mine['decode_step_ms']:16.3f}")
    floor_ms = 1e3 * ours["weight_bytes"] / copy_bw
    step_ms = ours["batches"][batches[0]]["decode_step_ms"]
    print(f"batch 1: weights / copy bandwidth = {floor_ms:.3f} ms; decode step {step_ms:.3f} ms; "
          f"memory-bandwidth utilisation {100 * floor_ms / step_ms:.0f}%")
    lat = ours["batches"].get("latency", {"batch": 0, "prompt_len": 0, "out_len": 0, "seconds": float("nan")})
    print(f"batch {lat['batch']}, {lat['prompt_len']} prompt + {lat['out_len']} output tokens: whole-request latency "
          f"{1e3 * lat['seconds']:.0f} ms")
    if "gpu_idle_share" in ours["batches"]:
        idle = ours["batches"]["gpu_idle_share"]
        print(f"batch {batches[-1]}, 32 output tokens under torch.profiler: wall {idle['wall_s'] * 1e3:.0f} ms, "
              f"GPU kernels {idle['kernel_s'] * 1e3:.0f} ms: no kernel running {100 * idle['idle_share']:.0f}% of the time")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "copy_bandwidth": copy_bw, "pagedserve": ours,
                                               "generate_batch": theirs}))
    print("all checks passed" if ok else "CHECK FAILED: greedy ids differ (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
