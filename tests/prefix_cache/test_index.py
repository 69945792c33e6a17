"""The cluster index against the workers' real block pools: events, gaps, restarts, deaths."""

from __future__ import annotations

import random
import uuid

import pytest

from pagedserve.prefix_cache import BlockPool
from pagedserve.prefix_cache.block_hash import prompt_block_hashes
from pagedserve.prefix_cache.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    MalformedBatch,
    decode_batch,
    encode_batch,
)
from pagedserve.prefix_cache.index import Applied, PrefixIndex


class FakeWorker:
    """A worker's pool and what its publisher would send: one batch per step, over the wire."""

    def __init__(self, worker_id: str, num_blocks: int = 12):
        self.worker_id = worker_id
        self.pool = BlockPool(num_blocks, record_events=True)
        self.epoch = uuid.uuid4().hex
        self.seq = -1
        self.held: list = []  # blocks a "request" holds

    def batch(self, snapshot: bool = False) -> bytes:
        self.seq += 1
        if snapshot:
            self.pool.take_events()  # the snapshot covers them
            events = [BlockStored(h, None, 16) for h in self.pool.cached_hashes()]
        else:
            events = self.pool.take_events()
        return encode_batch(KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, seq=self.seq, sent_at=0.0,
                                         events=events, snapshot=snapshot))

    def hashes(self) -> set[bytes]:
        return set(self.pool.cached_hashes())


def union(workers) -> dict[bytes, set[str]]:
    out: dict[bytes, set[str]] = {}
    for w in workers:
        for h in w.hashes():
            out.setdefault(h, set()).add(w.worker_id)
    return out


def index_map(index: PrefixIndex) -> dict[bytes, set[str]]:
    return {h: set(ws) for h, ws in index._holders.items()}


def test_the_index_is_the_union_of_the_pools_through_stores_evictions_restarts_and_deaths():
    rng = random.Random(7)
    index = PrefixIndex()
    workers = {f"w{i}": FakeWorker(f"w{i}") for i in range(3)}
    dropped = needed_snapshot = checked = 0
    for _ in range(400):
        w = rng.choice(list(workers.values()))
        action = rng.random()
        if action < 0.45:  # a request fills blocks and caches them (shared hashes across workers)
            blocks = w.pool.allocate(rng.randint(1, 3))
            if blocks:
                for block in blocks:
                    w.pool.cache_block(block, bytes([rng.randrange(40)]) * 32, [block.block_id])
                w.held.append(blocks)
        elif action < 0.8 and w.held:  # a request ends: its blocks stay cached until evicted
            w.pool.free(w.held.pop(rng.randrange(len(w.held))))
        elif action < 0.88:  # the worker restarts: a new, empty pool and a new epoch
            workers[w.worker_id] = FakeWorker(w.worker_id)
            assert index.apply(decode_batch(workers[w.worker_id].batch())) is Applied.APPLIED
            continue
        elif action < 0.92:  # the worker dies; another takes its name later
            index.remove_worker(w.worker_id)
            workers[w.worker_id] = FakeWorker(w.worker_id)
            continue
        lost = False
        for each in workers.values():  # every worker publishes what its step changed
            data = each.batch()
            if rng.random() < 0.08:  # lost on the way: the next batch shows the gap
                dropped += 1
                lost = True
                continue
            if index.apply(decode_batch(data)) is Applied.NEEDS_SNAPSHOT:
                needed_snapshot += 1
                assert each.worker_id in index.needs_snapshot()
                assert index.apply(decode_batch(each.batch(snapshot=True))) is Applied.APPLIED
        # whenever every batch of the step arrived, the index is exactly the pools' hash maps
        if not lost:
            assert index_map(index) == union(workers.values())
            checked += 1
    assert dropped > 5 and needed_snapshot > 3 and index.stats.workers_removed > 3 and checked > 100
    # the end: every worker sends what it has; nothing is missing or stale
    for w in workers.values():
        if index.apply(decode_batch(w.batch())) is Applied.NEEDS_SNAPSHOT:
            index.apply(decode_batch(w.batch(snapshot=True)))
    assert index_map(index) == union(workers.values())
    assert index.num_blocks == len(union(workers.values()))


def test_a_gap_drops_the_worker_until_its_snapshot():
    index = PrefixIndex()
    w = FakeWorker("w")
    (a,) = w.pool.allocate(1)
    w.pool.cache_block(a, b"A" * 32, [1])
    assert index.apply(decode_batch(w.batch())) is Applied.APPLIED
    (b,) = w.pool.allocate(1)
    w.pool.cache_block(b, b"B" * 32, [2])
    w.batch()  # lost
    (c,) = w.pool.allocate(1)
    w.pool.cache_block(c, b"C" * 32, [3])
    assert index.apply(decode_batch(w.batch())) is Applied.NEEDS_SNAPSHOT
    assert index.lookup([b"A" * 32]) == {}  # what it knew is not trusted any more
    assert index.apply(decode_batch(w.batch())) is Applied.IGNORED  # still waiting
    assert index.apply(decode_batch(w.batch(snapshot=True))) is Applied.APPLIED
    assert index_map(index) == {b"A" * 32: {"w"}, b"B" * 32: {"w"}, b"C" * 32: {"w"}}
    assert index.stats.gaps == 1 and index.stats.snapshots == 1


def test_old_and_repeated_batches_are_ignored():
    index = PrefixIndex()
    w = FakeWorker("w")
    first = w.batch()
    second = w.batch()
    assert index.apply(decode_batch(first)) is Applied.APPLIED
    assert index.apply(decode_batch(second)) is Applied.APPLIED
    assert index.apply(decode_batch(first)) is Applied.IGNORED
    assert index.apply(decode_batch(second)) is Applied.IGNORED
    assert index.stats.batches_ignored == 2


def test_a_worker_first_heard_of_midway_needs_a_snapshot():
    """A consumer that starts after the worker (seq > 0) knows nothing of what came before."""
    index = PrefixIndex()
    w = FakeWorker("w")
    (a,) = w.pool.allocate(1)
    w.pool.cache_block(a, b"A" * 32, [1])
    w.batch()  # sent before the consumer started
    assert index.apply(decode_batch(w.batch())) is Applied.NEEDS_SNAPSHOT
    assert index.apply(decode_batch(w.batch(snapshot=True))) is Applied.APPLIED
    assert index.lookup([b"A" * 32]) == {"w": 1}


def test_lookup_counts_leading_blocks_per_worker():
    index = PrefixIndex()
    chain = prompt_block_hashes(list(range(64)), 16, "m")  # 4 blocks
    batches = {"a": chain[:4], "b": chain[:2], "c": chain[1:4]}  # c lacks the first block
    for worker, hashes in batches.items():
        index.apply(KVEventBatch(worker_id=worker, epoch="e", seq=0, sent_at=0.0,
                                 events=[BlockStored(h, None, 16) for h in hashes]))
    assert index.lookup(chain) == {"a": 4, "b": 2}
    assert index.lookup(chain[:1]) == {"a": 1, "b": 1}
    index.apply(KVEventBatch(worker_id="a", epoch="e", seq=1, sent_at=0.0, events=[BlockRemoved(chain[2])]))
    assert index.lookup(chain) == {"a": 2, "b": 2}
    assert index.lookup([]) == {}


def test_tenants_never_see_each_others_blocks():
    """The tenant salt is in every hash: one tenant's prompt finds nothing another cached."""
    index = PrefixIndex()
    tokens = list(range(100, 164))
    mine = prompt_block_hashes(tokens, 16, "m", "tenant-a")
    index.apply(KVEventBatch(worker_id="w", epoch="e", seq=0, sent_at=0.0,
                             events=[BlockStored(h, None, 16) for h in mine]))
    assert index.lookup(mine) == {"w": 4}
    assert index.lookup(prompt_block_hashes(tokens, 16, "m", "tenant-b")) == {}
    assert index.lookup(prompt_block_hashes(tokens, 16, "m", None)) == {}


@pytest.mark.parametrize("data", [b"", b"\xc1", encode_batch(KVEventBatch(worker_id="", epoch="e", seq=0, sent_at=0)),
                                  encode_batch(KVEventBatch(worker_id="w", epoch="e", seq=-1, sent_at=0)),
                                  encode_batch(KVEventBatch(worker_id="w", epoch="e", seq=0, sent_at=0,
                                                            events=[BlockStored(b"x", None, 0)])),
                                  b"\x84\xa9worker_id\xa1w\xa5epoch\xa1e\xa3seq\x00\xa7sent_at\x00\xa6events\x91\x92\xa4gone\xc4\x01x"])
def test_malformed_batches_are_refused(data):
    with pytest.raises(MalformedBatch):
        decode_batch(data)


def test_a_pool_records_only_changes_of_its_hash_map():
    pool = BlockPool(3, record_events=True)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"H", [1], parent_hash=None)
    pool.cache_block(b, b"H", [1])  # the same hash again: the map keeps a, nothing changes
    pool.cache_block(c, b"I", [2], parent_hash=b"H")
    assert pool.take_events() == [BlockStored(b"H", None, 1), BlockStored(b"I", b"H", 1)]
    pool.free([b, c, a])
    pool.allocate(2)  # evicts b (not in the map: no event), then c
    assert pool.take_events() == [BlockRemoved(b"I")]
    assert pool.cached_hashes() == [b"H"]
    assert BlockPool(2).take_events() == []  # not recording
