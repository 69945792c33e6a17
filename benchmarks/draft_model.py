"""A draft model to measure speculative decoding with: the first N decoder layers of a
checkpoint (its embeddings, final norm, LM head and tokenizer unchanged), written as a
checkpoint of its own. It shares the target's tokenizer by construction, which the `draft`
proposer requires, and no smaller model with the default model's tokenizer is at hand here.

    python benchmarks/draft_model.py --layers 8 --out /tmp/smollm2-8-layers
    pagedserve bench offline --workload grounded --speculative-method draft \\
        --speculative-model /tmp/smollm2-8-layers --compare-speculation
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from pagedserve.common.engine_config import DEFAULT_MODEL
from pagedserve.common.model_store import resolve_model
from pagedserve.engine.model_loader import iter_safetensors

LAYER = re.compile(r"\.layers\.(\d+)\.")


def truncate(model_dir: Path, num_layers: int, out: Path) -> Path:
    """Write the first `num_layers` layers of `model_dir` to `out`."""
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']}]")
    out.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():  # tokenizer, generation config, ...
        if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy2(item, out / item.name)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types",):  # per-layer lists some configs carry
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for name, tensor in iter_safetensors(model_dir):
        match = LAYER.search(name)
        if match is None or int(match.group(1)) < num_layers:
            kept[name] = tensor.contiguous()
    save_file(kept, str(out / "model.safetensors"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    print(truncate(resolve_model(args.model), args.layers, args.out))


if __name__ == "__main__":
    main()
