"""The prefix cache service against a real Redis: a worker's publisher feeds it, a gateway's
client asks it; it rebuilds after its own restart and forgets a dead worker."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from redis import Redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.prefix_cache import BlockPool
from pagedserve.prefix_cache.block_hash import prompt_block_hashes
from pagedserve.prefix_cache.index_client import IndexClient
from pagedserve.prefix_cache.publisher import KV_EVENTS, KVEventPublisher
from pagedserve.prefix_cache.service import PrefixCacheService

from serve_helpers import wait_until


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis().start()
    yield server.url
    server.stop()


def _fill(pool: BlockPool, hashes: list[bytes]) -> list:
    blocks = pool.allocate(len(hashes))
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        pool.cache_block(block, h, [i] * 16, hashes[i - 1] if i else None)
    return blocks


def _lookup(url: str, hashes: list[bytes]) -> dict[str, int]:
    async def ask():
        client = IndexClient(url, timeout=2.0)
        try:
            return dict(await client.cached_blocks(hashes))
        finally:
            await client.aclose()
    return asyncio.run(ask())


def test_publisher_service_and_client(redis_url):
    redis = Redis.from_url(redis_url)
    redis.flushall()
    redis.zadd(q.WORKERS, {"w1": time.time() + 3600})  # a live worker, as its heartbeat keeps it
    chain = prompt_block_hashes(list(range(80)), 16, "m")  # 5 blocks
    pool = BlockPool(8)
    publisher = KVEventPublisher(redis, "w1", pool, 16, snapshot_check_interval=0.0)
    service = PrefixCacheService(redis_url, liveness_interval=0.05).start(port=0)
    url = f"http://127.0.0.1:{service.port}"
    try:
        _fill(pool, chain[:3])
        wait_until(lambda: publisher.publish() or service.index.workers() == {"w1": 3}, "the first batches")
        assert _lookup(url, chain) == {"w1": 3}

        # a malformed entry in the stream is counted and skipped
        redis.xadd(KV_EVENTS, {"batch": b"\x00not msgpack"})
        wait_until(lambda: service.num_malformed == 1, "the malformed batch")

        # the service restarts: it knows nothing, asks the live worker, and gets its snapshot
        service.stop()
        service = PrefixCacheService(redis_url, liveness_interval=0.05).start(port=0)
        url = f"http://127.0.0.1:{service.port}"
        wait_until(lambda: publisher.publish() or service.index.workers() == {"w1": 3}, "the snapshot")
        assert _lookup(url, chain) == {"w1": 3} and service.index.stats.snapshots == 1

        # the worker's heartbeat goes: its blocks leave the index
        redis.zrem(q.WORKERS, "w1")
        wait_until(lambda: service.index.workers() == {}, "the dead worker's removal")
        assert _lookup(url, chain) == {}
        metrics = httpx.get(url + "/metrics").text
        assert "pagedserve:prefix_index_malformed_total 0.0" in metrics  # the new service saw none
        assert "pagedserve:prefix_index_blocks 0.0" in metrics
    finally:
        service.stop()


def test_the_service_refuses_bad_lookups(redis_url):
    import socket

    service = PrefixCacheService(redis_url).start(port=0)
    try:
        url = f"http://127.0.0.1:{service.port}"
        assert httpx.post(url + "/lookup", content=b"x" * 31).status_code == 400  # not whole hashes
        with socket.create_connection(("127.0.0.1", service.port)) as raw:  # a body too large to read
            raw.sendall(b"POST /lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 413")
        assert httpx.get(url + "/nothing").status_code == 404
        assert httpx.get(url + "/health").json() == {"status": "ok", "workers": 0, "blocks": 0}
    finally:
        service.stop()


def test_the_client_raises_when_the_service_is_down():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exception):  # noqa: B017 - any failure: the gateway then routes by load
        _lookup(f"http://127.0.0.1:{port}", [b"h" * 32])
