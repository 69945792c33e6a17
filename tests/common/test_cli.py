"""The command line, run in a subprocess the way a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env})


def test_generate_prints_the_greedy_text(tiny_checkpoint):
    from pagedserve import LLM, SamplingParams

    model_dir = str(tiny_checkpoint("llama-gqa"))
    done = run_cli("generate", "--model", model_dir, "--max-tokens", "6", "Hello world")
    assert done.returncode == 0, done.stderr
    expected = LLM(model_dir, kv_cache_memory=1 << 22).generate("Hello world", SamplingParams(max_tokens=6, temperature=0.0))
    assert done.stdout == expected[0].outputs[0].text + "\n"


def test_models_list_and_unknown_model(tmp_path):
    done = run_cli("models", "list", PAGEDSERVE_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0
    assert done.stdout == "smollm2-135m-instruct\tApache-2.0\tnot pulled\n"
    done = run_cli("generate", "--model", "nope", "hi")
    assert done.returncode == 2
    assert "unknown model 'nope'" in done.stderr
