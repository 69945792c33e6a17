"""Block hashing and the block pool. No torch here: every test runs in milliseconds."""

from pagedserve.prefix_cache.block_hash import ExtraKey, ExtraKeyKind, hash_block
from pagedserve.prefix_cache.block_pool import Block, BlockPool

__all__ = ["Block", "BlockPool", "ExtraKey", "ExtraKeyKind", "hash_block"]
