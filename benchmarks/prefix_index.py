"""`python benchmarks/prefix_index.py`: what a cluster index lookup costs.

Four workers, 100,000 blocks indexed in all; one 32k-token prompt (2048 blocks of 16)
whose leading 2048, 1500, 700 and 0 blocks the four workers hold. Prints the lookup time
(`PrefixIndex.lookup`, in process) and, beside it, the time to hash the prompt
(`prompt_block_hashes`, which the gateway pays before it can ask), each the median of
`--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedserve.prefix_cache.block_hash import prompt_block_hashes
from pagedserve.prefix_cache.events import BlockStored, KVEvent, KVEventBatch
from pagedserve.prefix_cache.index import PrefixIndex


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _through_the_service(index: PrefixIndex, chain: list[bytes], repeat: int) -> float:
    """The same lookup asked of a `PrefixCacheService` holding this index, over loopback HTTP
    (its event consumer points at no Redis; it is silenced)."""
    import asyncio
    import logging

    from pagedserve.prefix_cache.index_client import IndexClient
    from pagedserve.prefix_cache.index_service import PrefixCacheService

    logging.getLogger("pagedserve.prefix_cache.index_service").setLevel(logging.CRITICAL)
    service = PrefixCacheService("redis://127.0.0.1:1")
    service.index = index
    service.start(port=0)

    async def measure() -> float:
        client = IndexClient(f"http://127.0.0.1:{service.port}", timeout=5.0)
        times = []
        try:
            for _ in range(repeat + 1):
                started = time.perf_counter()
                await client.cached_blocks(chain)
                times.append(time.perf_counter() - started)
        finally:
            await client.aclose()
        return statistics.median(times[1:])  # the first opens the connection

    try:
        return asyncio.run(measure())
    finally:
        service.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--indexed-blocks", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)

    tokens = list(range(100, 100 + args.prompt_tokens))
    chain = prompt_block_hashes(tokens, 16, "smollm2-135m-instruct")
    held = {"w0": len(chain), "w1": len(chain) * 3 // 4, "w2": len(chain) // 3, "w3": 0}
    index = PrefixIndex()
    filler = (args.indexed_blocks - sum(held.values())) // len(held)
    for worker, n in held.items():
        events: list[KVEvent] = [BlockStored(h, None, 16) for h in chain[:n]]
        events += [BlockStored(os.urandom(32), None, 16) for _ in range(filler)]
        index.apply(KVEventBatch(worker_id=worker, epoch="bench", seq=0, sent_at=0.0, events=events))
    result = index.lookup(chain)
    assert result == {w: n for w, n in held.items() if n}, result
    lookup = _median_seconds(lambda: index.lookup(chain), args.repeat)
    hashing = _median_seconds(lambda: prompt_block_hashes(tokens, 16, "smollm2-135m-instruct"), args.repeat)
    print(f"index: {index.num_blocks} blocks over {len(held)} workers; prompt: {args.prompt_tokens} tokens, "
          f"{len(chain)} blocks; median of {args.repeat}")
    over_http = _through_the_service(index, chain, args.repeat)
    print(f"lookup          {lookup * 1e3:8.3f} ms   (target: under 1 ms)")
    print(f"  through the service's HTTP API (IndexClient, loopback) {over_http * 1e3:8.3f} ms")
    print(f"hash the prompt {hashing * 1e3:8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
