"""The `serve` workload (bench/workloads.py) through HTTP beside the same requests
in-process through `LLM.generate`, in one run, on the same model, dtype and threads.

    .venv/bin/python benchmarks/serve_vs_inprocess.py [--num-requests 200] [--max-concurrency 64]

Both sides run at most `--max-concurrency` requests at once (the server's --max-num-seqs and
the engine's max_num_seqs), so the ratio shows what the gateway, the queue and streaming
cost, not a different batch size. The server is `pagedserve serve` started as a user starts
it, as a process with its own embedded Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

API_KEY = "sk-bench"


@contextmanager
def pagedserve_serve(model: str, *flags: str, timeout: float = 600.0):
    """`pagedserve serve` (its own Redis, as no --redis-url is given) on a free port; yields
    its base URL once /ready answers, and stops it with SIGTERM on leaving."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PAGEDSERVE_API_KEYS=f"{API_KEY}:bench")
    process = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", model,
                                "--port", str(port), "--log-level", "warning", *flags], env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pagedserve serve was not ready within {timeout:g} s")
            try:
                if httpx.get(base_url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield base_url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def in_process(model: str, dtype: str, threads: int, max_seqs: int, prompts, output_lens) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=max_seqs)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    duration = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert output_tokens == sum(output_lens)
    total = output_tokens + sum(len(p) for p in prompts)
    return {"duration_s": duration, "output_throughput": output_tokens / duration, "total_throughput": total / duration}


def over_http(model: str, dtype: str, threads: int, max_seqs: int, prompts, output_lens, concurrency: int) -> dict:
    from pagedserve.bench.request_stats import summarize
    from pagedserve.bench.serve import run_benchmark

    # the in-process engine keeps the checkpoint's weights: so does the server (its CPU default is int8)
    flags = ("--num-workers", "1", "--dtype", dtype, "--num-threads", str(threads), "--max-num-seqs", str(max_seqs),
             "--quantization", "none")
    with pagedserve_serve(model, *flags) as base_url:
        asyncio.run(run_benchmark(base_url, [prompts[0][:16]], [2], api_key=API_KEY, progress=False))  # warm up
        records, duration = asyncio.run(run_benchmark(base_url, prompts, output_lens, math.inf, concurrency,
                                                      api_key=API_KEY, progress=False))
    return summarize(records, duration)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-concurrency", type=int, default=64)
    args = parser.parse_args()

    from pagedserve.bench.workloads import serve_workload
    from pagedserve.common.model_store import resolve_model

    model_dir = resolve_model(args.model)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts, output_lens = serve_workload(args.num_requests, vocab)
    local = in_process(str(model_dir), args.dtype, args.threads, args.max_concurrency, prompts, output_lens)
    http = over_http(str(model_dir), args.dtype, args.threads, args.max_concurrency, prompts, output_lens, args.max_concurrency)
    print(f"workload=serve requests={args.num_requests} rate=inf max_concurrency={args.max_concurrency} "
          f"model={args.model} dtype={args.dtype} threads={args.threads}")
    print(f"{'':24}{'duration s':>12}{'output tok/s':>14}{'total tok/s':>13}")
    print(f"{'LLM.generate':24}{local['duration_s']:12.1f}{local['output_throughput']:14.1f}{local['total_throughput']:13.1f}")
    print(f"{'HTTP (pagedserve serve)':24}{http['duration_s']:12.1f}{http['output_throughput']:14.1f}{http['total_throughput']:13.1f}")
    print(f"throughput ratio HTTP / in-process: {http['output_throughput'] / local['output_throughput']:.3f}")
    print(f"completed {http['completed']}, failed {http['failed']}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = http[name]
        print(f"{name.upper():5} mean {s['mean_ms']:9.1f} ms  median {s['median_ms']:9.1f} ms  p99 {s['p99_ms']:9.1f} ms")
    return 0 if http["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
