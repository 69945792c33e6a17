"""Decode-only steps replayed from CUDA graphs.

A decode step launches about a dozen kernels per layer for a few rows each; at small batch a
GPU spends more time waiting for Python and the launch queue than computing. `DecodeGraphs`
captures the model's forward once per batch-size bucket into a CUDA graph that reads static
input buffers. A decode-only step copies its inputs into those buffers, pads the batch up to
the next bucket and replays the graph. Padding rows have context 0 and slot -1: the KV store
skips them and attention writes zeros for them, and the runner reads only the real rows.
The LM head and the sampler run eagerly after the replay, on the real rows.

Only the Triton backend qualifies: once its plan is fixed (`decode_plan`: a split count for
the longest context the model allows, a minimum number of blocks per split) its launches
depend on tensor contents, never on host values of the step.

`cuda_graphs=False` keeps everything but the capture: every step runs the same function
over the same padded static buffers eagerly. Tests use it on CPU, where there are no CUDA
graphs, to check the bucketing and padding; the capture itself needs a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.common.contracts import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes a graph is captured for: 1, 2, 4, 8, then every multiple of 16, and
    `max_batch` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes) | {max_batch})


class GraphCaptureError(RuntimeError):
    """Capturing a CUDA graph failed; the runner goes on without graphs."""


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: replay by running `forward` again
    forward: Callable[[], torch.Tensor]  # () -> hidden [bucket, hidden_size]
    output: torch.Tensor | None  # the captured graph's output buffer


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend, block_size: int, max_batch: int,
                 max_model_len: int, device: torch.device, cuda_graphs: bool = True):
        if not hasattr(backend, "decode_plan"):
            raise ValueError(f"the {backend.name!r} attention backend cannot run from CUDA graphs")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        b, max_blocks = self.max_batch, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Graph] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None  # shared by every bucket's graph
        #: replays per bucket (how often each size ran)
        self.replays: dict[int, int] = dict.fromkeys(self.buckets, 0)

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, input_ids: list[int], positions: np.ndarray, slots: np.ndarray, seq_lens: list[int],
            block_tables: np.ndarray) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of one decode-only step (num_seqs <= max_batch)."""
        n = len(input_ids)
        bucket = self.bucket_for(n)
        pad = bucket - n
        # padded on the host, then one copy per buffer
        self.input_ids[:bucket].copy_(torch.tensor(input_ids + [0] * pad, dtype=torch.long), non_blocking=True)
        self.positions[:bucket].copy_(torch.from_numpy(np.pad(positions.astype(np.int64), (0, pad))), non_blocking=True)
        self.slot_mapping[:bucket].copy_(torch.from_numpy(np.pad(slots.astype(np.int64), (0, pad), constant_values=-1)),
                                         non_blocking=True)
        self.seq_lens[:bucket].copy_(torch.tensor(seq_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        # rows past n and columns past each row's blocks are never read (context 0 / beyond seq_len)
        self.block_tables[:n, : block_tables.shape[1]].copy_(torch.from_numpy(block_tables), non_blocking=True)
        graph = self._graphs.get(bucket) or self._capture(bucket)
        self.replays[bucket] += 1
        if graph.graph is None:
            return graph.forward()[:n]
        graph.graph.replay()
        assert graph.output is not None  # set with the captured graph
        return graph.output[:n]

    def _capture(self, bucket: int) -> _Graph:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket], num_decodes=bucket,
            max_seq_len=self.max_model_len, query_lens_cpu=[1] * bucket, seq_lens_cpu=[], backend=self.backend,
            backend_state=self.backend.decode_plan(bucket, self.max_model_len, self.block_size, self.device),
        )

        def forward() -> torch.Tensor:
            return self.model(self.input_ids[:bucket], self.positions[:bucket], metadata, self.kv_caches)

        if not self.cuda_graphs:
            graph = _Graph(None, forward, None)
        else:
            try:
                graph = self._capture_cuda(forward, bucket)
            except Exception as exc:
                raise GraphCaptureError(f"{type(exc).__name__}: {exc}") from exc
        self._graphs[bucket] = graph
        return graph

    def _capture_cuda(self, forward: Callable[[], torch.Tensor], bucket: int) -> _Graph:
        # The buffers hold this step's inputs: the warm-up run stores this step's K/V, which
        # the replay then stores again, the same values (capturing itself runs nothing).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()  # compiles the Triton kernels and warms up cuBLAS outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        self._pool = graph.pool()  # every bucket's graph shares one memory pool; they never run at once
        logger.info("captured a CUDA graph for decode batches of %d", bucket)
        return _Graph(graph, forward, output)
