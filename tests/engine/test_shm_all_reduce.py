"""The shared-memory all-reduce of CPU tensor-parallel ranks (engine/shm_all_reduce.py).

Ranks here are threads of one process, each with its own mapping of the region (the C++
waits release the GIL), so the rounds, the double-buffered slots and the timeouts are
exercised without starting processes; tests/engine/test_tensor_parallel.py runs it between
real rank processes."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from pagedserve.engine import shm_all_reduce
from pagedserve.engine.shm_all_reduce import (
    CollectiveMismatch,
    CollectiveTimeout,
    SharedMemoryAllReduce,
    create_region,
    region_bytes,
)


@pytest.fixture
def region():
    fds = []

    def make(world_size: int) -> int:
        fds.append(create_region(world_size))
        return fds[-1]

    yield make
    for fd in fds:
        os.close(fd)


def _run_ranks(fd: int, world_size: int, inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each rank all-reduces its tensors in order (in place); the results per rank."""
    results: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            shm = SharedMemoryAllReduce(fd, rank, world_size, timeout=10.0, spin_us=0.0)
            for tensor in inputs[rank]:
                results[rank].append(shm.all_reduce(tensor))
            shm.close()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_rank_gets_the_rank_ordered_sum_bit_for_bit_over_many_rounds(region, dtype):
    world_size = 3
    fd = region(world_size)
    generator = torch.Generator().manual_seed(0)
    # odd shapes, a non-contiguous view, and one tensor larger than a slot (several rounds)
    larger_than_a_slot = shm_all_reduce.SLOT_BYTES // 4 + 1001  # float32: two rounds (bf16 one, int64 three)
    shapes = [(1, 577), (5, 3, 7), (1,), (larger_than_a_slot,), (64, 576), (0, 576)]  # and an empty one
    originals = [[(torch.randn(shape, generator=generator) * 1000).to(dtype) for shape in shapes]
                 for _ in range(world_size)]
    for rank in range(world_size):  # a column slice: not contiguous
        originals[rank].append((torch.randn(6, 10, generator=generator) * 1000).to(dtype)[:, 2:7])
    inputs = [[t.clone() for t in per_rank] for per_rank in originals]
    results = _run_ranks(fd, world_size, inputs)
    for i in range(len(originals[0])):
        expected = originals[0][i].clone()
        for rank in range(1, world_size):
            expected.add_(originals[rank][i])
        for rank in range(world_size):
            got = results[rank][i]
            assert got.shape == expected.shape and got.dtype == dtype
            assert torch.equal(got, expected), (i, rank)
            assert got is inputs[rank][i]  # in place, as the contract says
    assert results[0][3].numel() == larger_than_a_slot


def test_the_region_has_no_name_to_leak_and_is_sized_for_its_ranks(region):
    fd = region(4)
    assert os.fstat(fd).st_size == region_bytes(4) == 4096 + 2 * 4 * shm_all_reduce.SLOT_BYTES
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pagedserve-tp")  # anonymous: gone with its holders


def test_ranks_that_reduce_different_tensors_get_an_error_not_a_wrong_sum(region):
    fd = region(2)
    errors: list[str] = []

    def rank_main(rank: int, tensor: torch.Tensor) -> None:
        shm = SharedMemoryAllReduce(fd, rank, 2, timeout=5.0, spin_us=0.0)
        try:
            shm.all_reduce(tensor)
        except CollectiveMismatch as exc:
            errors.append(str(exc))
        shm.close()

    threads = [threading.Thread(target=rank_main, args=(0, torch.ones(4))),
               threading.Thread(target=rank_main, args=(1, torch.ones(5)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(errors) == [
        "rank 0 all-reduced a tensor of another size or dtype than rank 1 (5 elements, dtype code 1) in round 1: "
        "the ranks' forwards differ",
        "rank 1 all-reduced a tensor of another size or dtype than rank 0 (4 elements, dtype code 1) in round 1: "
        "the ranks' forwards differ"]


def test_a_rank_that_never_arrives_times_out_naming_the_wait(region):
    fd = region(2)
    alone = SharedMemoryAllReduce(fd, 0, 2, timeout=0.3)
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"timed out after 0.3 s waiting for rank 1 \(round 1\)$"):
        alone.all_reduce(torch.ones(4))
    assert 0.3 <= time.monotonic() - started < 2.0
    alone.close()


def test_the_health_check_ends_a_wait_before_the_timeout(region):
    fd = region(2)
    calls = []

    def dead_peer() -> None:
        calls.append(time.monotonic())
        raise RuntimeError("rank 1 exited with code -9")

    shm = SharedMemoryAllReduce(fd, 0, 2, timeout=30.0, health_check=dead_peer)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        shm.all_reduce(torch.ones(4))
    assert len(calls) == 1 and calls[0] - started < 1.0
    shm.close()
