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
its own GPU (gloo carries the step inputs there too). On the CPU the activations' all-reduce
goes through shared memory instead (engine/shm_all_reduce.py, `--tensor-parallel-all-reduce`),
since gloo's loopback TCP costs more than the layer it follows.

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

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from pagedserve.common.contracts import ModelInput
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.parallel_group import TorchParallelGroup
from pagedserve.engine.shm_all_reduce import (
    CollectiveTimeout,
    SharedMemoryAllReduce,
    create_region,
    spin_microseconds,
)
from pagedserve.kernels.cpu_attention import cpu_kernels

logger = logging.getLogger(__name__)

#: how long a rank waits for rank 0's next step: forever in practice (an idle worker sends
#: none); rank 0's death ends the wait at once (its sockets close, and the rank's stdin)
IDLE_WAIT = datetime.timedelta(days=365)

#: a rank's exit code when one of its own collectives failed: it stopped because another rank
#: (or rank 0) went wrong first, so rank 0 does not name it as the cause while it looks for one
EXIT_AFTER_COLLECTIVE_FAILURE = 3


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
    shm_fd: int = -1  # the shared-memory all-reduce's region, inherited; -1: all-reduce over gloo


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
        self.failed = False  # a step failed: close() sends no STOP and waits less
        self.shm: SharedMemoryAllReduce | None = None
        fd = shm_region_for(config, device)
        try:
            for rank in range(1, self.world_size):
                process = subprocess.Popen([sys.executable, "-m", "pagedserve.engine.shard_runner"],
                                           stdin=subprocess.PIPE, env=env, pass_fds=() if fd is None else (fd,))
                self.processes.append(process)
                init = ShardInit(config, str(model_dir), rank, "127.0.0.1", self.store.port, -1 if fd is None else fd)
                assert process.stdin is not None
                process.stdin.write(msgspec.json.encode(init) + b"\n")
                process.stdin.flush()  # left open: its EOF tells the rank that rank 0 is gone
            if fd is not None:
                self.shm = SharedMemoryAllReduce(fd, 0, self.world_size, config.tensor_parallel_timeout,
                                                 self.check_alive,
                                                 spin_microseconds(cpu_threads_per_rank(config), self.world_size))
            self.wait_for("started")
            self.group = TorchParallelGroup(self.store, 0, self.world_size, device, config.tensor_parallel_timeout,
                                            config.tensor_parallel_start_timeout, self.shm)
        except BaseException:
            self.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)  # the mappings and the ranks hold their own
        self.broadcast_seconds = 0.0  # in `send_step`, since it was last reset
        logger.info("tensor parallelism: %d ranks over %s (rank pids %s)", self.world_size, self.group.backend,
                    [p.pid for p in self.processes])

    def check_alive(self, *, count_followers: bool = True) -> None:
        """Raise RankFailure naming a rank process that has exited; with `count_followers`
        false, not one that exited because its own collective failed (a consequence)."""
        for rank, process in enumerate(self.processes, start=1):
            if (code := process.poll()) is not None and (count_followers or code != EXIT_AFTER_COLLECTIVE_FAILURE):
                raise RankFailure(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}")

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
        except RuntimeError as exc:  # gloo's errors (a closed socket, a timeout)
            raise self.failure(exc) from exc
        self.broadcast_seconds += time.perf_counter() - started

    def failure(self, exc: BaseException) -> RankFailure:
        """What went wrong with the ranks after a step failed (they are out of step now),
        naming a rank that exited: a dead rank's sockets close a moment before its exit shows,
        so a gloo error gets a second for it. A rank that stopped because its own collective
        failed is not named: when rank 0's collective times out on a hung rank, gloo's error
        can reach the healthy ranks and end them within that second."""
        self.failed = True
        if isinstance(exc, RankFailure):
            return exc
        deadline = time.monotonic() + (0.0 if isinstance(exc, CollectiveTimeout) else 1.0)
        while True:
            try:
                self.check_alive(count_followers=False)
            except RankFailure as failure:
                return failure
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if isinstance(exc, RuntimeError):  # gloo's errors (plain or DistError) and the shared memory's
            return RankFailure(f"a tensor-parallel collective failed or timed out after "
                               f"{self.group.timeout.total_seconds():g} s (a rank hung?), leaving the ranks "
                               f"out of step: {exc}")
        return RankFailure(f"rank 0's part of a tensor-parallel step failed, leaving the ranks out of step: "
                           f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop every rank: a STOP message when they listen (not after a failed step), then
        their stdin closes, then, after 3 s (0.5 s after a failure), a kill; none is left
        behind. Then this rank's mapping of the shared memory goes."""
        if hasattr(self, "group") and not self.failed:
            try:
                header = torch.zeros(StepMessage.HEADER, dtype=torch.int64)  # STOP
                self.group.broadcast(header, datetime.timedelta(seconds=1))
            except RuntimeError:
                pass  # a rank is gone already: the others read EOF below
        for process in self.processes:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
        deadline = time.monotonic() + (0.5 if self.failed else 3.0)
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        if self.shm is not None:
            self.shm.close()


def shm_region_for(config: EngineConfig, device: torch.device) -> int | None:
    """A new shared-memory region (its file descriptor) for the ranks' all-reduce, or None
    where they use gloo (or NCCL): on CUDA, with `--tensor-parallel-all-reduce gloo`, or
    (auto) without the CPU kernels."""
    choice = config.tensor_parallel_all_reduce
    if device.type != "cpu" or choice == "gloo":
        return None
    if cpu_kernels() is None:
        if choice == "shm":
            raise InvalidParameterError("tensor_parallel_all_reduce", "shm needs the CPU kernels, which could not "
                                        "be built here (see the log); use gloo")
        logger.warning("tensor parallelism: the CPU kernels could not be built, so the ranks all-reduce over gloo")
        return None
    return create_region(config.tensor_parallel_size)

