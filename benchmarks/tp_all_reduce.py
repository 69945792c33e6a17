"""Tensor parallelism on the CPU: the shared-memory all-reduce against gloo's, alone and in a
decode step.

    python benchmarks/tp_all_reduce.py [--rounds 3] [--batches 1,64] [--skip-model]

1. **The collective alone.** Two rank processes on this host (this script starts the second)
   all-reduce float32 tensors of a few shapes, the two ways in alternation; each figure is the
   median over rounds of the mean of `--calls` calls.
2. **In a decode step.** A SmolLM2-shaped Llama with random weights (576 wide, 30 layers, 8
   heads of 72 and 2 KV heads, so that 2 ranks divide it; SmolLM2 itself has 9 heads) is
   profiled as `pagedserve bench offline --profile` does, at each batch size: one rank with
   the machine's threads, then two ranks (one thread each) with shared memory and with gloo,
   in alternation. The all-reduce column is rank 0's time inside the collective, waiting for
   the slower rank included.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

SHAPES = [(1, 576), (64, 576), (1, 4096), (512, 576)]


def collective_child(rank: int, port: int, region: int, rounds: int, calls: int) -> list[str]:
    from pagedserve.engine.parallel_group import TorchParallelGroup
    from pagedserve.engine.shm_all_reduce import SharedMemoryAllReduce

    torch.set_num_threads(1)
    shm = SharedMemoryAllReduce(region, rank, 2, timeout=30)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = TorchParallelGroup(store, rank, 2, torch.device("cpu"), 30, 60, shm)
    return _time_collectives(group, rounds, calls)


def _time_collectives(group, rounds: int, calls: int) -> list[str]:
    lines = []
    for shape in SHAPES:
        tensor = torch.randn(shape)
        times: dict[str, list[float]] = {"shm": [], "gloo": []}
        for _ in range(rounds):
            for way in ("shm", "gloo"):
                started = time.perf_counter()
                for _ in range(calls):
                    if way == "shm":
                        group.shm.all_reduce(tensor)
                    else:
                        group._all_reduce(group.data, tensor, dist.ReduceOp.SUM)
                times[way].append((time.perf_counter() - started) / calls)
                tensor.div_(2)  # keep the values finite
        shm_us, gloo_us = (statistics.median(times[w]) * 1e6 for w in ("shm", "gloo"))
        lines.append(f"{str(list(shape)):>12} {shm_us:10.1f} µs {gloo_us:10.1f} µs {gloo_us / shm_us:7.1f}×")
    return lines


def bench_collectives(rounds: int, calls: int) -> None:
    from pagedserve.engine.parallel_group import TorchParallelGroup
    from pagedserve.engine.shm_all_reduce import SharedMemoryAllReduce, create_region

    region = create_region(2)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    child = subprocess.Popen([sys.executable, __file__, "--child", str(store.port), str(region),
                              str(rounds), str(calls)], env={**os.environ, "OMP_NUM_THREADS": "1"}, pass_fds=(region,))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        shm = SharedMemoryAllReduce(region, 0, 2, timeout=30)
        group = TorchParallelGroup(store, 0, 2, torch.device("cpu"), 30, 60, shm)
        lines = _time_collectives(group, rounds, calls)
    finally:
        child.wait(60)
        os.close(region)
        torch.set_num_threads(threads)
    print(f"all-reduce, 2 ranks, float32, mean of {calls} calls, median of {rounds} rounds:")
    print(f"{'shape':>12} {'shared mem':>13} {'gloo':>13} {'gloo/shm':>8}")
    print("\n".join(lines))


def build_model(out: Path) -> Path:
    """The SmolLM2-shaped, 8-head Llama with random weights, with the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.common.engine_config import DEFAULT_MODEL
    from pagedserve.common.model_store import resolve_model

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=72, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def bench_steps(model: Path, batches: list[int], rounds: int, prompt: int, steps: int) -> None:
    from pagedserve import LLM
    from pagedserve.bench.step_profile import profile_decode

    threads = torch.get_num_threads()
    setups = [("1 rank", dict(num_threads=threads)),
              ("2 ranks, shm", dict(tensor_parallel_size=2, tensor_parallel_all_reduce="shm", num_threads=1)),
              ("2 ranks, gloo", dict(tensor_parallel_size=2, tensor_parallel_all_reduce="gloo", num_threads=1))]
    results: dict[tuple[str, int], list] = {}
    for _ in range(rounds):
        for name, options in setups:
            llm = LLM(str(model), max_num_seqs=max(batches), enable_prefix_caching=False, **options)
            profile_decode(llm.engine, 1, prompt, 4, seed=99)  # warm-up
            for batch in batches:
                results.setdefault((name, batch), []).append(profile_decode(llm.engine, batch, prompt, steps))
            llm.close()
    print(f"\ndecode step, {model.name}: prompt {prompt} tokens, {steps} steps per batch, median of {rounds} rounds "
          f"(torch threads: {threads} for one rank, 1 per rank for two)")
    print(f"{'setup':>14} {'batch':>5} {'step ms':>9} {'all-reduce ms':>14} {'broadcast ms':>13} {'tok/s':>8}")
    for (name, batch), profiles in results.items():
        pick = sorted(profiles, key=lambda p: p.step)[len(profiles) // 2]
        print(f"{name:>14} {batch:5d} {pick.step * 1e3:9.2f} {pick.all_reduce * 1e3:14.2f} "
              f"{pick.broadcast * 1e3:13.2f} {batch / pick.step:8.1f}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        port, region, rounds, calls = sys.argv[2:6]
        collective_child(1, int(port), int(region), int(rounds), int(calls))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200, help="all-reduces per timed round")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip-model", action="store_true", help="the collective alone")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    bench_collectives(args.rounds, args.calls)
    if not args.skip_model:
        with tempfile.TemporaryDirectory() as folder:
            model = build_model(Path(folder) / "smollm2-shaped-8-heads")
            bench_steps(model, [int(b) for b in args.batches.split(",")], args.rounds, args.prompt, args.steps)
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
