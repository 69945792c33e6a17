"""The all-reduce of tensor-parallel ranks on one host's CPU, through shared memory.

gloo's all-reduce crosses loopback TCP: a few hundred microseconds even for one token's
hidden state, twice per layer, so it dominated a TP step on the CPU. Here the ranks map one
region, an anonymous memory file (memfd) that rank 0 creates and hands to each rank process
as an inherited file descriptor, so no name is left behind however a process ends. Each
round of an all-reduce is:

    copy my tensor into my slot of this round's set   → arrived = round (with the tensor's tag)
    wait until every rank has arrived                  (and wrote a tensor of the same tag)
    sum the slots in rank order into my tensor

Every rank sums the same slots in the same order, so every rank gets the same bits. Rounds
alternate between two slot sets: a rank can run at most one round ahead (it cannot pass the
next round's wait without the others), so it never writes a set that someone still reads.
A tensor larger than a slot goes in several rounds. A rank that all-reduces a tensor of
another size or dtype than the others is an error, not a wrong sum.

The header's counters and tags are stored and loaded with release / acquire order by two C++
functions (kernels/csrc/cpu_shm_sync.cpp); the wait releases the GIL. The data moves with
torch's own copy and add.

Region layout: the header (one 64-byte line per rank: its round and two tags) padded to
4 KiB, then the slots [2 sets][world_size ranks][SLOT_BYTES].
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable

import torch

from pagedserve.kernels.cpu_attention import cpu_kernels

#: bytes of one rank's slot: 256 rows of a 1024-wide float32 hidden state per round (larger
#: tensors take several rounds); the region is 2 × ranks × this, 16 MiB for 8 ranks
SLOT_BYTES = 1 << 20
HEADER_BYTES = 4096
LINE_BYTES = 64  # one rank's line in the header (cpu_shm_sync.cpp)
MAX_RANKS = HEADER_BYTES // LINE_BYTES
#: how long one C++ wait lasts before the ranks' health is checked again
POLL_SECONDS = 0.05
#: microseconds a wait spins before it sleeps in short naps (0 where ranks outnumber cores)
SPIN_MICROSECONDS = 200.0
#: the dtypes a tensor's tag tells apart (its element count is the rest of the tag)
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4, torch.int64: 5,
               torch.int32: 6}


class CollectiveTimeout(RuntimeError):
    """A rank did not reach a round within the timeout: it hung or died."""


class CollectiveMismatch(RuntimeError):
    """The ranks all-reduced tensors of different sizes or dtypes in one round."""


def region_bytes(world_size: int) -> int:
    return HEADER_BYTES + 2 * world_size * SLOT_BYTES


def create_region(world_size: int) -> int:
    """A file descriptor of a new zero-filled region for `world_size` ranks, with no name: a
    memfd, else a temporary file unlinked at once. Pass it to rank processes (`pass_fds`)."""
    if world_size > MAX_RANKS:
        raise ValueError(f"the shared-memory all-reduce serves at most {MAX_RANKS} ranks")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("pagedserve-tp", os.MFD_CLOEXEC)
    else:  # not Linux
        fd, path = tempfile.mkstemp(prefix="pagedserve-tp-")
        os.unlink(path)
    os.ftruncate(fd, region_bytes(world_size))
    return fd


def spin_microseconds(threads_per_rank: int, world_size: int) -> float:
    """How long a wait spins: not at all where the ranks' threads outnumber the cores (a
    spinning rank would take the core of the rank it waits for)."""
    return SPIN_MICROSECONDS if threads_per_rank * world_size <= (os.cpu_count() or 1) else 0.0


class SharedMemoryAllReduce:
    """One rank's side of the region: `all_reduce` sums a CPU tensor over the ranks in place."""

    def __init__(self, fd: int, rank: int, world_size: int, timeout: float,
                 health_check: Callable[[], None] | None = None, spin_us: float = SPIN_MICROSECONDS):
        ops = cpu_kernels()
        if ops is None:
            raise RuntimeError("the shared-memory all-reduce needs the CPU kernels, which could not be built")
        self.ops = ops  # the compiled extension: shm_arrive, shm_wait
        self._map = mmap.mmap(fd, region_bytes(world_size))  # its own copy of the descriptor
        self.region = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole mapping, as the C++ sees it
        self.rank = rank  # this rank, 0..world_size-1
        self.world_size = world_size
        self.timeout = timeout  # seconds a round waits for the other ranks
        #: raises when a rank is known to be gone (rank 0 polls its rank processes), so a death
        #: ends the wait at once rather than at the timeout
        self.health_check = health_check
        self.spin_us = spin_us  # microseconds a wait spins before it naps
        self.round = 0  # the last round this rank took part in
        #: the slots, [set][rank], as uint8 views of the region
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
        if chunk.dtype not in DTYPE_CODES:
            raise TypeError(f"the shared-memory all-reduce does not take {chunk.dtype}")
        self.round += 1
        tag = chunk.numel() << 8 | DTYPE_CODES[chunk.dtype]
        slots = [slot.view(chunk.dtype)[: chunk.numel()] for slot in self.slots[self.round & 1]]
        slots[self.rank].copy_(chunk)
        self.ops.shm_arrive(self.region, self.rank, self.round, tag)
        self._wait(tag)
        chunk.copy_(slots[0])
        for slot in slots[1:]:
            chunk.add_(slot)

    def _wait(self, tag: int) -> None:
        deadline = time.monotonic() + self.timeout
        while (done := self.ops.shm_wait(self.region, self.world_size, self.round, tag, POLL_SECONDS,
                                         self.spin_us)) == 0:
            if self.health_check is not None:
                self.health_check()
            if time.monotonic() > deadline:
                header = self.region[:HEADER_BYTES].view(torch.int64)
                behind = [r for r in range(self.world_size) if int(header[r * LINE_BYTES // 8]) < self.round]
                raise CollectiveTimeout(f"a shared-memory all-reduce timed out after {self.timeout:g} s waiting "
                                        f"for rank {', '.join(map(str, behind))} (round {self.round})")
        if done < 0:
            raise CollectiveMismatch(f"rank {-1 - done} all-reduced a tensor of another size or dtype than rank "
                                     f"{self.rank} ({tag >> 8} elements, dtype code {tag & 255}) in round "
                                     f"{self.round}: the ranks' forwards differ")

    def close(self) -> None:
        """Unmap the region (only once no all-reduce runs: a later one would read freed memory)."""
        if self._map.closed:
            return
        del self.slots, self.region
        self._map.close()
