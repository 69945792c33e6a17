"""The KV tier's store against a real Redis: leading-run lookups, its own LRU under a byte
budget, layouts kept apart, and failures that are misses, never errors."""

from __future__ import annotations

import msgspec
import pytest
from redis import Redis

from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.prefix_cache.kv_tier_store import KVLayout, KVTierStore, TierBlock

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=1, num_kv_heads=1, head_dim=2)  # 64-byte blocks


@pytest.fixture(scope="module")
def redis_server():
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    client = Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


def block(i: int, layout: KVLayout = LAYOUT) -> TierBlock:
    return TierBlock(layout.key(), bytes([i]) * 8, (i, i, i, i), bytes([i]) * layout.block_bytes)


def entry_bytes(b: TierBlock) -> int:
    """What one block costs the budget: its whole encoded entry, header and tokens included."""
    return len(msgspec.msgpack.encode(b))


def test_get_leading_returns_the_run_up_to_the_first_missing_block(redis_client):
    store = KVTierStore(redis_client, LAYOUT, budget_bytes=1 << 20)
    assert LAYOUT.block_bytes == 64
    assert store.put([block(1), block(2), block(4)]) == 3
    assert store.put([block(2)]) == 0  # already held: only touched
    found = store.get_leading([block(i).block_hash for i in (1, 2, 3, 4)])
    assert [b.token_ids for b in found] == [(1,) * 4, (2,) * 4]
    assert found[1].data == bytes([2]) * 64
    assert store.get_leading([block(3).block_hash, block(1).block_hash]) == []
    assert (store.stats.blocks_put, store.stats.bytes_put, store.stats.blocks_got) == (3, 192, 2)
    assert store.held_bytes() == 3 * entry_bytes(block(1)) == 3 * 107


def test_the_budget_evicts_the_least_recently_used_blocks(redis_client):
    store = KVTierStore(redis_client, LAYOUT, budget_bytes=3 * entry_bytes(block(1)))  # three blocks
    store.put([block(1), block(2), block(3)])
    assert store.get_leading([block(1).block_hash]) != []  # 1 is now the most recently used
    store.put([block(4)])  # evicts 2, the least recently used
    held = [i for i in (1, 2, 3, 4) if store.get_leading([block(i).block_hash])]
    assert held == [1, 3, 4]
    assert store.stats.blocks_evicted == 1
    assert store.held_bytes() == 3 * entry_bytes(block(1))
    too_big = TierBlock(LAYOUT.key(), b"x" * 8, (0,) * 4, b"x" * (4 * 107))
    assert store.put([too_big]) == 0  # larger than the whole budget: refused, nothing evicted
    assert [i for i in (1, 3, 4) if store.get_leading([block(i).block_hash])] == [1, 3, 4]


def test_layouts_never_see_each_others_blocks(redis_client):
    bf16 = KVLayout("tiny", "bfloat16", block_size=4, num_layers=1, num_kv_heads=1, head_dim=2)
    other_model = KVLayout("other", "float32", block_size=4, num_layers=1, num_kv_heads=1, head_dim=2)
    KVTierStore(redis_client, LAYOUT, 1 << 20).put([block(1)])
    for layout in (bf16, other_model):
        assert KVTierStore(redis_client, layout, 1 << 20).get_leading([block(1).block_hash]) == []


def test_a_corrupt_or_foreign_entry_is_ignored(redis_client):
    store = KVTierStore(redis_client, LAYOUT, 1 << 20)
    store.put([block(1), block(2)])
    redis_client.set(store.key(block(1).block_hash), b"not msgpack")
    assert store.get_leading([block(1).block_hash, block(2).block_hash]) == []
    # an entry filed under another hash, or with a short payload, is not that block
    store.put([block(3)])
    redis_client.set(store.key(block(5).block_hash), redis_client.get(store.key(block(3).block_hash)))
    assert store.get_leading([block(5).block_hash]) == []
    short = TierBlock(LAYOUT.key(), block(6).block_hash, (6,) * 4, b"\x06" * 10)
    store.put([short])
    assert store.get_leading([block(6).block_hash]) == []


def test_an_unreachable_tier_is_a_miss_not_an_error():
    store = KVTierStore(Redis(port=1, socket_connect_timeout=0.2), LAYOUT, 1 << 20)
    assert store.put([block(1)]) == 0
    assert store.get_leading([block(1).block_hash]) == []
    assert store.stats.errors == 2
