"""The model's contract: the attention metadata of a step, the kernels a model calls, and
the model plugin ABC.

The batch of one engine step is flat: the tokens of every scheduled sequence laid end to
end, decodes (one token each) first, then prefill chunks. `AttentionMetadata` describes
that layout once per step; every layer reuses it. The worker chooses the kernels once
(`kernels/selector.py`) and hands them to the model when it builds it: a model never
decides which kernels run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.common.contracts.version import API_VERSION

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and which cached K/V each query attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot (block * block_size + offset)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's queries
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (padding entries are 0)
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_seq_len: int  # max(seq_lens)
    #: host copies, so backends plan without device syncs
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    backend: AttentionBackend | None = None  # computes attention in every layer this step
    backend_state: Any = None  # whatever the backend precomputed once for all layers

    @classmethod
    def for_batch(cls, query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int,
                  device: Any = "cpu", width: int | None = None) -> AttentionMetadata:
        """The metadata of a batch given each sequence's block table, for checks, benchmarks and
        tests (the runner builds its own from the step's arrays): the new tokens' slots,
        the query offsets, and the tables padded with 0 to `width` (default: the longest)."""
        import torch

        width = width or max(len(t) for t in tables)
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, q, s in zip(tables, query_lens, seq_lens) for p in range(s - q, s)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            num_decodes=sum(1 for q in query_lens if q == 1), max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
        )


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache for a mixed prefill/decode batch.

    A backend that can run from CUDA graphs also has `decode_plan(num_seqs, max_model_len,
    block_size, device)`: a plan fixed for the longest context, valid for every replay.
    """

    name: str = ""
    #: reads and writes quantized caches (int8 rows with their float32 scale, fp8_e4m3;
    #: kernels/reference_ops.py), telling the layout from the cache's dtype; False: the
    #: runner never gives it one (--kv-cache-dtype auto only)
    quantized_kv: bool = False

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Precompute per-step state (index maps, masks) shared by every layer."""
        metadata.backend_state = None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        # [2, num_blocks, block_size, num_kv_heads, width]: width = head_dim in the model's
        # dtype, or (quantized_kv) head_dim + 4 int8 (values, then the row's float32 scale)
        # or head_dim float8_e4m3fn
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value at metadata.slot_mapping, then attend causally over each context."""


class KernelOps(ABC):
    """The element-wise kernels of a decoder layer (torch on CPU, Triton on GPU)."""

    name: str = ""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> Any:
        """x [n, hidden] → norm(x); with a residual: (norm(x + residual), x + residual)."""

    @abstractmethod
    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim] rotated by the cos/sin table rows
        of `positions` (rotate-half layout)."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, 2 * d] (gate then up) → silu(gate) * up, [n, d]."""


@dataclass(slots=True, frozen=True)
class Kernels:
    """The kernels one worker runs, chosen once at start-up."""

    attention: AttentionBackend
    ops: KernelOps


@dataclass(frozen=True, slots=True)
class DecoderLayerWeights:
    """One Llama-shaped decoder layer's weights, as a fused decode kernel reads them."""

    input_norm: torch.Tensor  # [hidden] RMSNorm weight before attention
    qkv: torch.Tensor  # [q + 2 * kv, hidden]: the q, k and v projections stacked in that order
    qkv_bias: torch.Tensor | None  # [q + 2 * kv] (Qwen2), else None
    q_norm: torch.Tensor | None  # [head_dim] RMSNorm of each query head before rotary (Qwen3), else None
    k_norm: torch.Tensor | None  # [head_dim] the same for each key head
    o_proj: torch.Tensor  # [hidden, q]
    post_norm: torch.Tensor  # [hidden] RMSNorm weight before the MLP
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate then up (SwiGLU)
    down: torch.Tensor  # [hidden, intermediate]
    #: quantized weights (EngineConfig.quantization, or a GPTQ/AWQ checkpoint); None: that
    #: projection is float, in the model's dtype. int8: one float32 scale per output row of the
    #: projection of that name, whose tensor above is then int8 [out, in] (float weight =
    #: int8 × scale). int4: float16 [out, groups], one scale per group of inputs, and the tensor
    #: above is uint8 [out, padded_in / 2], two codes a byte (plugins/int4_quantization.py).
    #: Packed for the CPU products at load (kernels/cpu_packed.py), the weight tensors are
    #: float32 [ceil(out / 16), in, 16], or uint8 4-D for int8 ([ceil(out / 16), ceil(in / 32) * 8,
    #: 16, 4], scales as above) and int4 ([ceil(out / 16), padded_in / 8, 16, 4], scales and
    #: zeros [ceil(out / 16), groups, 16])
    qkv_scale: torch.Tensor | None = None  # [q + 2 * kv] (int4: [q + 2 * kv, groups])
    o_proj_scale: torch.Tensor | None = None  # [hidden] (int4: [hidden, groups])
    gate_up_scale: torch.Tensor | None = None  # [2 * intermediate] (int4: [2 * intermediate, groups])
    down_scale: torch.Tensor | None = None  # [hidden] (int4: [hidden, groups])
    #: int4 with zero points (asymmetric): uint8 [out, groups], shaped as the scales; None:
    #: symmetric (every zero point 8), or not int4
    qkv_zeros: torch.Tensor | None = None
    o_proj_zeros: torch.Tensor | None = None
    gate_up_zeros: torch.Tensor | None = None
    down_zeros: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecoderWeights:
    """A Llama-shaped decoder (pre-norm, RMSNorm, rotate-half rotary, GQA, SwiGLU), for kernels
    that run a whole decode step in one call. The tensors are the model's own, not copies."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    cos: torch.Tensor  # [max_positions, head_dim] rotary table (rotate-half layout)
    sin: torch.Tensor  # [max_positions, head_dim]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    #: [vocab] when lm_head is int8 (--quantize-lm-head), [vocab, groups] int4 (packed on CPU:
    #: [ceil(vocab / 16), groups, 16])
    lm_head_scale: torch.Tensor | None = None
    lm_head_zeros: torch.Tensor | None = None  # uint8, shaped as the scales: an asymmetric int4 lm_head's zero points
    #: the MLP's width (gate_up's rows / 2); None: read from the weights' shapes, which packed
    #: int4 weights (padded to panels and whole groups) do not give exactly
    intermediate_size: int | None = None


class CausalLMPlugin(ABC):
    """A model architecture, keyed by its `architectures` name in config.json.

    Built by `factory(hf_config, dtype=..., device=..., kernels=Kernels)`; must be usable as
    a torch module. A model that opts in to tensor parallelism (`tensor_parallel_problem`)
    is also built with `parallel=ParallelGroup` (contracts/parallel.py) when the worker runs
    more than one rank, and then holds only its rank's shard of each split weight.
    """

    API_VERSION = API_VERSION

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [num_tokens] → hidden states [num_tokens, hidden_size].

        Writes each layer's new keys/values into `kv_caches[layer]` at
        `attn_metadata.slot_mapping` and attends over the paged cache through
        `attn_metadata.backend`.
        """

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [n, hidden_size] → float32 logits [n, vocab_size]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load from an iterable of (checkpoint tensor name, tensor)."""

    @classmethod
    def tensor_parallel_problem(cls, hf_config: Any, world_size: int) -> str | None:
        """Why this model cannot be split across `world_size` ranks (None: it can, and its
        factory takes `parallel=`). The default: it has not opted in."""
        return f"{cls.__name__} does not support tensor parallelism (it has not opted in)"

    def decoder_weights(self) -> DecoderWeights | None:
        """The weights in the Llama layout, if this model has it: then a worker may run its
        small decode steps in a fused kernel (`kernels/cpu_decode.py`) instead of `forward`.
        None (the default): always `forward`. Returning weights commits the plugin to exactly
        the Llama computation, LM head included: a kernel runs it instead of this module."""
        return None
