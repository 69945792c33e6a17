"""`BlockPool`: the KV blocks of one worker, their ref counts, and the prefix-cache map.

A block with ref count 0 sits in the free queue, oldest-freed first. If it still holds a
full block's hash it is also in the hash map, so a later request with the same prefix can
take it back (a hit) until `allocate` evicts it from the head of the queue (LRU).

With `record_events`, every change of the hash map is also recorded as an event
(events.py) for the cluster's index; `take_events` hands them over. With
`record_evictions`, every cached block that `allocate` evicts is listed (`take_evicted`)
so that its KV can be copied to the shared tier before the next step overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedserve.prefix_cache.events import BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True)
class Block:
    """One KV block's bookkeeping (its data lives in the worker's KV cache tensors)."""

    block_id: int  # index into the KV cache tensors
    ref_count: int = 0  # requests holding this block
    block_hash: bytes | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] | None = None  # its tokens, checked on a hit
    from_tier: bool = False  # loaded from the shared KV tier and not yet hit (counted once as a tier hit)


@dataclass(slots=True, frozen=True)
class EvictedBlock:
    """A cached block that `allocate` handed out for other data: its KV is still in place
    until the next step writes there."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start (`BlockPool.stats`); the worker's metrics export the queries and hits."""

    num_queries: int = 0  # blocks looked up
    num_hits: int = 0  # blocks found (tier hits included)
    num_tier_hits: int = 0  # of those, blocks loaded from the shared KV tier for the request that hit them
    num_evictions: int = 0  # cached blocks reused for other data
    num_collisions: int = 0  # hash matched but tokens differed (counted as a miss)


@dataclass
class BlockPool:
    """Ref-counted KV blocks with an LRU queue of free blocks and a hash → block map."""

    num_blocks: int
    enable_caching: bool = True
    record_events: bool = False  # keep a list of hash-map changes for take_events()
    record_evictions: bool = False  # keep a list of evicted cached blocks for take_evicted()
    blocks: list[Block] = field(init=False)
    stats: PrefixCacheStats = field(init=False, default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        assert self.num_blocks > 0, "a block pool needs at least one block"
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Insertion order is eviction order: the head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash → block id
        self._events: list[KVEvent] = []  # hash-map changes since take_events (when recording)
        self._evicted: list[EvictedBlock] = []  # evictions since take_evicted (when recording)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def find_prefix(self, block_hashes: Sequence[bytes], block_tokens: Sequence[Sequence[int]]) -> list[Block]:
        """The longest run of cached blocks for these hashes, without taking them.

        `block_tokens[i]` are the tokens of block i; a hash hit whose stored tokens differ is
        a collision and ends the run, so a collision costs a miss, never a wrong answer.
        """
        if not self.enable_caching:
            return []
        hits: list[Block] = []
        for block_hash, tokens in zip(block_hashes, block_tokens):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(tokens):
                self.stats.num_collisions += 1
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_queried: int, hits: Sequence[Block]) -> None:
        """Count one lookup of `num_queried` blocks that found `hits`, as they are taken (kept
        apart from `find_prefix`, which may run again for a request while it waits for blocks).
        A hit block loaded from the tier counts once as a tier hit, then as the pool's own."""
        if self.enable_caching:
            self.stats.num_queries += num_queried
            self.stats.num_hits += len(hits)
            for block in hits:
                if block.from_tier:
                    self.stats.num_tier_hits += 1
                    block.from_tier = False

    def num_free_after_match(self, blocks: Iterable[Block]) -> int:
        """Free blocks left once `blocks` (a prefix match not yet taken) were taken."""
        return len(self._free) - sum(1 for b in blocks if b.ref_count == 0)

    def allocate(self, num_blocks: int) -> list[Block] | None:
        """`num_blocks` fresh blocks (ref count 1), evicting LRU cached ones; None if too few."""
        if num_blocks > len(self._free):
            return None
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.record_evictions and block.token_ids is not None:
                    self._evicted.append(EvictedBlock(block_id, block.block_hash, block.token_ids))
                self._uncache(block)
                self.stats.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference to each block; unreferenced blocks join the free queue's tail.

        Callers pass a request's blocks last-first, so the tail of a sequence (the part least
        likely to be shared) is evicted before its head.
        """
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def take(self, blocks: Iterable[Block]) -> None:
        """Add a reference to blocks another request already holds (n > 1 forks)."""
        for block in blocks:
            self._take(block)

    def cache_block(self, block: Block, block_hash: bytes, token_ids: Sequence[int],
                    parent_hash: bytes | None = None, from_tier: bool = False) -> None:
        """Record that a full, computed block holds these tokens under this hash (`parent_hash`:
        the previous block's, for the events; `from_tier`: its KV was loaded from the tier)."""
        assert block.block_hash is None, f"block {block.block_id} is already cached"
        if not self.enable_caching:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.from_tier = from_tier
        # If an identical block is already cached, keep the first: both hold the same KV.
        if self._cached.setdefault(block_hash, block.block_id) == block.block_id and self.record_events:
            self._events.append(BlockStored(block_hash, parent_hash, len(block.token_ids)))

    def take_events(self) -> list[KVEvent]:
        """The hash-map changes since the last call, in order (empty unless `record_events`)."""
        events, self._events = self._events, []
        return events

    def take_evicted(self) -> list[EvictedBlock]:
        """The cached blocks evicted since the last call (empty unless `record_evictions`)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def cached_hashes(self) -> list[bytes]:
        """Every hash a request can hit now (what a snapshot lists)."""
        return list(self._cached)

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _uncache(self, block: Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None, f"block {block.block_id} is not cached"
        if self._cached.get(block_hash) == block.block_id:
            del self._cached[block_hash]
            if self.record_events:
                self._events.append(BlockRemoved(block_hash))
        block.block_hash = None
        block.token_ids = None
        block.from_tier = False
