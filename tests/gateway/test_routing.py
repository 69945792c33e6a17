"""The gateway's routing against a real Redis and workers announced by hand: the lookup's
answer picks the worker, a lookup that fails or hangs routes by load (counted), the workers'
infos are read once per routing_info_ttl, and a worker that died meanwhile gets nothing."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from pagedserve.common import queue_protocol as q
from pagedserve.common.contracts import RouteDecision
from pagedserve.common.errors import InvalidParameterError, ServiceUnavailableError
from pagedserve.common.queue_protocol import QueuedRequest, WorkerInfo, decode_request, encode
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.request_routing import RequestRouting, prefix_lookup_from_config
from pagedserve.plugins.routers import CacheAwareRouter, LeastLoadedRouter
from pagedserve.prefix_cache.block_hash import prompt_block_hashes
from pagedserve.telemetry.metrics import GatewayMetrics

BLOCK = 4
PROMPT = list(range(1, 11))  # 2 full blocks of 4


@pytest.fixture()
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def _announce(client, worker_id: str, running: int = 0, ttl: float = 60, kv_dtype: str = "") -> None:
    info = WorkerInfo(worker_id=worker_id, model="m", max_model_len=64, pid=1, host="h", max_num_seqs=4,
                      num_running=running, block_size=BLOCK, kv_model_id="m", kv_dtype=kv_dtype)
    client.zadd(q.WORKERS, {worker_id: time.time() + ttl})
    client.set(q.worker_key(worker_id), encode(info))


def _request(request_id: str, prompt=PROMPT, salt: str | None = "s") -> QueuedRequest:
    return QueuedRequest(request_id=request_id, prompt_token_ids=list(prompt), params=SamplingParams(max_tokens=1),
                         cache_salt=salt, deadline=time.time() + 60)


class FakeLookup:
    def __init__(self, answer: dict[str, int] | None = None, fail: bool = False, delay: float = 0.0):
        self.answer, self.fail, self.delay = answer or {}, fail, delay
        self.asked: list[list[bytes]] = []

    async def cached_blocks(self, block_hashes):
        self.asked.append(list(block_hashes))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("the prefix cache service is down")
        return self.answer


def _routing(redis_url, lookup, router=None, **config) -> tuple[RequestRouting, GatewayMetrics]:
    cfg = ServeConfig(**config)
    metrics = GatewayMetrics(CollectorRegistry())
    return RequestRouting(cfg, QueueClient(redis_url, cfg), router or CacheAwareRouter(cfg), lookup, metrics), metrics


def _counts(metrics: GatewayMetrics) -> tuple[dict[str, float], dict[str, float]]:
    return ({r: c._value.get() for r, c in metrics.routed.items()},
            {r: c._value.get() for r, c in metrics.lookup_fallbacks.items()})


def test_the_worker_holding_the_prefix_gets_the_prompt(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    _announce(client, "w1")
    _announce(client, "w2", running=1)
    lookup = FakeLookup({"w2": 2, "w1": 0})

    async def run():
        routing, metrics = _routing(redis_url, lookup)
        try:
            decision = await routing.submit(_request("r1"))
            # nothing cached anywhere: by load, to the idle one
            lookup.answer = {}
            second = await routing.submit(_request("r2"))
            return decision, second, _counts(metrics)
        finally:
            await routing.queue.close()

    decision, second, counts = asyncio.run(run())
    assert decision == RouteDecision("w2", "cache") and second == RouteDecision("w1", "load")
    assert counts == ({"cache": 1, "load": 1, "shared": 0}, {"timeout": 0, "error": 0})
    # the lookup got the worker's own block hashes: block size, model id and salt as announced
    assert lookup.asked[0] == prompt_block_hashes(PROMPT, BLOCK, "m", "s") and len(lookup.asked[0]) == 2
    [(_, fields)] = client.xrange(q.routed_key("w2", None))
    assert decode_request(fields[q.REQUEST_FIELD]).request_id == "r1"
    assert fields[q.CACHED_TOKENS_FIELD] == str(2 * BLOCK).encode()  # what a thief would compute again
    [(_, fields)] = client.xrange(q.routed_key("w1", None))
    assert fields[q.CACHED_TOKENS_FIELD] == b"0"
    client.close()


def test_float_and_int8_kv_workers_are_asked_with_their_own_hashes(redis_url):
    """A worker with an int8 KV cache hashes its blocks with the dtype: the gateway asks for
    its hashes apart, and a float worker's hit never counts for it (nor the other way)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    _announce(client, "float")
    _announce(client, "int8", kv_dtype="int8")
    float_hashes = prompt_block_hashes(PROMPT, BLOCK, "m", "s")
    int8_hashes = prompt_block_hashes(PROMPT, BLOCK, "m", "s", kv_dtype="int8")
    assert not set(float_hashes) & set(int8_hashes)

    class ByHash(FakeLookup):
        async def cached_blocks(self, block_hashes):
            self.asked.append(list(block_hashes))
            # the index holds the float blocks on "float" and claims them (wrongly) on "int8" too
            return {"float": 2, "int8": 2} if list(block_hashes) == float_hashes else {}

    lookup = ByHash()

    async def run():
        routing, _ = _routing(redis_url, lookup)
        try:
            return await routing._cached_tokens(_request("r"), [
                WorkerInfo(worker_id="float", model="m", max_model_len=64, pid=1, host="h", max_num_seqs=4,
                           block_size=BLOCK, kv_model_id="m"),
                WorkerInfo(worker_id="int8", model="m", max_model_len=64, pid=1, host="h", max_num_seqs=4,
                           block_size=BLOCK, kv_model_id="m", kv_dtype="int8")])
        finally:
            await routing.queue.close()

    cached = asyncio.run(run())
    assert cached == {"float": 2 * BLOCK}  # the int8 worker's own hashes found nothing
    assert sorted(lookup.asked) == sorted([float_hashes, int8_hashes])
    client.close()


@pytest.mark.parametrize("lookup, reason", [(FakeLookup(fail=True), "error"), (FakeLookup({"w2": 2}, delay=1.0), "timeout")])
def test_a_lookup_that_fails_or_hangs_routes_by_load(redis_url, lookup, reason):
    import redis

    client = redis.Redis.from_url(redis_url)
    _announce(client, "w1")
    _announce(client, "w2", running=1)

    async def run():
        routing, metrics = _routing(redis_url, lookup, prefix_lookup_timeout=0.05)
        try:
            started = time.monotonic()
            decision = await routing.submit(_request("r1"))
            return decision, time.monotonic() - started, _counts(metrics)
        finally:
            await routing.queue.close()

    decision, took, (routed, fallbacks) = asyncio.run(run())
    assert decision == RouteDecision("w1", "load") and took < 0.5
    assert routed == {"cache": 0, "load": 1, "shared": 0}
    assert fallbacks == {"timeout": 0, "error": 0} | {reason: 1}
    client.close()


def test_short_prompts_and_no_lookup_route_by_load_without_asking(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    _announce(client, "w1")
    lookup = FakeLookup({"w1": 1})

    async def run():
        with_lookup, _ = _routing(redis_url, lookup)
        without, _ = _routing(redis_url, None)
        try:
            return (await with_lookup.submit(_request("short", prompt=[1, 2, 3])),
                    await without.submit(_request("long")))
        finally:
            await with_lookup.queue.close()
            await without.queue.close()

    assert asyncio.run(run()) == (RouteDecision("w1", "load"), RouteDecision("w1", "load"))
    assert lookup.asked == []  # less than a block: nothing to look up
    client.close()


def test_the_infos_are_read_once_per_ttl_and_what_was_routed_since_counts_as_load(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    _announce(client, "w1")
    _announce(client, "w2")

    async def run():
        routing, _ = _routing(redis_url, None, LeastLoadedRouter(), routing_info_ttl=30)
        reads = 0
        read = routing.queue.routing_view

        async def counted():
            nonlocal reads
            reads += 1
            return await read()

        routing.queue.routing_view = counted  # type: ignore[method-assign]
        try:
            decisions = [await routing.submit(_request(f"r{i}")) for i in range(4)]
            # concurrent requests with an expired view share one read
            routing._view.read_at = float("-inf")
            await asyncio.gather(*(routing.decide(_request(f"c{i}")) for i in range(5)))
            return [d.worker_id for d in decisions], reads
        finally:
            await routing.queue.close()

    workers, reads = asyncio.run(run())
    assert workers == ["w1", "w2", "w1", "w2"]  # each routed prompt loads its worker locally
    assert reads == 2
    assert {k: int(v) for k, v in client.hgetall(q.WORKER_QUEUED).items()} == {b"w1": 2, b"w2": 2}
    client.close()


def test_no_live_worker_is_the_shared_queue_and_a_dead_worker_gets_nothing(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)

    async def run():
        routing, metrics = _routing(redis_url, None, routing_info_ttl=30)
        try:
            with pytest.raises(ServiceUnavailableError):
                await routing.submit(_request("none"))
            assert await routing.decide(_request("none")) == RouteDecision(None, "shared")
            _announce(client, "w1")
            routing._view.read_at = float("-inf")
            assert (await routing.decide(_request("x"))).worker_id == "w1"
            _announce(client, "w2")
            client.zadd(q.WORKERS, {"w1": time.time() - 1})  # dead since the view was read
            decision = await routing.submit(_request("r1"))
            return decision, _counts(metrics)[0]
        finally:
            await routing.queue.close()

    decision, routed = asyncio.run(run())
    assert decision == RouteDecision(None, "shared")
    assert routed == {"cache": 0, "load": 0, "shared": 1}
    assert client.xlen(q.REQUESTS) == 1 and not client.exists(q.routed_key("w1", None))
    client.close()


def test_a_prefix_cache_url_gives_the_index_client():
    from pagedserve.prefix_cache.index_client import IndexClient

    with pytest.raises(InvalidParameterError, match="prefix_cache_url"):
        prefix_lookup_from_config(ServeConfig(prefix_cache_url="redis://x"))
    assert isinstance(prefix_lookup_from_config(ServeConfig(prefix_cache_url="http://127.0.0.1:8300")), IndexClient)
    assert prefix_lookup_from_config(ServeConfig()) is None


def test_closing_the_routing_closes_the_lookups_connections():
    closed = []

    class Lookup:
        async def cached_blocks(self, block_hashes):
            return {}

        async def aclose(self):
            closed.append(True)

    config = ServeConfig()
    routing = RequestRouting(config, None, LeastLoadedRouter(), Lookup(), GatewayMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    asyncio.run(routing.close())
    assert closed == [True]
    asyncio.run(RequestRouting(config, None, LeastLoadedRouter(), None,  # type: ignore[arg-type]
                               GatewayMetrics(CollectorRegistry())).close())  # no lookup: nothing to close
