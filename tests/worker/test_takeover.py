"""A takeover asks the request's gateway what its client was sent (a claim in the reply
stream, answered on fold_key). The three answers a worker can get, each with its exact
outcome: the fold (the request resumes from it), "nobody waits here" (the entry is
acknowledged, nothing written), and none within takeover_fold_timeout (a visible
request_lost, then the ack). The engine is a `ClockEngine` (no model), the worker the real
`WorkerService`, the gateway the real `QueueClient`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import pytest
import redis

from pagedserve.bench.fake_engine import ClockEngine, expected_token
from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.engine.engine import Engine
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.worker.queue_consumer import QueueConsumer
from pagedserve.worker.service import WorkerService

from serve_helpers import chunks_of

MAX_TOKENS = 8
CONFIG = ServeConfig(heartbeat_interval=0.05, worker_timeout=0.2, takeover_fold_timeout=0.1)
GATEWAY = "g1"


@pytest.fixture()
def server():
    with EmbeddedRedis() as s:
        yield s


def _request(request_id: str) -> QueuedRequest:
    return QueuedRequest(request_id=request_id, prompt_token_ids=[7, 8, 9], deadline=time.time() + 60,
                         params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


@contextmanager
def _gateway(url: str) -> Iterator[tuple[QueueClient, asyncio.AbstractEventLoop]]:
    """A QueueClient whose event loop runs in a thread of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = QueueClient(url, CONFIG, GATEWAY)
    try:
        yield client, loop
    finally:
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _died_with(url: str, request: QueuedRequest, reply_to: str) -> None:
    """`request` admitted by gateway `reply_to`, then taken by a worker that died."""
    async def admit() -> None:
        client = QueueClient(url, ServeConfig(queue_without_workers=True), GATEWAY)
        try:
            await client.submit(request)
        finally:
            await client.close()

    asyncio.run(admit())
    dead = QueueConsumer(url, CONFIG, worker_id="dead")
    dead.reader.ensure_groups([q.REQUESTS])
    assert [t.request.reply_to for t in dead.reader.pull(1, None)] == [reply_to]
    time.sleep(CONFIG.worker_timeout + 0.05)  # its entry goes idle


def _worker(url: str) -> WorkerService:
    engine = ClockEngine(max_num_seqs=4, step_ms=0.0, tokens_per_step=1)
    return WorkerService(cast(Engine, engine), CONFIG, url, worker_id="w1")


def test_a_gateway_that_does_not_answer_gets_a_request_lost_and_the_entry_is_acknowledged(server):
    _died_with(server.url, _request("r"), q.reply_key(GATEWAY))
    service = _worker(server.url)
    started = time.monotonic()
    service._iteration()
    assert time.monotonic() - started < 2.0  # waited takeover_fold_timeout (capped at worker_timeout / 2), no more
    assert "r" not in service.running
    admin = redis.Redis.from_url(server.url)
    [claim, final] = chunks_of(admin, q.reply_key(GATEWAY), "r")
    assert claim.claim and claim.attempt == 2
    assert final.done and final.error is not None and final.error.code == "request_lost"
    assert admin.xpending(q.REQUESTS, q.GROUP)["pending"] == 0 and admin.xlen(q.REQUESTS) == 0
    admin.close()


def test_a_request_nobody_waits_on_is_acknowledged_without_a_word(server):
    _died_with(server.url, _request("r"), q.reply_key(GATEWAY))
    with _gateway(server.url) as (client, loop):
        # the reader runs (it waits on another request); "r" is nobody's here (its client left)
        loop.call_soon_threadsafe(client.reader.subscribe, "another", 1)
        service = _worker(server.url)
        service._iteration()
        assert "r" not in service.running and not service.engine.has_unfinished_requests()
        admin = redis.Redis.from_url(server.url)
        assert [c.claim for c in chunks_of(admin, q.reply_key(GATEWAY), "r")] == [True]  # the claim, nothing else
        assert admin.xpending(q.REQUESTS, q.GROUP)["pending"] == 0 and admin.xlen(q.REQUESTS) == 0
        admin.close()


def test_a_request_resumes_where_its_gateway_says_and_the_client_gets_every_token_once(server):
    request = _request("r")
    with _gateway(server.url) as (client, loop):
        dead = _worker(server.url)
        dead.queue.redis.zadd(q.WORKERS, {"w1": time.time() + 300})  # live, as its heartbeat would say

        async def admit() -> None:
            await client.submit(request)
        asyncio.run_coroutine_threadsafe(admit(), loop).result(10)
        dead._iteration()  # takes it, writes the first token
        dead._iteration()  # and the second, then dies
        time.sleep(CONFIG.worker_timeout + 0.05)
        reading = asyncio.run_coroutine_threadsafe(_read(client, request), loop)
        taker = WorkerService(cast(Engine, ClockEngine(max_num_seqs=4, step_ms=0.0, tokens_per_step=1)), CONFIG,
                              server.url, worker_id="w2")
        taker._iteration()  # reclaims, claims, gets the fold: 2 tokens sent, and resumes after them
        assert "r" in taker.running and taker.running["r"].attempt == 2
        while taker.engine.has_unfinished_requests():
            taker._iteration()
        assert reading.result(10) == [expected_token(request.prompt_token_ids, i) for i in range(MAX_TOKENS)]


async def _read(client: QueueClient, request: QueuedRequest) -> list[int]:
    log = None
    async for _deltas, out in client.outputs(request.request_id, 1, request.deadline):
        log = out
    assert log is not None and log.done and log.error is None
    return log.completions[0].token_ids
