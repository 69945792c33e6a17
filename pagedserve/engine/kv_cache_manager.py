"""`KVCacheManager`: gives sequences KV blocks from the `BlockPool`, reusing cached prefixes.

It keeps each sequence's block table and block hashes itself, by request id, and reads a
`Request`'s tokens and progress without ever writing to it: what a sequence has computed
is the scheduler's to say.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.common.contracts import PrefixHit, Request, RequestStatus
from pagedserve.prefix_cache import Block, BlockPool
from pagedserve.prefix_cache.block_hash import extra_keys_for, hash_block

_NO_HIT = PrefixHit(0, 0)


class KVCacheManager:
    """Block tables of sequences: prefix lookups, allocation, caching of full blocks, freeing.

    Implements the `KVCacheManager` contract that scheduler plugins are given.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, model_id: str, kv_dtype: str = ""):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.model_id = model_id
        self.kv_dtype = kv_dtype  # a quantized cache's dtype, in every hash ("": the model's dtype, none)
        self._blocks: dict[str, list[Block]] = {}  # request id → blocks, in position order
        self._block_ids: dict[str, list[int]] = {}  # the same as ids, for the model runner
        self._hashes: dict[str, list[bytes]] = {}  # request id → hashes of its full blocks so far
        self._extra_by_salt: dict[str | None, bytes] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request: Request) -> list[int]:
        return self._block_ids.get(request.request_id, [])

    def block_hashes(self, request: Request) -> list[bytes]:
        return self._hashes.get(request.request_id, [])

    def blocks(self, request: Request) -> list[Block]:
        return self._blocks.get(request.request_id, [])

    def extra_keys(self, cache_salt: str | None) -> bytes:
        """The encoded extra keys of every block hash: the model id, the tenant's salt and a
        quantized cache's dtype."""
        extra = self._extra_by_salt.get(cache_salt)
        if extra is None:
            extra = self._extra_by_salt[cache_salt] = extra_keys_for(self.model_id, cache_salt, self.kv_dtype)
        return extra

    def _ensure_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        bs = self.block_size
        hashes = self._hashes.setdefault(request.request_id, [])
        extra = self.extra_keys(request.cache_salt) if len(hashes) < num_blocks else b""
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    def _block_tokens(self, request: Request, num_blocks: int) -> list[Sequence[int]]:
        bs = self.block_size
        return [request.token_ids[i * bs : (i + 1) * bs] for i in range(num_blocks)]

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Blocks a new sequence can reuse: a running sibling's prompt blocks, or cached ones.

        At least one prompt token is always left to compute, so the step yields logits.
        """
        assert request.num_computed_tokens == 0 and not self.blocks(request), "only for new sequences"
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent = request.fork_from
        if parent is not None and parent.status == RequestStatus.RUNNING:
            found = self.blocks(parent)[: min(max_blocks, parent.num_computed_tokens // self.block_size)]
        elif not self.enable_caching or max_blocks == 0:
            return _NO_HIT
        else:
            hashes = self._ensure_hashes(request, max_blocks)
            found = self.pool.find_prefix(hashes[:max_blocks], self._block_tokens(request, max_blocks))
        return PrefixHit(len(found), len(found) * self.block_size, tuple(found))

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Take `hit`'s blocks and enough fresh blocks for `num_new_tokens` more tokens.

        Returns False (and changes nothing) when the pool has too few free blocks.
        """
        hit = hit or _NO_HIT
        blocks = self._blocks.setdefault(request.request_id, [])
        block_ids = self._block_ids.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + hit.num_tokens
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(blocks) - hit.num_blocks
        if num_new_blocks > self.pool.num_free_after_match(hit.blocks):
            return False
        if not blocks:  # being admitted (new, or back from preemption)
            self.pool.take(hit.blocks)
            blocks.extend(hit.blocks)
            block_ids.extend(b.block_id for b in hit.blocks)
            if request.fork_from is None:
                self.pool.record_lookup((request.num_tokens - 1) // self.block_size, hit.blocks)
        if num_new_blocks > 0:
            new_blocks = self.pool.allocate(num_new_blocks)
            assert new_blocks is not None, "free-block check and allocate disagree"
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Hash and register every block that became full and computed this step."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        hashes = self._ensure_hashes(request, num_full)
        blocks = self.blocks(request)
        bs = self.block_size
        for i in range(num_full - 1, -1, -1):
            block = blocks[i]
            if block.block_hash is not None:
                break  # blocks before a cached one are cached too
            self.pool.cache_block(block, hashes[i], request.token_ids[i * bs : (i + 1) * bs],
                                  hashes[i - 1] if i else None)

    def local_prefix_blocks(self, request: Request) -> tuple[list[bytes], int]:
        """The hashes of a new request's prompt blocks that a prefix hit may cover, and how many
        of them, from the start, the pool holds now (what the KV tier need not load)."""
        hashes = self._prompt_hashes(request)
        if not hashes:
            return [], 0
        return hashes, len(self.pool.find_prefix(hashes, self._block_tokens(request, len(hashes))))

    def _prompt_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the prompt blocks a prefix hit may cover (all but the last token's)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        if not self.enable_caching or max_blocks == 0:
            return []
        return self._ensure_hashes(request, max_blocks)[:max_blocks]

    def insert_cached_blocks(self, request: Request, first: int,
                             token_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """Register blocks `first`, `first + 1`, ... of a new request's prompt, computed
        elsewhere (the KV tier), as cached blocks no request holds yet; returns (i, block id) for each
        block `first + i` it took, for the caller to fill before the next step. `token_ids[i]` must be the request's own
        tokens of block `first + i`. Blocks the pool already holds are skipped; the request's
        cached blocks before `first` are kept from eviction meanwhile. It takes only free
        blocks and stops when none is left; what `allocate` evicts for them is in
        `pool.take_evicted()` when recorded, and must be copied out before they are filled."""
        hashes = self._prompt_hashes(request)
        bs = self.block_size
        keep = self.pool.find_prefix(hashes[:first], self._block_tokens(request, first)) if first else []
        self.pool.take(keep)
        inserted: list[Block] = []
        taken: list[tuple[int, int]] = []
        try:
            for i, tokens in enumerate(token_ids, start=first):
                if i >= len(hashes) or tuple(tokens) != tuple(request.token_ids[i * bs : (i + 1) * bs]):
                    break
                if self.pool.is_cached(hashes[i]):
                    continue
                new = self.pool.allocate(1)
                if new is None:
                    break
                block = new[0]
                self.pool.cache_block(block, hashes[i], tokens, hashes[i - 1] if i else None, from_tier=True)
                inserted.append(block)
                taken.append((i - first, block.block_id))
        finally:
            self.pool.free(reversed(inserted))  # the tail of the run is evicted first
            self.pool.free(reversed(keep))
        return taken

    def free(self, request: Request) -> None:
        """Give back the sequence's blocks, last first (its tail is evicted before its head).

        A PREEMPTED sequence keeps its hashes (its tokens are the same when it comes back);
        any other is forgotten.
        """
        self.pool.free(reversed(self._blocks.pop(request.request_id, [])))
        self._block_ids.pop(request.request_id, None)
        if request.status != RequestStatus.PREEMPTED:
            self._hashes.pop(request.request_id, None)
