"""`KVCachePool`: the KV cache tensors, one per layer, sized from a memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedserve.common.errors import InvalidParameterError
from pagedserve.kernels.reference_ops import kv_row_width

logger = logging.getLogger(__name__)

#: KV memory on CPU when no budget is given
DEFAULT_CPU_KV_BYTES = 2 * 1024**3


#: EngineConfig.kv_cache_dtype → the cache tensor's dtype (auto: the model's)
KV_CACHE_TORCH_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type for `--kv-cache-dtype name` on `device`."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_TORCH_DTYPES:
        raise InvalidParameterError("kv_cache_dtype", f"must be auto, int8 or fp8_e4m3, got {name!r}")
    if name == "fp8_e4m3" and device.type != "cuda":
        raise InvalidParameterError("kv_cache_dtype", f"fp8_e4m3 needs a CUDA device (this worker runs on "
                                    f"{device.type}); on CPU use int8")
    return KV_CACHE_TORCH_DTYPES[name]


@dataclass(slots=True)
class KVCacheSpec:
    """The shape of one token's K/V across the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int  # the model's head_dim (a cache row is wider for int8: its scale follows)
    dtype: torch.dtype  # the cache tensor's element type: the model's, int8 or float8_e4m3fn

    @classmethod
    def for_model(cls, hf_config, dtype: torch.dtype) -> KVCacheSpec:
        """The K/V shape of a transformers config, stored as `dtype`."""
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        if dtype == torch.int8 and head_dim % 4:
            raise InvalidParameterError("kv_cache_dtype", f"int8 KV rows need head_dim divisible by 4 "
                                        f"(their float32 scale stays aligned); this model has {head_dim}")
        return cls(hf_config.num_hidden_layers, num_kv_heads, head_dim, dtype)

    @property
    def row_width(self) -> int:
        """Elements of one cache row (one token's K or V of one KV head): head_dim, + 4 for
        an int8 row's float32 scale (kernels/reference_ops.py)."""
        return kv_row_width(self.head_dim, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer and KV head, scales included."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * element


class KVCachePool:
    """Per layer, a [2, num_blocks, block_size, num_kv_heads, row_width] tensor (K then V);
    row_width is head_dim, or head_dim + 4 in an int8 cache (each row's float32 scale)."""

    def __init__(self, spec: KVCacheSpec, block_size: int, num_blocks: int, device: torch.device):
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.row_width)
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
