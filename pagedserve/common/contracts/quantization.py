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

Calibration. A method that fits its weights to the activations they will see (GPTQ, an
importance matrix) names the calibrations it implements in `calibration_methods`; when
`EngineConfig.quantization_calibration` asks for one of them, the engine hands `quantize` a `Calibration`:
a fixed set of calibration tokens that the method can run the model over (as it is at that
moment: layers already quantized included) to get each linear layer's input statistics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
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
    calibration: str = "none"  # the calibration the weights were fitted with ("gptq"), or "none"


@dataclass(frozen=True, slots=True)
class LayerInputs:
    """What the calibration tokens fed one linear layer y = x·Wᵀ + b."""

    #: torch.Tensor float32 [in, in] on the layer's device: Σ xᵀx over every input row x (one
    #: row a calibration token), GPTQ's Hessian up to a factor 2; None from a pass that was
    #: asked for the diagonal only
    hessian: Any
    squares: Any  # torch.Tensor float32 [in]: Σ x² per input, the diagonal (an importance matrix's)
    num_rows: int  # rows summed: the calibration tokens


class Calibration(ABC):
    """Calibration tokens, and a forward over them, offered by the engine to `quantize`."""

    method: str  # the calibration asked for (EngineConfig.quantization_calibration: "gptq", "imatrix")
    num_tokens: int  # calibration tokens one pass runs
    source: str  # where the tokens come from (a file and the part of it), for logs

    @abstractmethod
    def layer_inputs(self, modules: Mapping[str, Any], full: bool = True) -> dict[str, LayerInputs]:
        """One pass of the model, as it is now, over the calibration tokens (prefill, no
        logits), recording the inputs of `modules` (a name of the caller's choosing → a
        linear module of the model, with `in_features`): their `LayerInputs` by the same
        names, with the whole [in, in] sum only when `full`. Each pass costs one forward over
        `num_tokens` tokens (less when the modules asked for are all early in the model) and,
        when `full`, holds one [in, in] float32 sum per module, so a method may ask for a few
        modules at a time."""


class QuantizationPlugin(ABC):
    """A weight quantization method, built with no arguments (`factory()`)."""

    API_VERSION = API_VERSION
    name: str = ""  # the method's name, for logs and reports
    #: the `Calibration.method`s this method implements; the engine refuses any other
    calibration_methods: tuple[str, ...] = ()

    @abstractmethod
    def quantize(self, model: Any, *, quantize_lm_head: bool = False,
                 calibration: Calibration | None = None) -> QuantizationReport:
        """Replace the linear layers of `model` (a loaded model plugin, a torch module in
        eval mode) in place with quantized modules of the layout above, and report the bytes.
        The LM head and the embeddings stay float unless `quantize_lm_head`; a method that
        cannot quantize the LM head of this model leaves it float and says so in the report.
        `calibration` (None: data-free) is given only with a method in `calibration_methods`."""
