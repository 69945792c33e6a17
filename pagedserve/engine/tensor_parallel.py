"""Tensor parallelism's ranks and their wire: one worker is N ranks.

Rank 0 is the engine's `ModelRunner`: it schedules, keeps the block tables and samples. It
starts ranks 1..N-1 as shard-runner processes (`python -m pagedserve.engine.shard_runner`),
each of which loads its shard of the model and allocates its shard of the KV cache
(engine/shard_runner.py). Each step rank 0 broadcasts the step's inputs as int64 tensors
(`StepMessage`), every rank runs its shard of the forward (the row-parallel layers
all-reduce), and the logits are gathered on rank 0.

No pickle crosses any wire: a rank's start-up settings go down its stdin as msgspec JSON,
the rendezvous is torch's TCPStore, and everything else is tensors through
torch.distributed process groups built directly (no global default group, so one process
may hold several engines): gloo on CPU, NCCL for the tensors on CUDA when every rank has
its own GPU (gloo carries the step inputs there too).

A rank's stdin stays open for its whole life: when rank 0's process ends, however it ends,
the rank reads EOF and exits, so no rank is orphaned.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from pagedserve.common.contracts import ModelInput, ParallelGroup
from pagedserve.common.engine_config import EngineConfig

logger = logging.getLogger(__name__)

#: how long a rank waits for rank 0's next step: forever in practice (an idle worker sends
#: none); rank 0's death ends the wait at once (its sockets close, and the rank's stdin)
IDLE_WAIT = datetime.timedelta(days=365)


class RankFailure(RuntimeError):
    """A rank died, hung past `tensor_parallel_timeout`, or never started: the worker must
    go down as a whole (its supervisor restarts it; the queue moves its requests)."""


class ShardInit(msgspec.Struct):
    """What a shard-runner process is told on its stdin, once."""

    config: EngineConfig  # the engine's config (tensor_parallel_size = world size)
    model_dir: str  # the resolved checkpoint directory
    rank: int  # this process's rank, 1..world_size-1
    host: str  # the TCPStore of rank 0
    port: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of rank `rank` when rank 0 runs on `device`: the next GPUs in order (wrapping
    around when there are fewer GPUs than ranks: a test set-up), or the CPU."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    return torch.device("cuda", ((device.index or 0) + rank) % count)


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """A rank's share of the CPU threads: --num-threads, else the cores over the ranks."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class TorchParallelGroup(ParallelGroup):
    """A rank's process groups: `data` carries the activations (gloo, or NCCL on CUDA),
    `meta` (always gloo, on the CPU) carries the step inputs and the set-up agreements."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout: float,
                 start_timeout: float):
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
        self.backend = "nccl" if nccl else "gloo"
        #: seconds in all-reduce (`comm_seconds`) and in the LM head's gather (`gather_seconds`)
        #: since they were last reset (`bench offline --profile` reads them)
        self.comm_seconds = 0.0
        self.gather_seconds = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
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


class StepMessage:
    """A step's inputs as two int64 tensors: a header of sizes, then every array laid end to
    end. `STOP` in the header's first field ends a rank."""

    STEP, STOP = 1, 0
    HEADER = 6  # command, tokens, sequences, table width, decodes, rows to sample

    @staticmethod
    def encode(batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
        tables = np.ascontiguousarray(batch.block_tables, dtype=np.int64)
        header = torch.tensor([StepMessage.STEP, len(batch.input_ids), len(batch.query_lens), tables.shape[1],
                               batch.num_decodes, len(batch.sample_rows)], dtype=torch.int64)
        payload = np.concatenate([
            np.asarray(batch.input_ids, dtype=np.int64), np.asarray(batch.positions, dtype=np.int64),
            np.asarray(batch.slots, dtype=np.int64), np.asarray(batch.query_lens, dtype=np.int64),
            np.asarray(batch.seq_lens, dtype=np.int64), tables.reshape(-1),
            np.asarray(batch.sample_rows, dtype=np.int64),
        ])
        return header, torch.from_numpy(payload)

    @staticmethod
    def payload_size(header: torch.Tensor) -> int:
        _, tokens, seqs, width, _, rows = header.tolist()
        return 3 * tokens + 2 * seqs + seqs * width + rows

    @staticmethod
    def decode(header: torch.Tensor, payload: torch.Tensor) -> ModelInput:
        _, tokens, seqs, width, decodes, rows = header.tolist()
        flat = payload.numpy()
        parts = np.split(flat, np.cumsum([tokens, tokens, tokens, seqs, seqs, seqs * width]))
        ids, positions, slots, query_lens, seq_lens, tables, sample_rows = parts
        return ModelInput(ids.tolist(), positions, slots, query_lens.tolist(), seq_lens.tolist(),
                          tables.reshape(seqs, width).astype(np.int32), decodes, sample_rows.tolist(),
                          sample_rows.tolist())


class ShardRanks:
    """Rank 0's handle on ranks 1..N-1: starts them, sends each step, stops them."""

    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device):
        self.world_size = config.tensor_parallel_size
        self.start_timeout = config.tensor_parallel_start_timeout
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=config.tensor_parallel_start_timeout))
        env = {**os.environ, "OMP_NUM_THREADS": str(cpu_threads_per_rank(config))}
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, self.world_size):
            process = subprocess.Popen([sys.executable, "-m", "pagedserve.engine.shard_runner"],
                                       stdin=subprocess.PIPE, env=env)
            self.processes.append(process)
            init = ShardInit(config, str(model_dir), rank, "127.0.0.1", self.store.port)
            assert process.stdin is not None
            process.stdin.write(msgspec.json.encode(init) + b"\n")
            process.stdin.flush()  # left open: its EOF tells the rank that rank 0 is gone
        self.wait_for("started")
        try:
            self.group = TorchParallelGroup(self.store, 0, self.world_size, device, config.tensor_parallel_timeout,
                                            config.tensor_parallel_start_timeout)
        except BaseException:
            self.close()
            raise
        self.broadcast_seconds = 0.0  # in `send_step`, since it was last reset
        logger.info("tensor parallelism: %d ranks over %s (rank pids %s)", self.world_size, self.group.backend,
                    [p.pid for p in self.processes])

    def wait_for(self, stage: str) -> None:
        """Wait until every rank set `stage/{rank}` in the store; a rank that exits first, or
        the start timeout, raises RankFailure naming the rank."""
        deadline = time.monotonic() + self.start_timeout
        pending = {rank: f"{stage}/{rank}" for rank in range(1, self.world_size)}
        while pending:
            for rank, key in list(pending.items()):
                if self.store.check([key]):
                    del pending[rank]
                elif (code := self.processes[rank - 1].poll()) is not None:
                    self.close()
                    raise RankFailure(f"tensor-parallel rank {rank} exited with code {code} before it {stage}")
            if pending and time.monotonic() > deadline:
                self.close()
                raise RankFailure(f"tensor-parallel ranks {sorted(pending)} had not {stage} after "
                                  f"{self.start_timeout:g} s (--tensor-parallel-start-timeout)")
            if pending:
                time.sleep(0.02)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank can hold: the smallest count over the ranks."""
        self.wait_for("loaded")
        return self.group.agree_min(num_blocks, datetime.timedelta(seconds=self.start_timeout))

    def send_step(self, batch: ModelInput) -> None:
        started = time.perf_counter()
        header, payload = StepMessage.encode(batch)
        try:
            self.group.broadcast(header)
            self.group.broadcast(payload)
        except RuntimeError as exc:
            raise self.failure(exc) from exc
        self.broadcast_seconds += time.perf_counter() - started

    def failure(self, exc: BaseException) -> RankFailure:
        """What went wrong with the ranks, naming a rank that exited, for a failed collective
        (a dead rank's sockets close a moment before its exit shows: give it a second)."""
        deadline = time.monotonic() + 1.0
        while True:
            for rank, process in enumerate(self.processes, start=1):
                if (code := process.poll()) is not None:
                    return RankFailure(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}")
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return RankFailure(f"a tensor-parallel collective failed or timed out after "
                           f"{self.group.timeout.total_seconds():g} s (a rank hung?): {exc}")

    def close(self) -> None:
        """Stop every rank: a STOP message when they listen, then their stdin closes, then,
        after 3 s, a kill; none is left behind."""
        if hasattr(self, "group"):
            try:
                header = torch.zeros(StepMessage.HEADER, dtype=torch.int64)  # STOP
                self.group.broadcast(header, datetime.timedelta(seconds=1))
            except RuntimeError:
                pass  # a rank is gone already: the others read EOF below
        for process in self.processes:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
        deadline = time.monotonic() + 3
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
