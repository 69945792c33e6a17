"""`KVCachePool`: the KV cache tensors, one per layer, sized from a memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

#: KV memory on CPU when no budget is given
DEFAULT_CPU_KV_BYTES = 2 * 1024**3


@dataclass(slots=True)
class KVCacheSpec:
    """The shape of one token's K/V across the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, hf_config, dtype: torch.dtype) -> KVCacheSpec:
        """The K/V shape of a transformers config."""
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        return cls(hf_config.num_hidden_layers, num_kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


class KVCachePool:
    """Per layer, a [2, num_blocks, block_size, num_kv_heads, head_dim] tensor (K then V)."""

    def __init__(self, spec: KVCacheSpec, block_size: int, num_blocks: int, device: torch.device):
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed, not empty: attention reads whole blocks and masks the unwritten tail, and
        # a masked NaN from uninitialised memory would still poison the sum (0 * NaN).
        self.kv_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    @staticmethod
    def num_blocks_for(
        spec: KVCacheSpec,
        block_size: int,
        device: torch.device,
        kv_cache_memory: int | None,
        gpu_memory_utilization: float,
    ) -> int:
        """Blocks that fit the budget: `kv_cache_memory` bytes, or on CUDA the share of GPU
        memory left under `gpu_memory_utilization` once the weights are loaded."""
        if kv_cache_memory is None:
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                kv_cache_memory = int(total * gpu_memory_utilization) - (total - free)
            else:
                kv_cache_memory = DEFAULT_CPU_KV_BYTES
        num_blocks = kv_cache_memory // (spec.bytes_per_token * block_size)
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({kv_cache_memory} bytes) holds no block of {block_size} tokens")
        return int(num_blocks)
