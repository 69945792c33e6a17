"""How fast the shared KV tier moves blocks: `python benchmarks/kv_tier.py`.

Uses KV cache tensors of the default model's shape (SmolLM2-135M: 30 layers, 3 KV heads,
head dim 64, float32, 16-token blocks: 737,280 bytes a block) and a Redis of its own, and
times each stage the engine runs:

- copy out: the evicted blocks' K/V gathered into one host tensor (on the step's path);
- put: encoding and storing them (the writer thread);
- get: the leading-run lookup and the values (the reader thread), decoded into a tensor;
- copy in: the loaded blocks written into the cache tensors (on the step's path).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.engine.kv_tier import KVTier
from pagedserve.prefix_cache.block_pool import BlockPool, EvictedBlock
from pagedserve.prefix_cache.kv_tier_store import KVLayout, KVTierStore


class _Manager:
    """The part of KVCacheManager that KVTier's save path reads: the pool."""

    def __init__(self, pool: BlockPool):
        self.pool = pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=128, help="blocks per batch (128: a 2k-token prefix)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    layout = KVLayout("smollm2-135m-instruct", "float32", 16, 30, 3, 64)
    n = args.blocks
    caches = [torch.randn(2, 2 * n, 16, 3, 64) for _ in range(layout.num_layers)]
    server = EmbeddedRedis(maxmemory=4 << 30).start()
    try:
        import redis

        store = KVTierStore(redis.Redis.from_url(server.url), layout, budget_bytes=2 << 30)
        pool = BlockPool(2 * n)
        tier = KVTier(store, _Manager(pool), caches)  # type: ignore[arg-type]
        mb = n * layout.block_bytes / 1e6
        print(f"{n} blocks of {layout.block_bytes:,} bytes = {mb:.1f} MB per batch; torch threads {torch.get_num_threads()}")
        for r in range(args.repeat):
            ids = list(range(n))
            started = time.perf_counter()
            kv = tier._gather(ids)
            gathered = time.perf_counter()
            blocks = [EvictedBlock(i, f"r{r}-{i}".encode().ljust(32, b"."), tuple(range(16))) for i in ids]
            tier._put(blocks, kv, 0)
            put = time.perf_counter()
            loaded = tier._load([b.block_hash for b in blocks])
            got = time.perf_counter()
            assert loaded.kv is not None and torch.equal(loaded.kv, kv)  # [layers, 2, n, ...] both
            index = torch.arange(n, 2 * n)
            for layer, cache in enumerate(caches):
                cache.index_copy_(1, index, loaded.kv[layer])
            copied = time.perf_counter()
            print(f"run {r + 1}: copy out {(gathered - started) * 1e3:7.1f} ms ({mb / (gathered - started) / 1e3:5.2f} GB/s)"
                  f" | put {(put - gathered) * 1e3:7.1f} ms ({mb / (put - gathered) / 1e3:5.2f} GB/s)"
                  f" | get {(got - put) * 1e3:7.1f} ms ({mb / (got - put) / 1e3:5.2f} GB/s)"
                  f" | copy in {(copied - got) * 1e3:7.1f} ms ({mb / (copied - got) / 1e3:5.2f} GB/s)")
        tier.close()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
