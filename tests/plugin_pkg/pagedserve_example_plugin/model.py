"""A Llama decoder written from the contracts alone, with its logits negated: greedy
decoding picks the least likely token. It runs whatever kernels the worker chose
(`Kernels.ops` for norms, rotary and SiLU, the step's attention backend for attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.contracts import AttentionMetadata, CausalLMPlugin, Kernels


class _Norm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class _Layer(nn.Module):
    def __init__(self, cfg, head_dim: int):
        super().__init__()
        h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, nh * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(h, nkv * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(h, nkv * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * head_dim, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = _Norm(h)
        self.post_attention_layernorm = _Norm(h)


class ReversedLlamaForCausalLM(nn.Module, CausalLMPlugin):
    def __init__(self, hf_config, *, dtype: torch.dtype, device, kernels: Kernels):
        super().__init__()
        cfg = self.config = hf_config
        self.ops = kernels.ops
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        with torch.device(device):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(_Layer(cfg, self.head_dim) for _ in range(cfg.num_hidden_layers))
            self.norm = _Norm(cfg.hidden_size)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            rope = dict(getattr(cfg, "rope_parameters", None) or {})
            theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
            inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
            freqs = torch.arange(cfg.max_position_embeddings).float()[:, None] * inv_freq[None, :]
            table = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", table.cos(), persistent=False)
            self.register_buffer("sin", table.sin(), persistent=False)
        self.to(dtype)

    def forward(self, input_ids, positions, attn_metadata: AttentionMetadata, kv_caches):
        ops, eps, n = self.ops, self.config.rms_norm_eps, input_ids.shape[0]
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            h = ops.rms_norm(x, layer.input_layernorm.weight, eps)
            q = attn.q_proj(h).view(n, -1, self.head_dim)
            k = attn.k_proj(h).view(n, -1, self.head_dim)
            v = attn.v_proj(h).view(n, -1, self.head_dim)
            q, k = ops.rotary(positions, q, k, self.cos, self.sin)
            out = attn_metadata.backend.forward(q, k, v, kv_cache, attn_metadata, self.head_dim**-0.5)
            x = x + attn.o_proj(out.reshape(n, -1))
            h = ops.rms_norm(x, layer.post_attention_layernorm.weight, eps)
            x = x + mlp.down_proj(ops.silu_and_mul(torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)))
        return ops.rms_norm(x, self.norm.weight, eps)

    def compute_logits(self, hidden_states):
        return -F.linear(hidden_states, self.lm_head.weight).float()

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params.pop(name.removeprefix("model."))[...] = tensor
        if params:
            raise KeyError(f"the checkpoint lacks {sorted(params)[:3]}")
