"""Engine configuration: one Struct, filled from keyword arguments, flags or environment."""

from __future__ import annotations

import msgspec

from pagedserve.common.errors import InvalidParameterError

DEFAULT_MODEL = "smollm2-135m-instruct"


class EngineConfig(msgspec.Struct, kw_only=True):
    """Everything that shapes one worker's engine."""

    model: str = DEFAULT_MODEL  # an alias from `pagedserve models list`, or a checkpoint dir
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bf16 on GPU)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: from the device
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV cache
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 256  # requests running at once
    enable_chunked_prefill: bool = True  # split long prompts across steps under the budget
    max_model_len: int | None = None  # context length; None: the model's own
    enable_prefix_caching: bool = True
    scheduler: str = "fcfs"  # entry point in pagedserve.schedulers
    sampler: str = "default"  # entry point in pagedserve.samplers
    attention_backend: str = "auto"  # auto | torch | cpu (triton arrives with the kernels)
    max_n: int = 16  # largest n a request may ask for
    seed: int = 0  # seeds the sampler of requests that give no seed
    num_threads: int | None = None  # torch CPU threads; None: torch's default

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidParameterError("block_size", f"must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError("max_num_batched_tokens", "must be >= 1")
        if self.max_num_seqs < 1:
            raise InvalidParameterError("max_num_seqs", "must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidParameterError("dtype", f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "cpu"):
            raise InvalidParameterError("attention_backend", f"must be auto, torch or cpu, got {self.attention_backend!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParameterError("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise InvalidParameterError("kv_cache_memory", "must be > 0 bytes")
