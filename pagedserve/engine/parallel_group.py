"""One rank's process groups, as the model's layers see them (`ParallelGroup`).

`data` carries the activations: gloo, or NCCL on CUDA when every rank has its own GPU; on
the CPU the sums go through shared memory instead where there is a region
(engine/shm_all_reduce.py). `meta`, always gloo on the CPU, carries the step inputs and the
set-up agreements. The groups are built directly, not as torch's global default group, so
one process may hold several engines.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.common.contracts import ParallelGroup
from pagedserve.engine.shm_all_reduce import SharedMemoryAllReduce


class TorchParallelGroup(ParallelGroup):
    """A rank's process groups: `data` carries the activations (gloo, or NCCL on CUDA),
    `meta` (always gloo, on the CPU) carries the step inputs and the set-up agreements."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout: float,
                 start_timeout: float, shm: SharedMemoryAllReduce | None = None):
        self.rank = rank
        self.world_size = world_size
        #: how long each collective of a step waits (the groups' own timeout, `start_timeout`,
        #: bounds only their rendezvous)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.meta = _gloo_group(dist.PrefixStore("meta/", store), rank, world_size,
                                datetime.timedelta(seconds=start_timeout))
        nccl = device.type == "cuda" and torch.cuda.device_count() >= world_size
        if nccl:  # every rank on its own GPU (not measured here: the CI has no GPUs)
            self.data: Any = dist.ProcessGroupNCCL(dist.PrefixStore("data/", store), rank, world_size,
                                                  dist.ProcessGroupNCCL.Options())
        else:
            self.data = self.meta
        #: CPU activations' sums through shared memory (None: through `data`)
        self.shm = None if nccl else shm
        self.backend = "nccl" if nccl else "shared memory" if self.shm is not None else "gloo"
        #: seconds in all-reduce (`comm_seconds`) and in the LM head's gather (`gather_seconds`)
        #: since they were last reset (`bench offline --profile` reads them)
        self.comm_seconds = 0.0
        self.gather_seconds = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and tensor.device.type == "cpu":
            started = time.perf_counter()
            self.shm.all_reduce(tensor)
            self.comm_seconds += time.perf_counter() - started
            return tensor
        return self._all_reduce(self.data, tensor, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(self.data, tensor, dist.ReduceOp.MAX)

    def agree_min(self, value: int, timeout: datetime.timedelta) -> int:
        """The smallest `value` over the ranks (the KV blocks that fit every rank)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # torch's stubs type the member as RedOpType
        opts.timeout = timeout
        self.meta.allreduce([tensor], opts).wait()
        return int(tensor.item())

    def _all_reduce(self, group: Any, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        started = time.perf_counter()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = self.timeout
        group.allreduce([tensor], opts).wait()
        self.comm_seconds += time.perf_counter() - started
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        tensor = tensor.contiguous()
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self.data.gather(outputs, [tensor], opts).wait()
        self.gather_seconds += time.perf_counter() - started
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else tensor

    def broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> torch.Tensor:
        """Rank 0's `tensor` on every rank (the others pass a buffer of the same shape)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timeout or self.timeout
        self.meta.broadcast([tensor], opts).wait()
        return tensor


def _gloo_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack it
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # ranks share one host
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, options)
