"""The prefix cache service against a real Redis: a worker's publisher feeds it, a gateway's
client asks it; it rebuilds after its own restart and forgets a dead worker. Its HTTP API
(a Litestar app) refuses bad lookups in OpenAI's error shape and publishes its schema."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from redis import Redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.prefix_cache import BlockPool
from pagedserve.prefix_cache.block_hash import prompt_block_hashes
from pagedserve.prefix_cache.http_app import HASH_BYTES, MAX_LOOKUP_HASHES
from pagedserve.prefix_cache.index_client import IndexClient
from pagedserve.prefix_cache.index_service import PrefixCacheService
from pagedserve.prefix_cache.publisher import KV_EVENTS, KVEventPublisher

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
        answer = httpx.post(url + "/lookup", content=b"".join(chain))
        assert (answer.status_code, answer.json()) == (200, {"workers": {"w1": 3}})
        assert httpx.post(url + "/lookup", content=b"".join(chain[:2])).json() == {"workers": {"w1": 2}}

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


def _error(status: int, message: str, code: str) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def test_the_service_refuses_bad_lookups(redis_url):
    service = PrefixCacheService(redis_url).start(port=0)
    try:
        url = f"http://127.0.0.1:{service.port}"
        not_whole = httpx.post(url + "/lookup", content=b"x" * 31)
        assert (not_whole.status_code, not_whole.json()) == _error(
            400, "the body must be block hashes of 32 bytes each, concatenated; got 31 bytes", "invalid_request")
        too_large = _error(413, "a lookup's body is at most 2097152 bytes (65536 hashes of 32 bytes); send fewer "
                                "blocks", "request_too_large")
        over = httpx.post(url + "/lookup", content=b"h" * (MAX_LOOKUP_HASHES + 1) * HASH_BYTES)
        assert (over.status_code, over.json()) == too_large
        at_limit = httpx.post(url + "/lookup", content=b"h" * MAX_LOOKUP_HASHES * HASH_BYTES)
        assert (at_limit.status_code, at_limit.json()) == (200, {"workers": {}})
        with socket.create_connection(("127.0.0.1", service.port)) as raw:  # refused on its Content-Length alone
            raw.sendall(b"POST /lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
            head, _, body = _read_answer(raw)
        assert head.startswith(b"HTTP/1.1 413") and (413, json.loads(body)) == too_large
        missing = httpx.get(url + "/nothing")
        assert (missing.status_code, missing.json()) == (404, {"error": {
            "message": "Not Found", "type": "not_found_error", "param": None, "code": "not_found"}})
        # none of it took the service down
        assert httpx.get(url + "/health").json() == {"status": "ok", "workers": 0, "blocks": 0}
        assert httpx.post(url + "/lookup", content=b"").json() == {"workers": {}}
    finally:
        service.stop()


def _read_answer(sock: socket.socket) -> tuple[bytes, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a Content-Length: its status line, headers and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {k.decode().lower(): v.decode().strip() for k, _, v in (line.partition(b":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(4096)
    return status, headers, body


def test_the_body_limit_is_configurable(redis_url):
    with pytest.raises(InvalidParameterError, match="max_body_bytes"):
        PrefixCacheService(redis_url, max_body_bytes=31)
    service = PrefixCacheService(redis_url, max_body_bytes=2 * HASH_BYTES).start(port=0)
    try:
        url = f"http://127.0.0.1:{service.port}"
        assert httpx.post(url + "/lookup", content=b"h" * 2 * HASH_BYTES).json() == {"workers": {}}
        too_large = _error(413, "a lookup's body is at most 64 bytes (2 hashes of 32 bytes); send fewer blocks",
                           "request_too_large")
        over = httpx.post(url + "/lookup", content=b"h" * 3 * HASH_BYTES)
        assert (over.status_code, over.json()) == too_large
        chunked = httpx.post(url + "/lookup", content=iter([b"h" * 2 * HASH_BYTES, b"h" * HASH_BYTES]))  # no length
        assert (chunked.status_code, chunked.json()) == too_large
    finally:
        service.stop()


def test_the_openapi_schema_lists_lookup(redis_url):
    service = PrefixCacheService(redis_url).start(port=0)
    try:
        schema = httpx.get(f"http://127.0.0.1:{service.port}/docs/openapi.json").json()
    finally:
        service.stop()
    assert sorted(schema["paths"]) == ["/health", "/lookup"]  # /metrics is Prometheus's, not the API's
    lookup = schema["paths"]["/lookup"]["post"]
    assert lookup["requestBody"]["content"]["application/octet-stream"]["schema"]["format"] == "binary"
    assert sorted(lookup["responses"]) == ["200", "400", "413"]
    assert schema["components"]["schemas"]["LookupAnswer"]["properties"]["workers"] == {
        "type": "object", "additionalProperties": {"type": "integer"}}


def test_kept_alive_lookups_do_not_wait_for_delayed_acks(redis_url):
    """uvicorn writes an answer's headers and body apart: without TCP_NODELAY on the accepted
    socket, each lookup on a kept-alive connection waits about 40 ms for the client's ACK."""
    service = PrefixCacheService(redis_url).start(port=0)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{service.port}") as client:
            client.post("/lookup", content=b"h" * HASH_BYTES)
            times = []
            for _ in range(9):
                started = time.perf_counter()
                client.post("/lookup", content=b"h" * HASH_BYTES)
                times.append(time.perf_counter() - started)
    finally:
        service.stop()
    assert sorted(times)[4] < 0.025, times


def test_a_port_in_use_raises_oserror(redis_url):
    """The launcher falls back to a free port on OSError (entrypoints/launcher.py)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            PrefixCacheService(redis_url).start(port=taken.getsockname()[1])


def test_the_client_raises_when_the_service_is_down():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exception):  # noqa: B017 - any failure: the gateway then routes by load
        _lookup(f"http://127.0.0.1:{port}", [b"h" * 32])
