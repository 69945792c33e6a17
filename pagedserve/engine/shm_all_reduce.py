"""The all-reduce of tensor-parallel ranks on one host's CPU, through shared memory.

gloo's all-reduce crosses loopback TCP: a few hundred microseconds even for one token's
hidden state, twice per layer, so it dominated a TP step on the CPU. Here the ranks map one
region (a file in /dev/shm that rank 0 creates and unlinks once every rank has mapped it)
and each round of an all-reduce is:

    wait until every rank has read this slot set's last round   (departed ≥ round − 2)
    copy my tensor into my slot                                  → mark arrived = round
    wait until every rank has arrived                            (arrived ≥ round)
    sum the slots in rank order into my tensor                   → mark departed = round

Every rank sums the same slots in the same order, so every rank gets the same bits. Rounds
alternate between two slot sets, so a fast rank writes the next round while a slow one still
reads the last. A tensor larger than a slot goes in several rounds.

The counters live in the region's header and are stored and loaded with release / acquire
order by two C++ functions (kernels/csrc/cpu_shm_sync.cpp), which wait with the GIL
released; the data moves with torch's own copy and add.

Region layout: the header (two counters per rank, a cache line each) padded to 4 KiB, then
the slots [2 sets][world_size ranks][SLOT_BYTES].
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.kernels.cpu_attention import cpu_kernels

#: bytes of one rank's slot: 256 rows of a 1024-wide float32 hidden state per round (larger
#: tensors take several rounds); the region is 2 × ranks × this, 16 MiB for 8 ranks
SLOT_BYTES = 1 << 20
HEADER_BYTES = 4096  # two 64-byte counters per rank: room for 32 ranks
ARRIVED, DEPARTED = 0, 1  # the counters (cpu_shm_sync.cpp)
#: how long one C++ wait lasts before the ranks' health is checked again
POLL_SECONDS = 0.05
#: microseconds a wait spins before it sleeps in short naps (0 where ranks outnumber cores)
SPIN_MICROSECONDS = 200.0
MAX_RANKS = HEADER_BYTES // 128


class CollectiveTimeout(RuntimeError):
    """A rank did not reach a round within the timeout: it hung or died."""


def region_bytes(world_size: int) -> int:
    return HEADER_BYTES + 2 * world_size * SLOT_BYTES


def create_region(world_size: int) -> Path:
    """A new zero-filled region file for `world_size` ranks, readable by this user only."""
    if world_size > MAX_RANKS:
        raise ValueError(f"the shared-memory all-reduce serves at most {MAX_RANKS} ranks")
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = folder / f"pagedserve-tp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, region_bytes(world_size))
    finally:
        os.close(fd)
    return path


class SharedMemoryAllReduce:
    """One rank's side of the region: `all_reduce` sums a CPU tensor over the ranks in place."""

    def __init__(self, path: Path, rank: int, world_size: int, timeout: float,
                 health_check: Callable[[], None] | None = None, spin_us: float = SPIN_MICROSECONDS):
        self.ops = cpu_kernels()
        if self.ops is None:
            raise RuntimeError("the shared-memory all-reduce needs the CPU kernels, which could not be built")
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, region_bytes(world_size))
        finally:
            os.close(fd)
        self.region = torch.frombuffer(self._map, dtype=torch.uint8)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        #: raises when a rank is known to be gone (rank 0 polls its rank processes), so a death
        #: ends the wait at once rather than at the timeout
        self.health_check = health_check
        self.spin_us = spin_us
        self.round = 0  # the last round this rank took part in
        self.slots = [[self.region[HEADER_BYTES + (s * world_size + r) * SLOT_BYTES:][:SLOT_BYTES]
                       for r in range(world_size)] for s in range(2)]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over the ranks, in rank order, written into `tensor`."""
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        per_round = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per_round):
            self._reduce_round(flat[start : start + per_round])
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def _reduce_round(self, chunk: torch.Tensor) -> None:
        self.round += 1
        slots = [slot.view(chunk.dtype)[: chunk.numel()] for slot in self.slots[self.round & 1]]
        self._wait(DEPARTED, self.round - 2)
        slots[self.rank].copy_(chunk)
        self.ops.shm_mark(self.region, self.rank, ARRIVED, self.round)
        self._wait(ARRIVED, self.round)
        chunk.copy_(slots[0])
        for slot in slots[1:]:
            chunk.add_(slot)
        self.ops.shm_mark(self.region, self.rank, DEPARTED, self.round)

    def _wait(self, counter: int, round_: int) -> None:
        if round_ <= 0:
            return
        deadline = time.monotonic() + self.timeout
        while not self.ops.shm_wait(self.region, self.world_size, counter, round_, POLL_SECONDS, self.spin_us):
            if self.health_check is not None:
                self.health_check()
            if time.monotonic() > deadline:
                behind = [r for r in range(self.world_size) if self._counter(r, counter) < round_]
                raise CollectiveTimeout(f"a shared-memory all-reduce timed out after {self.timeout:g} s waiting "
                                        f"for rank {', '.join(map(str, behind))} (round {round_})")

    def _counter(self, rank: int, counter: int) -> int:
        """A rank's counter as it reads now (for messages: no ordering needed)."""
        offset = rank * 128 + counter * 64
        return int(self.region[offset : offset + 8].view(torch.int64).item())

    def close(self) -> None:
        del self.slots, self.region
        self._map.close()
