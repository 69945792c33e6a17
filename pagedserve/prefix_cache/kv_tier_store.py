"""`KVTierStore`: the shared KV tier, full KV blocks that every worker of a model can load.

A worker copies a cached block into the tier when its pool evicts it; a worker whose pool
misses a block loads it from the tier instead of recomputing it (engine/kv_tier.py does
both, off the step loop). The store is Redis: one key per block, named by the block's
layout and hash, so a block is only ever found by a worker whose KV cache has the same
layout, and (the hash covers the tenant's salt) by a request of the same tenant.

    pagedserve:kvtier:{layout}:{hash hex} → msgpack `TierBlock` (header + raw K/V bytes)
    pagedserve:kvtier:{layout}:lru        → sorted set: key → use counter (the LRU)
    pagedserve:kvtier:{layout}:sizes      → hash: key → bytes
    pagedserve:kvtier:{layout}:bytes      → the bytes held

The memory budget is the store's own: a put that takes the tier over it evicts the least
recently used blocks first, in the same script. Every failure is the caller's miss: a get
that fails finds nothing, a put that fails stores nothing; nothing raises past this class.
No torch here: the K/V bytes are opaque.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from redis import Redis
from redis.exceptions import RedisError

from pagedserve.common import redis_clients

logger = logging.getLogger(__name__)

_PREFIX = "pagedserve:kvtier"


class TierBlock(msgspec.Struct, array_like=True, frozen=True):
    """One full block in the tier."""

    layout: str  # KVLayout.key() of the cache it came from; checked again on load
    block_hash: bytes  # its prefix-cache hash (model id and tenant salt included)
    token_ids: tuple[int, ...]  # its tokens: a load must match them, as a local hit must
    data: bytes  # K then V of every layer, in the layout's order (engine/kv_tier.py)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a block's bytes mean. Two caches exchange blocks only if all of it is equal."""

    model_id: str
    dtype: str  # the KV cache's element type, e.g. "float32", "int8" (rows with their scale), "float8_e4m3fn"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int  # the model's; an int8 row is wider (row_width)

    def key(self) -> str:
        return (f"{self.model_id}|{self.dtype}|b{self.block_size}|l{self.num_layers}"
                f"|h{self.num_kv_heads}|d{self.head_dim}")

    @property
    def row_width(self) -> int:
        """Elements of one cache row: head_dim, + 4 in an int8 cache (the row's float32 scale
        follows its values: kernels/reference_ops.py), so a block's bytes carry its scales."""
        return self.head_dim + 4 if self.dtype == "int8" else self.head_dim

    @property
    def block_bytes(self) -> int:
        from math import prod  # noqa: PLC0415 - local: the only use

        element = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}[self.dtype]
        return 2 * element * prod((self.num_layers, self.block_size, self.num_kv_heads, self.row_width))


# KEYS: data key, lru, sizes, bytes total, use counter. ARGV: value, budget.
# A block already held is only touched. A block larger than the whole budget is refused.
_PUT = """
local size = string.len(ARGV[1])
local budget = tonumber(ARGV[2])
local tick = redis.call('INCR', KEYS[5])
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('ZADD', KEYS[2], tick, KEYS[1])
  return 0
end
if size > budget then return -1 end
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
local evicted = 0
while total + size > budget do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then break end
  local old_size = tonumber(redis.call('HGET', KEYS[3], oldest[1]) or '0')
  redis.call('DEL', oldest[1])
  redis.call('HDEL', KEYS[3], oldest[1])
  total = total - old_size
  evicted = evicted + 1
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], tick, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('SET', KEYS[4], total + size)
return 1 + evicted
"""

# KEYS: lru, use counter, then the data keys. Returns how many leading keys exist, and
# touches them (most recently used first stays the newest).
_LEADING = """
local n = 0
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then break end
  n = n + 1
end
for i = 2 + n, 3, -1 do
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[2]), KEYS[i])
end
return n
"""


@dataclass(slots=True)
class TierStats:
    """Counters since start, of this process's store client."""

    blocks_put: int = 0  # blocks written (new to the tier)
    bytes_put: int = 0
    blocks_evicted: int = 0  # blocks the tier dropped to stay under its budget, by our puts
    blocks_got: int = 0  # blocks read
    bytes_got: int = 0
    errors: int = 0  # Redis failures (each one a miss or a block not stored)


class KVTierStore:
    def __init__(self, redis: Redis, layout: KVLayout, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError("the KV tier needs a budget > 0 bytes")
        self.redis = redis
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.stats = TierStats()
        base = f"{_PREFIX}:{layout.key()}"
        self._data_prefix = f"{base}:"
        self._lru, self._sizes, self._total, self._tick = f"{base}:lru", f"{base}:sizes", f"{base}:bytes", f"{base}:tick"
        self._put = redis.register_script(_PUT)
        self._leading = redis.register_script(_LEADING)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(TierBlock)

    @classmethod
    def connect(cls, url: str, layout: KVLayout, budget_bytes: int) -> KVTierStore:
        """The store at a Redis URL (the engine knows the URL, never the Redis client)."""
        return cls(redis_clients.sync_client(url), layout, budget_bytes)

    def key(self, block_hash: bytes) -> str:
        return self._data_prefix + block_hash.hex()

    def put(self, blocks: Sequence[TierBlock]) -> int:
        """Store these blocks (those already held are only touched); returns how many were new."""
        stored = 0
        try:
            pipe = self.redis.pipeline(transaction=False)
            for block in blocks:
                assert block.layout == self.layout.key(), "a block of another layout"
                # a pipeline loads the script first where Redis lacks it
                self._put(keys=[self.key(block.block_hash), self._lru, self._sizes, self._total, self._tick],
                          args=[self._encoder.encode(block), self.budget_bytes], client=pipe)
            results = pipe.execute()
        except RedisError as exc:
            self.stats.errors += 1
            logger.warning("KV tier: %d block(s) not stored: %s", len(blocks), exc)
            return 0
        for block, result in zip(blocks, results):
            if result >= 1:
                stored += 1
                self.stats.blocks_put += 1
                self.stats.bytes_put += len(block.data)
                self.stats.blocks_evicted += result - 1
        return stored

    def get_leading(self, block_hashes: Sequence[bytes]) -> list[TierBlock]:
        """The blocks the tier holds for the leading run of these hashes (it stops at the first
        one it lacks); blocks of another layout or hash are dropped with everything after them."""
        if not block_hashes:
            return []
        keys = [self.key(h) for h in block_hashes]
        try:
            n = int(self._leading(keys=[self._lru, self._tick, *keys]))
            values = self.redis.mget(keys[:n]) if n else []
        except RedisError as exc:
            self.stats.errors += 1
            logger.warning("KV tier: lookup failed, recomputing: %s", exc)
            return []
        found = []
        for expected, value in zip(block_hashes, values):
            if value is None:  # evicted between the two calls
                break
            try:
                block = self._decoder.decode(value)  # type: ignore[arg-type]  # bytes: no decode_responses
            except msgspec.DecodeError:
                logger.warning("KV tier: an undecodable entry under %s; ignored", expected.hex())
                break
            if block.layout != self.layout.key() or block.block_hash != expected \
                    or len(block.data) != self.layout.block_bytes:
                logger.warning("KV tier: the entry under %s is not this layout's block; ignored", expected.hex())
                break
            found.append(block)
            self.stats.blocks_got += 1
            self.stats.bytes_got += len(block.data)
        return found

    def held_bytes(self) -> int:
        """Bytes the tier holds now (for this layout)."""
        try:
            return int(self.redis.get(self._total) or 0)
        except RedisError:
            return 0
