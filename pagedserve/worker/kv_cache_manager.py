"""`KVCacheManager`: gives requests KV blocks from the `BlockPool`, reusing cached prefixes."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.prefix_cache import Block, BlockPool, ExtraKey, ExtraKeyKind
from pagedserve.prefix_cache.block_hash import encode_extra_keys, hash_block
from pagedserve.worker.request import Request, RequestStatus


class KVCacheManager:
    """Block tables of requests: prefix lookups, allocation, caching of full blocks, freeing."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, model_id: str):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.model_id = model_id
        self._extra_by_salt: dict[str | None, bytes] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def extra_keys(self, cache_salt: str | None) -> bytes:
        """The encoded extra keys of every block hash: the model id and the tenant's salt."""
        extra = self._extra_by_salt.get(cache_salt)
        if extra is None:
            keys = [ExtraKey(ExtraKeyKind.MODEL_ID, self.model_id)]
            if cache_salt is not None:
                keys.append(ExtraKey(ExtraKeyKind.TENANT_SALT, cache_salt))
            extra = self._extra_by_salt[cache_salt] = encode_extra_keys(keys)
        return extra

    def _ensure_hashes(self, request: Request, num_blocks: int) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        extra = self.extra_keys(request.cache_salt) if len(hashes) < num_blocks else b""
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.token_ids[i * bs : (i + 1) * bs], extra))

    def _block_tokens(self, request: Request, num_blocks: int) -> list[Sequence[int]]:
        bs = self.block_size
        return [request.token_ids[i * bs : (i + 1) * bs] for i in range(num_blocks)]

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """Blocks a new request can reuse: a running sibling's prompt blocks, or cached ones.

        At least one prompt token is always left to compute, so the step yields logits.
        """
        assert request.num_computed_tokens == 0 and not request.blocks, "only for new requests"
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent = request.fork_from
        if parent is not None and parent.status == RequestStatus.RUNNING:
            return parent.blocks[: min(max_blocks, parent.num_computed_tokens // self.block_size)]
        if not self.enable_caching or max_blocks == 0:
            return []
        self._ensure_hashes(request, max_blocks)
        return self.pool.find_prefix(request.block_hashes[:max_blocks], self._block_tokens(request, max_blocks))

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = ()) -> bool:
        """Take `computed_blocks` and enough fresh blocks for `num_new_tokens` more tokens.

        Returns False (and changes nothing) when the pool has too few free blocks.
        """
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(request.blocks) - len(computed_blocks)
        if num_new_blocks > self.pool.num_free_after_match(computed_blocks):
            return False
        if not request.blocks:  # being admitted (new, or back from preemption)
            self.pool.take(computed_blocks)
            request.blocks.extend(computed_blocks)
            request.num_computed_tokens = num_computed
            if request.fork_from is None:
                self.pool.record_lookup((request.num_tokens - 1) // self.block_size, len(computed_blocks))
            request.num_cached_tokens = num_computed
        if num_new_blocks > 0:
            new_blocks = self.pool.allocate(num_new_blocks)
            assert new_blocks is not None, "free-block check and allocate disagree"
            request.blocks.extend(new_blocks)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Hash and register every block that became full and computed this step."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        self._ensure_hashes(request, num_full)
        bs = self.block_size
        for i in range(num_full - 1, -1, -1):
            block = request.blocks[i]
            if block.block_hash is not None:
                break  # blocks before a cached one are cached too
            self.pool.cache_block(block, request.block_hashes[i], request.token_ids[i * bs : (i + 1) * bs])

    def free(self, request: Request) -> None:
        """Give back the request's blocks, last first (its tail is evicted before its head)."""
        self.pool.free(reversed(request.blocks))
        request.blocks = []
