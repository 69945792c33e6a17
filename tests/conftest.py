"""Shared fixtures: tiny random checkpoints, and markers that skip cleanly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# In-process tests run the Triton kernels in Triton's interpreter, on CPU tensors, GPU or
# not (the variable is read when a kernel is defined, so it is set before any test imports
# one). The `gpu` test runs them compiled, in a subprocess without it.
os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import build_checkpoint  # noqa: E402


def _docker_engine_answers() -> bool:
    """Whether a Docker engine answers, asked once per session: the CLI and a socket file
    are not enough (CI may have /var/run/docker.sock with no daemon behind it)."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    has_docker = any("docker" in item.keywords for item in items) and _docker_engine_answers()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "docker" in item.keywords and not has_docker:
            item.add_marker(pytest.mark.skip(reason="needs a Docker engine"))


#: name → (kind, config overrides): GQA and MHA, odd head counts
TINY_MODELS = {
    "llama-gqa": ("llama", {}),
    "llama-mha-odd": ("llama", {"hidden_size": 60, "num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 12}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 96, "head_dim": 32}),
    "qwen3": ("qwen3", {"num_attention_heads": 7, "num_key_value_heads": 1, "hidden_size": 112, "head_dim": 16}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),  # the LM head is the embedding, as in SmolLM2
    "llama-vocab8": ("llama", {"vocab_size": 8}),  # distributions small enough to test by counting
    # a draft model for speculative decoding: the llama models' tokenizer, one smaller layer
    "llama-draft": ("llama", {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 96}),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Call with a name from TINY_MODELS; each checkpoint is written once per session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            kind, overrides = TINY_MODELS[name]
            made[name] = build_checkpoint(kind, tmp_path_factory.mktemp(name), **overrides)
        return made[name]

    return get
