import pytest

from pagedserve.prefix_cache import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def admit(pool, block_hashes, block_tokens):
    """What the KV cache manager does when it admits a request: look up, count, take."""
    hits = pool.find_prefix(block_hashes, block_tokens)
    pool.record_lookup(len(block_hashes), hits)
    pool.take(hits)
    return hits


def test_allocate_takes_from_the_free_queue_in_order_and_runs_out():
    pool = BlockPool(4)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert pool.allocate(2) is None  # back-pressure is a return value
    assert pool.num_free_blocks == 1


def test_exact_lru_eviction_order_of_cached_blocks():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for block, h in [(a, b"A"), (b, b"B"), (c, b"C"), (d, b"D")]:
        pool.cache_block(block, h, [block.block_id])
    pool.free([c, a])  # freed first → evicted first
    pool.free([d])
    pool.free([b])
    # a hit takes a cached block out of the free queue
    assert ids(admit(pool, [b"D"], [[3]])) == [3]
    evicted = pool.allocate(3)
    assert ids(evicted) == [2, 0, 1]
    assert all(x.block_hash is None for x in evicted)
    assert pool.stats.num_evictions == 3
    assert pool.find_prefix([b"C"], [[2]]) == []
    assert pool.allocate(1) is None


def test_ref_counts_and_shared_blocks():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h", [7])
    hits = admit(pool, [b"h"], [[7]])
    assert hits == [a] and a.ref_count == 2
    pool.free([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([a])
    assert a.ref_count == 0 and pool.num_free_blocks == 2
    # still cached while free: a new request can take it back
    assert admit(pool, [b"h"], [[7]]) == [a] and a.ref_count == 1
    assert pool.stats.num_queries == 2 and pool.stats.num_hits == 2
    with pytest.raises(AssertionError):
        pool.free([a])
        pool.free([a])


def test_a_forced_collision_becomes_a_miss():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"same-hash", [1, 2, 3])
    assert admit(pool, [b"same-hash"], [[1, 2, 4]]) == []
    assert pool.stats.num_collisions == 1 and pool.stats.num_hits == 0
    assert a.ref_count == 1


def test_match_stops_at_the_first_miss():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"1", [1])
    pool.cache_block(c, b"3", [3])
    assert ids(admit(pool, [b"1", b"2", b"3"], [[1], [2], [3]])) == [0]
    assert pool.stats.num_queries == 3 and pool.stats.num_hits == 1


def test_caching_off_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h", [1])
    assert admit(pool, [b"h"], [[1]]) == []
