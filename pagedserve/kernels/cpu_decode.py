"""Small decode steps of a Llama-shaped model in one C++ call, on CPU (float32).

The CPU counterpart of the decode CUDA graphs: a decode step of a few sequences is almost
all weight reads and host work between them. `FusedDecoder` runs the whole forward of such
a step in csrc/cpu_decode.cpp — its own matrix products (over the weights the loader packed,
kernels/cpu_packed.py, at every row count; with packing off, its earlier kernels, which read
the weights at about twice the speed of torch's batch-1 `F.linear` and, from 8 rows, run in
register tiles; batch-invariant either way), and the element-wise work in the same loops, split across
threads by rows in large steps, with no Python or aten calls per layer. The runner uses it
for decode-only steps of up to `fused_decode_max_batch` rows (and, with speculative decoding,
for steps that verify drafts: each draft a row, see `FusedDecoder.forward`): 256 by default,
packed int8 weights included, 16 with unpacked int8 weights, and with int4 weights as many as the int4 kernel beats dequantizing
(`int4_kernel_max_rows`: 256 with AVX-512 VNNI, 32 with AVX2); every other step (prefill
chunks, mixed batches) runs the model's own `forward`.

With quantized weights (`EngineConfig.quantization`, or a GPTQ/AWQ checkpoint), the
projections whose `DecoderLayerWeights` carry a scale run the packed int8 product
(csrc/cpu_packed_int8.cpp, when the loader packed them), the int8 GEMV of the same file, or
the int4 kernel of csrc/cpu_int4_gemv.cpp (the LM head too when it is quantized): the same
kernels that the eager `Int8Linear` / `Int4Linear` call for a few rows.
With an int8 KV cache (`EngineConfig.kv_cache_dtype`), the step quantizes each new K/V row
as it stores it and the attention kernel reads the int8 rows with their scales.

Nothing is captured or compiled per batch size: the kernels are built once with the CPU
attention kernel (kernels/cpu_attention.py) and take any number of rows.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.common.contracts import DecoderLayerWeights, DecoderWeights, ModelInput
from pagedserve.kernels.cpu_attention import cpu_kernels


def fused_decode_supported(weights: DecoderWeights | None, dtype: torch.dtype, device: torch.device,
                           kv_cache_dtype: torch.dtype | None = None) -> str | None:
    """Why these weights cannot run fused here, or None when they can (`kv_cache_dtype`:
    the KV cache's element type, None: the model's)."""
    if weights is None:
        return "the model has no Llama-shaped decoder weights"
    if device.type != "cpu":
        return "the fused decode step runs on CPU only"
    if dtype != torch.float32:
        return f"the fused decode step is float32 only (the model runs in {dtype})"
    if kv_cache_dtype not in (None, dtype, torch.int8):
        return f"the fused decode step reads a float32 or int8 KV cache, not {kv_cache_dtype}"
    if cpu_kernels() is None:
        return "the CPU kernels could not be built (see the log)"
    packed_int4 = any(s is not None and s.dim() == 3 for w in weights.layers for s in _scales(w))
    if packed_int4 and weights.intermediate_size is None:
        return "packed int4 weights need DecoderWeights.intermediate_size (the model plugin gives none)"
    return None


#: with int8 weights, the most rows of a fused step: its int8 kernels were measured faster than
#: the eager forward (dequantize + BLAS) up to 16 rows, and not measured above
FUSED_INT8_MAX_BATCH = 16


def _scales(w: DecoderLayerWeights) -> list[torch.Tensor | None]:
    """The scales of one layer's projections, in the kernel's slot order (None: float)."""
    return [w.qkv_scale, w.o_proj_scale, w.gate_up_scale, w.down_scale]


def _zeros(w: DecoderLayerWeights) -> list[torch.Tensor | None]:
    """The int4 zero points of one layer's projections, in the kernel's slot order."""
    return [w.qkv_zeros, w.o_proj_zeros, w.gate_up_zeros, w.down_zeros]


def _int4(scale: torch.Tensor | None) -> bool:
    """int4 weights have scales per group: [out, groups], or packed [panels, groups, 16]."""
    return scale is not None and scale.dim() >= 2


class FusedDecoder:
    """The decode forward and the LM head of one model, for batches of a few sequences."""

    def __init__(self, weights: DecoderWeights, kv_caches: list[torch.Tensor], max_batch: int, blas_rows: int = 0,
                 max_query_len: int = 1):
        kernels = cpu_kernels()
        assert kernels is not None, "check fused_decode_supported first"
        self._kernels = kernels
        self.kv_caches = kv_caches
        quantized = any(_scales(w) != [None] * 4 for w in weights.layers)
        int4 = any(_int4(s) for w in weights.layers for s in _scales(w))
        #: the most rows (tokens) of a step run here
        self.max_batch = max_batch
        packed_quantized = weights.layers[0].qkv.dim() == 4  # the packed int8/int4 products: every row count
        if int4 and not packed_quantized:
            self.max_batch = min(max_batch, int(torch.ops.pagedserve.int4_kernel_max_rows()))
        elif quantized and not packed_quantized:
            self.max_batch = min(max_batch, FUSED_INT8_MAX_BATCH)
        #: the most tokens of one sequence in a step run here: 1 (decodes), or 1 + the drafts a
        #: speculative step verifies, each draft a row of its own (see `takes`)
        self.max_query_len = max_query_len
        self.num_steps = 0  # decode steps run here (the rest ran the model's forward)
        self.lm_head = weights.lm_head
        #: the LM head's output rows (the vocabulary); a packed head has them padded to 16
        self.vocab_size = int(weights.embed.shape[0]) if weights.lm_head.dim() >= 3 else int(weights.lm_head.shape[0])
        #: the loader packed the float32 linears (kernels/cpu_packed.py): the products run packed
        self.packed = weights.layers[0].qkv.dim() == 3
        if (self.packed or packed_quantized) and weights.lm_head.dim() == 2 and weights.lm_head.dtype == torch.float32:
            # a tied float head (the embedding, which the lookup needs unpacked; the other linears
            # packed, float32 or int8/int4): a packed copy of its own, for every row count
            self.lm_head = kernels.pack_linear_weight(weights.lm_head)
        self.lm_head_scale = weights.lm_head_scale
        self.lm_head_zeros = weights.lm_head_zeros
        layers = [[w.input_norm, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, w.o_proj, w.post_norm, w.gate_up, w.down]
                  for w in weights.layers]
        if quantized:
            layers = [slots + _scales(w) + (_zeros(w) if int4 else []) for slots, w in zip(layers, weights.layers)]
        self._impl = kernels.FusedDecoder(weights.embed, layers, weights.final_norm, weights.cos.float(),
                                          weights.sin.float(), weights.num_heads, weights.num_kv_heads,
                                          weights.head_dim, weights.rms_norm_eps, weights.intermediate_size or 0)
        #: from this many rows the unpacked float32 products (the LM head's too) run torch's BLAS
        #: (0: never); packed weights always run the packed product
        self.blas_rows = blas_rows
        self._impl.set_blas_rows(blas_rows)

    def takes(self, batch: ModelInput) -> bool:
        """Whether this step runs here: at most `max_batch` tokens, and no sequence with more
        than `max_query_len` (decodes, and speculative verifications of a few drafts)."""
        return len(batch.input_ids) <= self.max_batch and max(batch.query_lens, default=0) <= self.max_query_len

    def forward(self, batch: ModelInput) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step that `takes` accepts.

        Each token is a row, as a decode is: its K/V is stored at its slot, then it attends to
        its sequence's context up to its own position (its block table, its position + 1
        tokens). So a sequence verifying k drafts is k + 1 rows over one block table: every
        row's K/V is stored before any row attends, and each row sees exactly the tokens
        before it, which is causal attention over the drafts, with every weight read once for
        all the rows of the step."""
        assert self.takes(batch), "at most max_batch tokens and max_query_len per sequence"
        self.num_steps += 1
        positions = np.ascontiguousarray(batch.positions, dtype=np.int64)
        tables = np.ascontiguousarray(batch.block_tables, dtype=np.int32)
        if len(batch.input_ids) != len(batch.query_lens):  # a sequence of several rows
            tables = np.ascontiguousarray(np.repeat(tables, batch.query_lens, axis=0))
        return self._impl.forward(
            torch.tensor(batch.input_ids, dtype=torch.long),
            torch.from_numpy(positions),
            torch.from_numpy(np.ascontiguousarray(batch.slots, dtype=np.int64)),
            torch.from_numpy(tables),
            torch.from_numpy((positions + 1).astype(np.int32)),
            self.kv_caches,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] of a few rows of final hidden states."""
        if self.lm_head_scale is not None and self.lm_head_scale.dim() == 3:  # packed int4
            return self._kernels.packed_int4_linear(hidden.contiguous(), self.lm_head, self.lm_head_scale,
                                                    self.lm_head_zeros, self.vocab_size)
        if self.lm_head_scale is not None and _int4(self.lm_head_scale):
            group = self.lm_head.shape[1] * 2 // self.lm_head_scale.shape[1]
            return self._kernels.int4_linear(hidden.contiguous(), self.lm_head, self.lm_head_scale, self.lm_head_zeros,
                                             None, group)
        if self.lm_head_scale is not None and self.lm_head.dim() == 4:  # packed int8
            return self._kernels.packed_int8_linear(hidden.contiguous(), self.lm_head, self.lm_head_scale,
                                                    self.vocab_size)
        if self.lm_head_scale is not None:
            return self._kernels.small_linear_int8(hidden.contiguous(), self.lm_head, self.lm_head_scale)
        if self.lm_head.dim() == 3:  # packed: the same bits at every row count
            return self._kernels.packed_linear(hidden.contiguous(), self.lm_head, self.vocab_size)
        if 0 < self.blas_rows <= hidden.shape[0]:
            return torch.mm(hidden, self.lm_head.t())
        return self._kernels.small_linear(hidden.contiguous(), self.lm_head)

    def set_profile(self, on: bool) -> None:
        """Count the time of each stage kind (linear, attention, other) while on."""
        self._impl.set_profile(on)

    def take_profile(self) -> tuple[float, float, float]:
        """Seconds in linear layers, attention and other ops since the last call (while profiling)."""
        linear, attention, other = self._impl.take_profile()
        return linear / 1e9, attention / 1e9, other / 1e9
