"""llama.cpp's `llama-batched-bench` as a peer of `pagedserve bench offline --workload fixed`
(`--llama-cpp DIR --gguf MODEL.gguf`).

`fixed` is 64 prompts of 128 tokens, 64 output tokens each, all at once: the shapes of
`llama-batched-bench -npp 128 -ntg 64 -npl 64`, which processes the 64 prompts (in batches
of `-b` tokens) and then decodes 64 steps of 64 sequences. Its `S t/s` is all those tokens
over its whole time, the same count as the bench's total tok/s. Its prompts are random ids,
not the workload's: at float32 a token's id does not change the time it costs.

The context must hold every sequence at its end (`-c` at least 64 × 192), or the tool skips
the shape silently; `-b 2048` matches pagedserve's default token budget per step on CPU.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import msgspec

#: llama-batched-bench's prompt batch, as pagedserve's default `max_num_batched_tokens` on CPU
BATCH_TOKENS = 2048


class BatchedBenchRow(msgspec.Struct, frozen=True):
    """One `--output-format jsonl` line of llama-batched-bench (the fields the bench uses)."""

    pp: int  # prompt tokens per sequence
    tg: int  # generated tokens per sequence
    pl: int  # sequences in parallel
    n_threads: int  # threads it ran on
    t_pp: float  # seconds processing the prompts
    t_tg: float  # seconds generating
    t: float  # t_pp + t_tg
    speed_pp: float  # prompt tok/s
    speed_tg: float  # generated tok/s
    speed: float  # every token over t: the bench's total tok/s


def uniform_shape(prompts: list[list[int]], out_lens: list[int]) -> tuple[int, int, int]:
    """(prompt length, output length, sequences) of a workload whose requests are all alike;
    llama-batched-bench runs no other kind."""
    if len({len(p) for p in prompts}) != 1 or len(set(out_lens)) != 1:
        raise SystemExit("--llama-cpp runs llama-batched-bench, which runs only equal prompts and outputs "
                         "(the `fixed` workload)")
    return len(prompts[0]), out_lens[0], len(prompts)


def batched_bench_command(binary_dir: str, gguf: str, threads: int, prompt: int, output: int,
                          sequences: int) -> list[str]:
    """The llama-batched-bench command line for one shape."""
    binary = Path(binary_dir) / "llama-batched-bench"
    return [str(binary), "-m", gguf, "-c", str(sequences * (prompt + output)), "-b", str(BATCH_TOKENS),
            "-npp", str(prompt), "-ntg", str(output), "-npl", str(sequences), "-t", str(threads),
            "--output-format", "jsonl"]


def parse_batched_bench(stdout: str) -> BatchedBenchRow:
    """The one result line of a single-shape run."""
    rows = [line for line in stdout.splitlines() if line.startswith("{") and '"speed"' in line]
    if len(rows) != 1:
        raise SystemExit(f"llama-batched-bench printed {len(rows)} result lines, not 1:\n{stdout[-2000:]}")
    return msgspec.convert(json.loads(rows[0]), BatchedBenchRow)


def run_llama_batched(args, prompts: list[list[int]], out_lens: list[int]) -> tuple[float, dict[str, Any]]:
    """`bench offline`'s system runner for llama-batched-bench: (seconds, extra figures)."""
    if not args.gguf:
        raise SystemExit("--llama-cpp needs --gguf (the same model as a GGUF file, e.g. f32)")
    prompt, output, sequences = uniform_shape(prompts, out_lens)
    command = batched_bench_command(args.llama_cpp, args.gguf, args.threads, prompt, output, sequences)
    if not Path(command[0]).exists():
        raise SystemExit(f"no llama-batched-bench in {args.llama_cpp}")
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed ({completed.returncode}):\n{completed.stderr[-2000:]}")
    row = parse_batched_bench(completed.stdout)
    if (row.pp, row.tg, row.pl) != (prompt, output, sequences):
        raise SystemExit(f"llama-batched-bench ran {row.pl} x ({row.pp} + {row.tg}), not the workload's shape")
    return row.t, {"peer_version": f"llama.cpp {Path(args.gguf).stem}", "prompt_tok_s": row.speed_pp,
                   "decode_tok_s": row.speed_tg}
