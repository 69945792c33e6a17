"""Routing with two real CPU workers (in-process, the tiny model): prompts that share a
prefix go to the worker that holds it, and a worker that dies holding routed and stolen
requests (and with more waiting in its stream) loses none of them: each ends with exactly
the tokens an uninterrupted run gives."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from pagedserve import LLM, SamplingParams
from pagedserve.common import queue_protocol as q
from pagedserve.common.contracts import RouteDecision, RouterPlugin, RoutingInput, WorkerCandidate
from pagedserve.common.output_log import OutputLog
from pagedserve.common.queue_protocol import QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.request_routing import RequestRouting
from pagedserve.plugins.routers import CacheAwareRouter
from pagedserve.telemetry.metrics import GatewayMetrics
from pagedserve.worker.service import WorkerService

from serve_helpers import wait_until

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class PoolLookup:
    """The index as the prefix cache service would answer it: read from the workers' real pools."""

    def __init__(self, services: Sequence[WorkerService]):
        self.services = services

    async def cached_blocks(self, block_hashes):
        held = {}
        for service in self.services:
            cached = service.engine.kv_manager.pool._cached
            n = 0
            while n < len(block_hashes) and block_hashes[n] in cached:
                n += 1
            if n:
                held[service.worker_id] = n
        return held


class ScriptedRouter(RouterPlugin):
    """Sends each request where the test says (`target`)."""

    target: str | None = None

    def route(self, request: RoutingInput, workers: Sequence[WorkerCandidate]) -> RouteDecision:
        return RouteDecision(self.target, "load")


def _start(path: str, config: ServeConfig, n: int = 2) -> tuple[list[WorkerService], list[threading.Thread], EmbeddedRedis]:
    redis_server = EmbeddedRedis().start()
    services = [WorkerService(LLM(path, kv_cache_memory=1 << 22, attention_backend="torch", max_num_seqs=2).engine,
                              config, redis_server.url, worker_id=f"w{i}") for i in range(n)]
    threads = [threading.Thread(target=s.run, daemon=True) for s in services]
    for t in threads:
        t.start()
    wait_until(lambda: all(s.queue.redis.get(q.worker_key(s.worker_id)) for s in services), "every worker announced")
    return services, threads, redis_server


def _stop(services, threads, redis_server) -> None:
    for s in services:
        s.drain()
    for t in threads:
        t.join(timeout=10)
    redis_server.stop()
    assert not any(t.is_alive() for t in threads)


async def _read(client: QueueClient, request: QueuedRequest) -> OutputLog:
    final = OutputLog(1)
    async for _, log in client.outputs(request.request_id, 1, request.deadline):
        final = log
    return final


def _request(request_id: str, prompt: list[int]) -> QueuedRequest:
    return QueuedRequest(request_id=request_id, prompt_token_ids=prompt, params=PARAMS, deadline=time.time() + 120)


def test_prompts_sharing_a_prefix_go_to_the_worker_that_holds_it(tiny_checkpoint):
    # a margin of 2: the three followers (2 slots per worker) may all queue on the holder
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=1.0, drain_timeout=1.0, routing_info_ttl=0.05,
                         router_load_margin=2.0)
    services, threads, redis_server = _start(str(tiny_checkpoint("llama-gqa")), config)
    prefix = [(7 * i) % 200 + 3 for i in range(48)]  # 3 blocks of 16

    async def run():
        client = QueueClient(redis_server.url, config)
        metrics = GatewayMetrics(CollectorRegistry())
        routing = RequestRouting(config, client, CacheAwareRouter(config), PoolLookup(services), metrics)
        try:
            first = _request("first", prefix + [1, 2])
            opener = await routing.submit(first)  # nothing cached anywhere: by load
            opened = await _read(client, first)
            followers = [_request(f"f{i}", prefix + [10 + i, 11 + i, 12]) for i in range(3)]
            decisions = [await routing.submit(r) for r in followers]
            # while the holder still has the three (taken or promised): once they finish, both
            # workers are idle and the tie goes to the lower worker id, whichever that is
            other = _request("other", [250 - i for i in range(40)])
            elsewhere = await routing.submit(other)
            logs = await asyncio.gather(*(_read(client, r) for r in followers))
            await _read(client, other)
            return opener, opened, decisions, logs, elsewhere, {r: c._value.get() for r, c in metrics.routed.items()}
        finally:
            await client.close()

    try:
        opener, opened, decisions, logs, elsewhere, routed = asyncio.run(run())
    finally:
        _stop(services, threads, redis_server)
    assert opener.reason == "load" and opened.num_cached_tokens == 0
    holder = opener.worker_id
    assert decisions == [RouteDecision(holder, "cache")] * 3
    assert [log.num_cached_tokens for log in logs] == [48, 48, 48]  # the prefix, from that worker's pool
    assert all(log.error is None and len(log.completions[0].token_ids) == 24 for log in logs)
    # a prompt nobody holds goes by load: the worker that is not running three
    assert elsewhere == RouteDecision(next(s.worker_id for s in services if s.worker_id != holder), "load")
    assert routed == {"cache": 3, "load": 2, "shared": 0}


def test_a_worker_killed_holding_routed_and_stolen_requests_loses_none(tiny_checkpoint, monkeypatch):
    path = str(tiny_checkpoint("llama-gqa"))
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": [5 + i, 17, 33 + i, 101, 7, i + 1] for i in range(6)}
    expected = {rid: out.outputs[0].token_ids for rid, out in
                zip(prompts, LLM(path, kv_cache_memory=1 << 22, attention_backend="torch").generate(
                    list(prompts.values()), params), strict=True)}
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=1.0, drain_timeout=1.0, steal_after=0.2,
                         routing_info_ttl=0.05)
    services, threads, redis_server = _start(path, config)
    survivor, victim = services
    dead = threading.Event()  # set: the victim's loop stops for good (no step, no heartbeat, no write)
    release = threading.Event()

    for service in services:
        step = service.engine.step

        def slow(step=step, service=service):
            time.sleep(0.03)  # long enough for the test to look at who runs what
            if service is victim and dead.is_set():
                release.wait()
            return step()
        monkeypatch.setattr(service.engine, "step", slow)

    router = ScriptedRouter()
    requests = {rid: QueuedRequest(request_id=rid, prompt_token_ids=p, params=params, deadline=time.time() + 120)
                for rid, p in prompts.items()}

    async def run():
        client = QueueClient(redis_server.url, config)
        routing = RequestRouting(config, client, router, None, GatewayMetrics(CollectorRegistry()))
        try:
            # 3 routed to the survivor (2 slots): the idle victim steals the third
            router.target = survivor.worker_id
            readers = {}
            for rid in ("r0", "r1", "r2"):
                await routing.submit(requests[rid])
                readers[rid] = asyncio.create_task(_read(client, requests[rid]))
            await asyncio.to_thread(wait_until, lambda: victim.queue.reader.num_stolen == 1, "the victim stealing one")
            # 3 routed to the victim: it runs one beside the stolen one, two wait in its stream
            router.target = victim.worker_id
            for rid in ("r3", "r4", "r5"):
                await routing.submit(requests[rid])
                readers[rid] = asyncio.create_task(_read(client, requests[rid]))
            held = await asyncio.to_thread(wait_until, lambda: len(victim.running) == 2 and dict(victim.running),
                                           "the victim running two")
            dead.set()
            logs = {rid: await task for rid, task in readers.items()}
            return held, logs
        finally:
            await client.close()

    try:
        held, logs = asyncio.run(run())
        stolen_by_victim = [rid for rid, run in held.items() if q.routed_owner(run.stream) == survivor.worker_id]
        routed_to_victim = [rid for rid, run in held.items() if q.routed_owner(run.stream) == victim.worker_id]
        assert len(stolen_by_victim) == 1 and len(routed_to_victim) == 1  # it died holding one of each
        for rid, log in logs.items():
            assert (log.error, log.completions[0].finish_reason) == (None, "length"), rid
            assert log.completions[0].token_ids == expected[rid], rid  # token-exact, resumed or not
        # the survivor resumed both running ones and took the two that waited in the victim's stream
        assert survivor.running.num_taken_over == 2 and survivor.queue.reader.num_stolen == 2
        assert not survivor.running
    finally:
        release.set()
        _stop(services, threads, redis_server)
