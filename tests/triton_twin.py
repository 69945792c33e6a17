"""The `gpu` twin of a Triton kernel test file: in-process its tests run the kernels in
Triton's interpreter on CPU tensors; the twin runs the same file again in a subprocess with
TRITON_INTERPRET=0, the kernels compiled for the GPU, on CUDA tensors (`twin_device`)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def twin_device() -> str:
    """CUDA only when the kernels are compiled (the `gpu` twin runs with TRITON_INTERPRET=0)."""
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def run_compiled_twin(test_file: str) -> None:
    """Run `test_file`'s tests but its `gpu` ones in a subprocess with TRITON_INTERPRET=0:
    every one must pass (none skipped), against the same references and tolerances."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", test_file],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout and "failed" not in done.stdout
