"""Builds a model plugin from a checkpoint directory and loads its safetensors weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.plugins import load_plugin


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight: model.safetensors, or the shards of its index."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_tensor(name)


def load_model(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device):
    """The `pagedserve.models` plugin named by config.json's `architectures`, with weights."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{model_dir}/config.json names no `architectures`")
    factory = load_plugin("models", architectures[0])
    model = factory(hf_config, dtype=dtype, device=device)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
