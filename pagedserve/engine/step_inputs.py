"""What a step hands the model, as tensors: the KV shape a rank holds, the input ids,
positions and attention metadata of a `ModelInput` (`step_tensors`, used by rank 0's
`ModelRunner` and by the other ranks' shard runners alike), and which scheduled entries go
in as one-token rows rather than a prefill chunk (`as_rows`); and the step token budget
resolved for the device (`with_step_budget`)."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from pagedserve.common.contracts import (
    AttentionBackend,
    AttentionMetadata,
    ModelInput,
    ScheduledRequest,
    kv_head_slice,
)
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.kv_cache_pool import KVCacheSpec
from pagedserve.engine.parallel_group import TorchParallelGroup


def kv_spec_for_rank(hf_config, kv_cache_dtype: torch.dtype, parallel: TorchParallelGroup | None) -> KVCacheSpec:
    """The KV shape this rank holds: every KV head, or under tensor parallelism its share
    (one replicated head when there are fewer KV heads than ranks)."""
    spec = KVCacheSpec.for_model(hf_config, kv_cache_dtype)
    if parallel is not None:
        spec.num_kv_heads = kv_head_slice(hf_config.num_attention_heads, spec.num_kv_heads, parallel.rank,
                                          parallel.world_size).size
    return spec


def step_tensors(batch: ModelInput, dev: torch.device, backend: AttentionBackend, block_size: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and attention metadata on the device, for an eager forward."""
    query_start = np.zeros(len(batch.query_lens) + 1, dtype=np.int32)
    np.cumsum(batch.query_lens, out=query_start[1:])
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(batch.slots).to(dev),
        query_start_loc=torch.from_numpy(query_start).to(dev),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
        block_tables=torch.from_numpy(batch.block_tables).to(dev),
        num_decodes=batch.num_decodes,
        max_seq_len=max(batch.seq_lens),
        query_lens_cpu=batch.query_lens,
        seq_lens_cpu=batch.seq_lens,
        backend=backend,
    )
    backend.prepare(metadata, block_size)
    input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=dev)
    return input_ids, torch.from_numpy(batch.positions).to(dev), metadata


#: the most uncomputed output tokens of one sequence laid out as one-token rows
MAX_ROWS_PER_SEQUENCE = 16


def as_rows(entry: ScheduledRequest) -> bool:
    """Whether an entry's tokens go in as one-token rows rather than one chunk: a decode, a
    verification of drafts, and a decoding sequence's few tokens not yet computed (those a
    grammar forced, appended in one step). Rows keep a step of decoding sequences on the
    decode fast paths (the fused CPU step, CUDA graphs); a chunk would send it down the
    prefill path."""
    n = entry.num_new_tokens
    if n == 1 or entry.spec_token_ids:
        return True
    request = entry.request
    return request.num_computed_tokens >= request.num_prompt_tokens and n <= MAX_ROWS_PER_SEQUENCE


def with_step_budget(config: EngineConfig, max_model_len: int, device_type: str) -> EngineConfig:
    """The config with its step token budget resolved for the device: without chunked
    prefill a whole prompt must fit one step."""
    budget = config.token_budget(device_type, torch.get_num_threads() if device_type == "cpu" else None)
    if not config.enable_chunked_prefill:
        if config.max_num_batched_tokens is None:
            budget = max(budget, max_model_len)
        elif max_model_len > budget:
            raise InvalidParameterError("max_num_batched_tokens",
                                        f"without chunked prefill it must be >= max_model_len ({max_model_len})")
    return msgspec.structs.replace(config, max_num_batched_tokens=budget)
