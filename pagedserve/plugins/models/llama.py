"""The Llama family and its close relatives in one decoder.

LlamaForCausalLM covers Llama 2/3 (with llama3 rope scaling) and SmolLM2; Mistral is the
same without sliding window; Qwen2 adds a bias on q/k/v; Qwen3 adds RMSNorm on q and k.
q/k/v and gate/up are each fused into one matmul; `load_weights` fills the fused weights
from the checkpoint's separate tensors.

Built with `parallel=` (tensor parallelism, common/contracts/parallel.py), each rank holds a
shard: q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel, the embedding
and LM head split by vocabulary (parallel_layers.py), the KV heads split, or replicated when there
are fewer of them than ranks. Without it the modules are the plain ones, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.contracts import (
    AttentionMetadata,
    CausalLMPlugin,
    DecoderLayerWeights,
    DecoderWeights,
    KernelOps,
    Kernels,
    ParallelGroup,
    RowSlice,
    even_slice,
    kv_head_slice,
    tensor_parallel_sizes_problem,
)
from pagedserve.plugins.models.norm import RMSNorm
from pagedserve.plugins.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.plugins.models.rotary import RotaryEmbedding, rope_parameters


def _weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """A plain module's weight (or bias) tensor, typed (the attributes are typed as modules
    because the parallel layers may stand in their place)."""
    return cast(torch.Tensor, getattr(module, name))


def _weight_of(module: nn.Module) -> torch.Tensor:
    """What a fused kernel reads of a linear: its weight, an int4 linear's packed codes, or a
    packed linear's panels (kernels/cpu_packed.py: float32 [ceil(out / 16), in, 16], int8 or
    int4 bytes 4-D)."""
    for name in ("qweight", "packed"):
        if hasattr(module, name):
            return cast(torch.Tensor, getattr(module, name))
    return cast(torch.Tensor, module.weight)


def _scale(linear: nn.Module) -> torch.Tensor | None:
    """The scales of a quantized linear: per row (int8: `weight_scale`) or per group (int4,
    packed or not: `scales`); None for a float one."""
    return cast(torch.Tensor, linear.scales) if hasattr(linear, "scales") else getattr(linear, "weight_scale", None)


def _zeros(linear: nn.Module) -> torch.Tensor | None:
    """An asymmetric int4 linear's zero points; None otherwise."""
    return getattr(linear, "zeros", None) if hasattr(linear, "scales") else None


#: the layers that load their rank's shard of a checkpoint tensor themselves
PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)


def _num_kv_heads(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool, ops: KernelOps,
                 parallel: ParallelGroup | None = None):
        super().__init__()
        num_heads, num_kv_heads = cfg.num_attention_heads, _num_kv_heads(cfg)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj: nn.Module
        self.o_proj: nn.Module
        if parallel is None:
            self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
            self.q_size = self.num_heads * self.head_dim
            self.kv_size = self.num_kv_heads * self.head_dim
            self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
            self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        else:  # this rank's query heads, and the KV heads they read
            heads = even_slice(num_heads, parallel.rank, parallel.world_size)
            kv_heads = kv_head_slice(num_heads, num_kv_heads, parallel.rank, parallel.world_size)
            self.num_heads, self.num_kv_heads = heads.size, kv_heads.size
            self.q_size = self.num_heads * self.head_dim
            self.kv_size = self.num_kv_heads * self.head_dim
            d = self.head_dim
            kv_rows = RowSlice(kv_heads.start * d, kv_heads.size * d)
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [RowSlice(heads.start * d, heads.size * d),
                                                                   kv_rows, kv_rows], qkv_bias)
            self.o_proj = RowParallelLinear(num_heads * d, cfg.hidden_size, parallel)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops) if qk_norm else None
        self.rotary = rotary

    def forward(self, positions, hidden, metadata: AttentionMetadata, kv_cache):
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [n, heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [n, kv_heads, head_dim]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        assert metadata.backend is not None  # set by the runner for every step
        out = metadata.backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return self.o_proj(out.view(n, self.q_size))


class DecoderMLP(nn.Module):
    def __init__(self, cfg, ops: KernelOps, parallel: ParallelGroup | None = None):
        super().__init__()
        self.ops = ops
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj: nn.Module
        self.down_proj: nn.Module
        if parallel is None:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        else:
            rows = even_slice(cfg.intermediate_size, parallel.rank, parallel.world_size)
            self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [rows, rows], bias=False)
            self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, parallel)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool, ops: KernelOps,
                 parallel: ParallelGroup | None = None):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rotary, qkv_bias, qk_norm, ops, parallel)
        self.mlp = DecoderMLP(cfg, ops, parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, metadata, kv_cache):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module, CausalLMPlugin):
    """Decoder-only transformer with RMSNorm, rotary embedding, SwiGLU and GQA."""

    qkv_bias = False
    qk_norm = False
    #: modules made of several checkpoint layers stacked along the outputs (for loaders of
    #: pre-quantized checkpoints, which repack each layer: plugins/int4_checkpoint.py)
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hf_config, *, dtype: torch.dtype, device: str | torch.device, kernels: Kernels,
                 parallel: ParallelGroup | None = None):
        super().__init__()
        self.parallel = parallel  # this rank's group under tensor parallelism, else None
        cfg = hf_config
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and cfg.sliding_window < cfg.max_position_embeddings:
            raise NotImplementedError(f"sliding-window attention ({cfg.sliding_window}) is not supported")
        self.config = cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        qkv_bias = self.qkv_bias or bool(getattr(cfg, "attention_bias", False))
        with torch.device(device):
            ops = kernels.ops
            rotary = RotaryEmbedding(head_dim, cfg.max_position_embeddings, rope_parameters(cfg), dtype, ops)
            self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
            self.embed_tokens: nn.Module
            self.lm_head: nn.Module | None
            if parallel is None:
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
                self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            else:
                embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
                self.embed_tokens = embed
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel,
                                              tied=embed if self.tie_word_embeddings else None)
            self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, qkv_bias, self.qk_norm, ops, parallel)
                                        for _ in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.to(dtype)
        rotary.to(device)  # the cos/sin tables keep the dtype they were built in

    def forward(self, input_ids, positions, attn_metadata, kv_caches):
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, attn_metadata, kv_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states):
        if self.lm_head is None:  # tied
            return F.linear(hidden_states, _weight(self.embed_tokens)).float()  # [n, vocab]
        return self.lm_head(hidden_states).float()  # a float, quantized or parallel head

    @classmethod
    def tensor_parallel_problem(cls, hf_config, world_size: int) -> str | None:
        return tensor_parallel_sizes_problem(world_size, num_heads=hf_config.num_attention_heads,
                                             num_kv_heads=_num_kv_heads(hf_config),
                                             intermediate_size=hf_config.intermediate_size)

    def decoder_weights(self) -> DecoderWeights | None:
        # A subclass that computes anything differently (its own forward or LM head) must
        # not be run by a kernel that only knows this computation.
        cls = type(self)
        if cls.forward is not LlamaForCausalLM.forward or cls.compute_logits is not LlamaForCausalLM.compute_logits:
            return None
        if self.parallel is not None:
            return None  # a shard: the fused kernel has no all-reduce between its layers
        layers = []
        for layer in cast(Iterable[DecoderLayer], self.layers):
            attn = layer.self_attn
            layers.append(DecoderLayerWeights(
                input_norm=layer.input_layernorm.weight, qkv=_weight_of(attn.qkv_proj),
                qkv_bias=cast(torch.Tensor | None, attn.qkv_proj.bias),
                q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
                k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
                o_proj=_weight_of(attn.o_proj), post_norm=layer.post_attention_layernorm.weight,
                gate_up=_weight_of(layer.mlp.gate_up_proj), down=_weight_of(layer.mlp.down_proj),
                # a quantized linear (contracts/quantization.py) carries its scales (and int4's zeros)
                qkv_scale=_scale(attn.qkv_proj), o_proj_scale=_scale(attn.o_proj),
                gate_up_scale=_scale(layer.mlp.gate_up_proj), down_scale=_scale(layer.mlp.down_proj),
                qkv_zeros=_zeros(attn.qkv_proj), o_proj_zeros=_zeros(attn.o_proj),
                gate_up_zeros=_zeros(layer.mlp.gate_up_proj), down_zeros=_zeros(layer.mlp.down_proj),
            ))
        first = cast(DecoderLayer, self.layers[0]).self_attn
        return DecoderWeights(
            embed=_weight(self.embed_tokens), layers=layers, final_norm=self.norm.weight,
            lm_head=_weight(self.embed_tokens) if self.lm_head is None else _weight_of(self.lm_head),
            lm_head_scale=None if self.lm_head is None else _scale(self.lm_head),
            lm_head_zeros=None if self.lm_head is None else _zeros(self.lm_head),
            cos=first.rotary.cos, sin=first.rotary.sin, num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, rms_norm_eps=float(self.config.rms_norm_eps),
            intermediate_size=int(self.config.intermediate_size),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules()) if self.parallel is not None else {}
        # checkpoint name piece → (fused parameter piece, shard index)
        fused = {
            "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding serves as the LM head
            parts = name.split(".")
            target, shard = name, None
            for i, piece in enumerate(parts):
                if piece in fused:
                    new_piece, shard = fused[piece]
                    target = ".".join(parts[:i] + [new_piece] + parts[i + 1 :])
                    break
            module_name, _, leaf = target.rpartition(".")
            module = modules.get(module_name)
            if isinstance(module, PARALLEL_LAYERS):  # it copies its rank's shard
                with torch.no_grad():
                    module.load(shard or 0, leaf, tensor)
                loaded.add(f"{target}#{shard}")
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} vs {tuple(param.shape)}"
                    param.copy_(tensor)
                else:
                    offset = self._shard_offset(target, shard)
                    param[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(f"{target}#{shard}")
        # a parallel layer's `linear.weight` is loaded as its own `weight`
        missing = [n for n in params if not any(k.startswith(n.replace(".linear.", ".") + "#") for k in loaded)]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _shard_offset(self, target: str, shard: int) -> int:
        if "qkv_proj" in target:
            attn = cast(DecoderLayer, self.layers[0]).self_attn
            return [0, attn.q_size, attn.q_size + attn.kv_size][shard]
        return shard * self.config.intermediate_size


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout; sliding-window configs are refused."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama's layout with a bias on the q/k/v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama's layout with RMSNorm on each head of q and k before rotary."""

    qk_norm = True
