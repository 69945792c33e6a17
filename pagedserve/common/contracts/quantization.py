"""The quantization contract: a method that turns a loaded model's linear layers into
quantized ones, and what it reports.

A quantization plugin (entry-point group `pagedserve.quantization`, named by
`EngineConfig.quantization`) runs once per worker, after the model plugin's `load_weights`
and before the runner looks at the model (`decoder_weights`, the KV cache size). It works
on any float checkpoint: the weights are quantized here, at load time.

A quantized linear module keeps the layout a kernel needs to read it without knowing the
method: `weight` holds the quantized rows [out, in] and `weight_scale` one float per
output row (`weight[o, i] * weight_scale[o]` is the float weight), next to the usual
`bias` (or None). `LlamaForCausalLM.decoder_weights` hands these on in `DecoderLayerWeights`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from pagedserve.common.contracts.version import API_VERSION


@dataclass(frozen=True, slots=True)
class QuantizationReport:
    """What a quantization method did to one model."""

    method: str  # the method's name, as in EngineConfig.quantization ("int8")
    num_linear: int  # linear modules replaced by quantized ones
    float_bytes: int  # bytes the replaced modules' float weights took before
    quantized_bytes: int  # bytes their quantized weights and scales take now (biases not counted)
    model_bytes: int  # every parameter and buffer of the model after quantizing, in bytes
    lm_head: bool  # whether the LM head was quantized too


class QuantizationPlugin(ABC):
    """A weight quantization method, built with no arguments (`factory()`)."""

    API_VERSION = API_VERSION
    name: str = ""  # the method's name, for logs and reports

    @abstractmethod
    def quantize(self, model: Any, *, quantize_lm_head: bool = False) -> QuantizationReport:
        """Replace the linear layers of `model` (a loaded model plugin, a torch module in
        eval mode) in place with quantized modules of the layout above, and report the bytes.
        The LM head and the embeddings stay float unless `quantize_lm_head`; a method that
        cannot quantize the LM head of this model leaves it float and says so in the report."""
