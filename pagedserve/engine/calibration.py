"""The engine's side of quantization calibration (`--quantization-calibration imatrix|gptq`): the
calibration tokens, and the passes of the model over them that a quantization method asks for
(`Calibration.layer_inputs`, common/contracts/quantization.py).

The tokens are the first `--quantization-calibration-tokens` tokens of a text: the file
`--quantization-calibration-text`, or by default `data/calibration.txt` (the last chapter of
*Strange Case of Dr Jekyll and Mr Hyde*, "Henry Jekyll's Full Statement of the Case", 9,239
tokens with the SmolLM2 tokenizer; data/README.md). The perplexity benchmark's figures read the
same book's first 4,096 tokens, which this chapter does not contain. The text is tokenized whole,
without special tokens, and fed in windows of `WINDOW` tokens, each a fresh sequence at
positions 0.. in a KV cache of its own (freed after each pass), through the model plugin's
`forward` with the worker's attention backend: the prefill path serving takes. A window's
forward stops as soon as every module a pass asked for has had its input (the first time it
is called), so a pass over the first layers costs only their share of a forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.common.contracts import Calibration, Kernels, LayerInputs, ModelInput
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.kv_cache_pool import KVCachePool, KVCacheSpec
from pagedserve.engine.step_inputs import step_tensors

DEFAULT_TEXT = "calibration.txt"  # in pagedserve/engine/data/
WINDOW = 1024  # tokens per calibration sequence (at most the model's max_position_embeddings)
BLOCK_SIZE = 16  # the calibration KV cache's block size


@dataclass(frozen=True, slots=True)
class CalibrationRequest:
    """What EngineConfig asks for: `quantization_calibration` and its tokens' count and text."""

    method: str  # "imatrix" | "gptq"
    num_tokens: int
    text: str | None  # a UTF-8 file; None: DEFAULT_TEXT

    @classmethod
    def of(cls, config: Any) -> CalibrationRequest | None:
        """The request of an EngineConfig; None without calibration."""
        if config.quantization_calibration == "none":
            return None
        return cls(config.quantization_calibration, config.quantization_calibration_tokens,
                   config.quantization_calibration_text)


def calibration_tokens(model_dir: Path, request: CalibrationRequest) -> tuple[list[int], str]:
    """The first `num_tokens` tokens of the calibration text, and where they come from; an
    `InvalidParameterError` for a text that cannot be read or is too short."""
    from transformers import AutoTokenizer

    if request.text is None:
        text, name = files("pagedserve.engine").joinpath(f"data/{DEFAULT_TEXT}").read_text(encoding="utf-8"), DEFAULT_TEXT
    else:
        try:
            text, name = Path(request.text).read_text(encoding="utf-8"), request.text
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidParameterError("quantization_calibration_text", f"cannot read {request.text}: {exc}") from None
    ids = AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"]
    if len(ids) < request.num_tokens:
        raise InvalidParameterError("quantization_calibration_tokens",
                                    f"{request.num_tokens} calibration tokens asked for, but {name} has {len(ids)} "
                                    "with this model's tokenizer; ask for fewer or give a longer text")
    return ids[: request.num_tokens], f"{name}, its first {request.num_tokens} tokens"


class _Recorded(Exception):
    """Raised by the last hook a window reaches: the forward stops there."""


class TokenCalibration(Calibration):
    """Passes of `model` over fixed tokens, recording its linear layers' inputs."""

    def __init__(self, method: str, model: torch.nn.Module, tokens: list[int], source: str, hf_config,
                 kernels: Kernels, device: torch.device, dtype: torch.dtype):
        self.method = method
        self.num_tokens = len(tokens)
        self.source = source
        self.passes = 0  # passes run so far
        self._model, self._tokens, self._kernels, self._device = model, tokens, kernels, device
        self._window = min(WINDOW, hf_config.max_position_embeddings)
        self._spec = KVCacheSpec.for_model(hf_config, dtype)

    @torch.inference_mode()
    def layer_inputs(self, modules: Mapping[str, Any], full: bool = True) -> dict[str, LayerInputs]:
        sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float32, device=self._device)
                for name, m in modules.items()} if full else {}
        squares = {name: torch.zeros(m.in_features, dtype=torch.float32, device=self._device)
                   for name, m in modules.items()}

        waiting: set[str] = set()  # the modules whose input this window has not reached yet

        def recorder(name: str):
            def hook(module, args):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                squares[name].add_((x * x).sum(dim=0))
                if full:
                    sums[name].addmm_(x.T, x)
                waiting.discard(name)
                if not waiting:
                    raise _Recorded  # the rest of the forward would record nothing
            return hook

        hooks = [m.register_forward_pre_hook(recorder(name)) for name, m in modules.items()]
        pool = KVCachePool(self._spec, BLOCK_SIZE, -(-self._window // BLOCK_SIZE), self._device)
        try:
            for start in range(0, len(self._tokens), self._window):
                waiting.update(modules)
                with contextlib.suppress(_Recorded):
                    self._forward(self._tokens[start : start + self._window], pool)
        finally:
            for hook in hooks:
                hook.remove()
        self.passes += 1
        return {name: LayerInputs(sums.get(name), squares[name], self.num_tokens) for name in modules}

    def _forward(self, ids: list[int], pool: KVCachePool) -> None:
        """One window as a fresh sequence: blocks 0.., positions 0.., no logits."""
        n = len(ids)
        batch = ModelInput(input_ids=ids, positions=np.arange(n, dtype=np.int64), slots=np.arange(n, dtype=np.int64),
                           query_lens=[n], seq_lens=[n],
                           block_tables=np.arange(-(-n // BLOCK_SIZE), dtype=np.int32)[None, :],
                           num_decodes=0, sample_rows=[], sample_entries=[])
        input_ids, positions, metadata = step_tensors(batch, self._device, self._kernels.attention, BLOCK_SIZE)
        self._model(input_ids, positions, metadata, pool.kv_caches)
