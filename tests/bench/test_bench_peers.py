"""The out-of-process peers of `pagedserve bench offline`: vLLM's CPU engine through
bench/vllm_driver.py, and llama.cpp's llama-batched-bench. Neither is installed here, so
each is replaced by a fake with the same interface: a `vllm` package that records what the
driver asks of it, run by a "peer interpreter" (this Python with the fake on its path), and
a `llama-batched-bench` script that prints one result line."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from pagedserve.bench.llama_batched import (
    BatchedBenchRow,
    batched_bench_command,
    parse_batched_bench,
    uniform_shape,
)
from pagedserve.bench.vllm_peer import make_job, peer_environment, run_driver
from pagedserve.bench.workloads import fixed_workload
from pagedserve.entrypoints.cli import main

#: a stand-in for vLLM's offline API: LLM(...).generate(token-id prompts, SamplingParams list);
#: every call is appended to $FAKE_VLLM_LOG; each request yields max_tokens tokens, or
#: $FAKE_VLLM_SHORT fewer
FAKE_VLLM = '''
import json, os

__version__ = "0.0.fake"


def _log(entry):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        self.max_tokens, self.temperature, self.ignore_eos = max_tokens, temperature, ignore_eos


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _RequestOutput:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, model, dtype, seed, **options):
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        _log({"call": "LLM", "model": model, "dtype": dtype, "seed": seed, "options": options, "env": env})

    def generate(self, prompts, params, use_tqdm=True):
        _log({"call": "generate", "prompts": [p["prompt_token_ids"] for p in prompts],
              "max_tokens": [p.max_tokens for p in params], "temperature": [p.temperature for p in params],
              "ignore_eos": [p.ignore_eos for p in params], "use_tqdm": use_tqdm})
        short = int(os.environ.get("FAKE_VLLM_SHORT", "0"))
        return [_RequestOutput(list(range(max(p.max_tokens - short, 0)))) for p in params]
'''


@pytest.fixture
def fake_vllm_python(tmp_path, monkeypatch) -> tuple[str, Path]:
    """(a peer interpreter whose `vllm` is the fake, the fake's call log)."""
    package = tmp_path / "fake_site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "peer-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{package.parent}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    return str(python), log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_driver_passes_the_job_through_and_reports_each_request(fake_vllm_python):
    python, log = fake_vllm_python
    job = make_job("/models/x", "float32", [[5, 6, 7], [8]], [3, 2])
    result = run_driver(python, job, threads=2)
    assert result.vllm_version == "0.0.fake"
    assert result.output_tokens == [3, 2]
    assert result.prompt_tokens == 4
    assert result.seconds > 0 and result.warmup_seconds > 0
    engine, warmup, timed = calls(log)
    assert engine == {"call": "LLM", "model": "/models/x", "dtype": "float32", "seed": 0, "options": {},
                      "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                              "VLLM_CPU_KVCACHE_SPACE": "4"}}
    assert warmup["prompts"] == [[1] * 16, [2] * 16, [3] * 16, [4] * 16] and warmup["max_tokens"] == [4] * 4
    assert timed == {"call": "generate", "prompts": [[5, 6, 7], [8]], "max_tokens": [3, 2], "temperature": [0.0, 0.0],
                     "ignore_eos": [True, True], "use_tqdm": False}


def test_peer_environment_keeps_the_callers_settings():
    env = peer_environment(4, {"VLLM_CPU_KVCACHE_SPACE": "16", "PATH": "/bin"})
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "16", "PATH": "/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_CPU_OMP_THREADS_BIND": "0-3"}


def test_a_failing_peer_interpreter_is_reported(tmp_path):
    python = tmp_path / "broken-python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(SystemExit, match="exit status 3"):
        run_driver(str(python), make_job("/m", "float32", [[1]], [1]), threads=1)
    with pytest.raises(SystemExit, match="no such interpreter"):
        run_driver(str(tmp_path / "missing"), make_job("/m", "float32", [[1]], [1]), threads=1)


def test_bench_offline_runs_the_vllm_peer_on_the_same_prompts(tiny_checkpoint, fake_vllm_python, capsys):
    python, log = fake_vllm_python
    model = str(tiny_checkpoint("llama-gqa"))
    assert main(["bench", "offline", "--model", model, "--workload", "fixed", "--vllm-python", python,
                 "--json", "--kv-cache-memory", "64MiB", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert [r["system"] for r in rows] == ["pagedserve", "vLLM CPU"]
    peer = rows[1]
    assert peer["peer_version"] == "vllm 0.0.fake"
    assert abs(peer["total_tok_s"] * peer["seconds"] - 64 * (128 + 64)) < 1e-6
    engine, _, timed = calls(log)
    assert engine["model"] == model and engine["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
    prompts, out_lens = fixed_workload(vocab_size=320)  # the tiny model's vocabulary
    assert timed["prompts"] == prompts and timed["max_tokens"] == out_lens
    ratio = rows[0]["total_tok_s"] / peer["total_tok_s"]
    assert f"vLLM CPU: vllm 0.0.fake; total tok/s pagedserve {rows[0]['total_tok_s']:.1f} / vLLM CPU " \
           f"{peer['total_tok_s']:.1f} = {ratio:.2f}x" in out


def test_a_peer_that_stops_early_does_not_count(tiny_checkpoint, fake_vllm_python, monkeypatch):
    python, _ = fake_vllm_python
    monkeypatch.setenv("FAKE_VLLM_SHORT", "1")
    with pytest.raises(SystemExit, match="produced 4032 tokens, not 4096"):
        main(["bench", "offline", "--model", str(tiny_checkpoint("llama-gqa")), "--workload", "fixed",
              "--vllm-python", python])


#: one line of `llama-batched-bench --output-format jsonl` (its format, figures made up)
BATCHED_LINE = ('{"n_kv_max": 12288, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
                '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 64, '
                '"n_kv": 12288, "t_pp": 10.000000, "speed_pp": 819.200000, "t_tg": 14.000000, '
                '"speed_tg": 292.571429, "t": 24.000000, "speed": 512.000000}')


def test_batched_bench_command_and_result_line():
    assert batched_bench_command("/llama/bin", "m.gguf", 2, 128, 64, 64) == [
        "/llama/bin/llama-batched-bench", "-m", "m.gguf", "-c", "12288", "-b", "2048", "-npp", "128", "-ntg", "64",
        "-npl", "64", "-t", "2", "--output-format", "jsonl"]
    row = parse_batched_bench("main: loading\n" + BATCHED_LINE + "\n\nllama_perf_context_print: ...\n")
    assert row == BatchedBenchRow(pp=128, tg=64, pl=64, n_threads=2, t_pp=10.0, t_tg=14.0, t=24.0, speed_pp=819.2,
                                  speed_tg=292.571429, speed=512.0)
    with pytest.raises(SystemExit, match="0 result lines"):
        parse_batched_bench("main: n_kv_max too small\n")
    assert uniform_shape(*fixed_workload(vocab_size=320)) == (128, 64, 64)
    with pytest.raises(SystemExit, match="the `fixed` workload"):
        uniform_shape([[1, 2], [3]], [4, 4])


def test_bench_offline_runs_llama_batched_bench_for_fixed(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "llama"
    folder.mkdir()
    argv = tmp_path / "argv.txt"
    binary = folder / "llama-batched-bench"
    binary.write_text(f"#!/bin/sh\necho \"$@\" > {argv}\necho 'build: fake'\necho '{BATCHED_LINE}'\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    model = str(tiny_checkpoint("llama-gqa"))
    assert main(["bench", "offline", "--model", model, "--workload", "fixed", "--llama-cpp", str(folder),
                 "--gguf", "m-f32.gguf", "--json", "--kv-cache-memory", "64MiB", "--threads", "1"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["system"] for r in rows] == ["pagedserve", "llama.cpp batched-bench"]
    peer = rows[1]
    assert peer["seconds"] == 24.0 and peer["total_tok_s"] == 512.0 and peer["output_tok_s"] == 64 * 64 / 24.0
    assert peer["prompt_tok_s"] == 819.2 and peer["peer_version"] == "llama.cpp m-f32"
    assert argv.read_text().split() == ["-m", "m-f32.gguf", "-c", "12288", "-b", "2048", "-npp", "128", "-ntg", "64",
                                        "-npl", "64", "-t", "1", "--output-format", "jsonl"]


def test_llama_batched_bench_refuses_mixed(tiny_checkpoint, tmp_path):
    with pytest.raises(SystemExit, match="the `fixed` workload"):
        main(["bench", "offline", "--model", str(tiny_checkpoint("llama-gqa")), "--workload", "mixed",
              "--llama-cpp", str(tmp_path), "--gguf", "m.gguf"])
