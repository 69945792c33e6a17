"""A shard runner: ranks 1..N-1 of a tensor-parallel worker, one process each.

    python -m pagedserve.engine.shard_runner      # started by rank 0 (engine/tensor_parallel.py)

It reads its `ShardInit` from stdin, joins the ranks' groups, loads its shard of the model
and of the KV cache, agrees on the KV pool's size, then runs every step rank 0 sends:

    receive the step's inputs → forward (all-reduce after each row-parallel layer)
      → the LM head's shard of the rows to sample, gathered on rank 0

It schedules nothing and samples nothing. It exits on rank 0's STOP, on EOF of its stdin
(rank 0's process is gone), or when a collective fails.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from transformers import AutoConfig

from pagedserve.common.contracts import CausalLMPlugin, ModelInput
from pagedserve.engine.device import resolve_device, resolve_dtype
from pagedserve.engine.kv_cache_pool import KVCachePool, resolve_kv_cache_dtype
from pagedserve.engine.model_loader import load_model
from pagedserve.engine.parallel_group import TorchParallelGroup
from pagedserve.engine.shm_all_reduce import SharedMemoryAllReduce, spin_microseconds
from pagedserve.engine.step_inputs import kv_spec_for_rank, step_tensors
from pagedserve.engine.tensor_parallel import (
    EXIT_AFTER_COLLECTIVE_FAILURE,
    IDLE_WAIT,
    ShardInit,
    StepMessage,
    cpu_threads_per_rank,
    rank_device,
)
from pagedserve.kernels.selector import select_kernels

logger = logging.getLogger("pagedserve.engine.shard_runner")


class ShardRunner:
    """One rank's shard of the model and of the KV cache, and its step loop."""

    def __init__(self, init: ShardInit, store: dist.Store, group: TorchParallelGroup, device: torch.device):
        config = init.config
        model_dir = Path(init.model_dir)
        hf_config = AutoConfig.from_pretrained(model_dir)
        self.device = device
        self.group = group
        dtype = resolve_dtype(config.dtype, hf_config, self.device)
        kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, self.device)
        kernels = select_kernels(config.attention_backend, self.device)
        if kv_cache_dtype != dtype and not kernels.attention.quantized_kv:
            kernels = select_kernels("torch", self.device)  # as rank 0 does
        self.backend = kernels.attention
        self.block_size = config.block_size
        self.model = load_model(model_dir, hf_config, dtype, self.device, kernels, config.load_format,
                                config.quantization, config.quantize_lm_head, self.group,
                                config.int8_kernel, pack_cpu_weights=config.pack_cpu_weights)
        spec = kv_spec_for_rank(hf_config, kv_cache_dtype, self.group)
        num_blocks = KVCachePool.num_blocks_for(spec, config.block_size, self.device, config.kv_cache_memory,
                                                config.gpu_memory_utilization)
        store.set(f"loaded/{init.rank}", "1")
        num_blocks = self.group.agree_min(num_blocks, datetime.timedelta(seconds=config.tensor_parallel_start_timeout))
        self.kv_caches = KVCachePool(spec, config.block_size, num_blocks, self.device).kv_caches

    @torch.inference_mode()
    def serve(self) -> None:
        """Run rank 0's steps until it sends STOP."""
        header = torch.zeros(StepMessage.HEADER, dtype=torch.int64)
        while True:
            self.group.broadcast(header, IDLE_WAIT)
            if header[0].item() == StepMessage.STOP:
                return
            payload = torch.empty(StepMessage.payload_size(header), dtype=torch.int64)
            self.group.broadcast(payload)
            self.step(StepMessage.decode(header, payload))

    def step(self, batch: ModelInput) -> None:
        """This rank's part of rank 0's `ModelRunner.run`: the forward, then the LM head of
        the rows rank 0 samples (its `compute_logits`)."""
        input_ids, positions, metadata = step_tensors(batch, self.device, self.backend, self.block_size)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        if batch.sample_rows:
            rows = batch.sample_rows
            selected = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
            cast_model: CausalLMPlugin = self.model  # type: ignore[assignment]  # a plugin is both
            cast_model.compute_logits(selected)


def _exit_when_stdin_closes() -> None:
    """Rank 0 holds this rank's stdin open while it lives: EOF means it is gone."""
    sys.stdin.buffer.read()
    os._exit(0)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A signal to the worker's process group (Ctrl-C, a drain's SIGTERM) is rank 0's to act
    # on: it keeps stepping while it drains, and stops this rank when it is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    init = msgspec.json.decode(sys.stdin.buffer.readline(), type=ShardInit)
    threading.Thread(target=_exit_when_stdin_closes, name="rank0-watch", daemon=True).start()
    config = init.config
    if resolve_device(config.device).type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(config))
    # Rank 0 judges a hung rank and names it: this rank's collectives wait longer, so that a
    # rank that waits on the hung one does not exit first and get the blame; the longer wait
    # only guards against a rank 0 hung without exiting
    timeout = 2 * config.tensor_parallel_timeout + 5
    shm = None
    if init.shm_fd >= 0:  # the shared memory's region, inherited from rank 0
        shm = SharedMemoryAllReduce(init.shm_fd, init.rank, config.tensor_parallel_size, timeout,
                                    spin_us=spin_microseconds(cpu_threads_per_rank(config), config.tensor_parallel_size))
        os.close(init.shm_fd)  # the mapping holds its own
    store = dist.TCPStore(init.host, init.port, config.tensor_parallel_size, is_master=False,
                          timeout=datetime.timedelta(seconds=config.tensor_parallel_start_timeout))
    store.set(f"started/{init.rank}", "1")
    device = rank_device(resolve_device(config.device), init.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:  # the groups first: rank 0 joins them as soon as every rank has started
        group = TorchParallelGroup(store, init.rank, config.tensor_parallel_size, device, timeout,
                                   config.tensor_parallel_start_timeout, shm)
        ShardRunner(init, store, group, device).serve()
    except RuntimeError as exc:  # a collective failed (gloo's errors are plain RuntimeErrors): rank 0 is
        # gone or gave up, or a rank hung; nothing left to serve
        logger.error("tensor-parallel rank %d stops: %s", init.rank, exc)
        os._exit(EXIT_AFTER_COLLECTIVE_FAILURE)
    os._exit(0)


if __name__ == "__main__":
    main()
