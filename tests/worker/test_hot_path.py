"""The Redis commands of a worker's step, counted exactly: a worker that runs S streams
writes one pipeline per step holding one XADD per stream and nothing else (no EXPIRE per
chunk), reads the request streams' names once, and ends each request with one FINISH
script (its final chunk, the TTL, the ack). The engine is a `ClockEngine` (no model), the
worker the real `WorkerService`, the requests admitted by the gateway's `QueueClient`, and
the commands counted by the redis-server itself (`INFO commandstats`) and at the client
(what each pipeline held)."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest
import redis

from pagedserve.bench.fake_engine import ClockEngine, expected_token
from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, CompletionDelta, QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.engine.engine import Engine
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.worker.service import WorkerService

S = 8  # streams of the worker
MAX_TOKENS = 12

# No heartbeat thread (the test drives the loop itself) and no reclaim pass between steps.
CONFIG = ServeConfig(heartbeat_interval=60.0, worker_timeout=200.0)


@pytest.fixture()
def server():
    with EmbeddedRedis() as s:
        yield s


def _prompt(i: int) -> list[int]:
    return [100 + i, 5, 6]


def _admit(url: str, count: int) -> list[QueuedRequest]:
    async def admit() -> list[QueuedRequest]:
        client = QueueClient(url, CONFIG)
        try:
            requests = [QueuedRequest(request_id=f"r{i}", prompt_token_ids=_prompt(i), deadline=time.time() + 120,
                                      params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                        for i in range(count)]
            for request in requests:
                await client.submit(request)
            return requests
        finally:
            await client.close()

    return asyncio.run(admit())


def _outputs(url: str, requests: list[QueuedRequest]) -> dict[str, list[int]]:
    """Every request's tokens as the gateway reads them."""
    async def read() -> dict[str, list[int]]:
        client = QueueClient(url, CONFIG)
        try:
            async def one(r: QueuedRequest) -> list[int]:
                log = None
                async for _deltas, out in client.outputs(r.request_id, 1, r.deadline):
                    log = out
                assert log is not None and log.done and log.error is None
                return log.completions[0].token_ids
            tokens = await asyncio.gather(*(one(r) for r in requests))
            return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}
        finally:
            await client.close()

    return asyncio.run(read())


class _Counted:
    """What the worker's pipelines held, one list of command names per round trip."""

    def __init__(self, monkeypatch):
        self.pipelines: list[list[str]] = []
        execute = redis.client.Pipeline.execute
        counted = self

        def counting_execute(pipe, raise_on_error=True):
            counted.pipelines.append([str(args[0]).upper() for args, _ in pipe.command_stack])
            return execute(pipe, raise_on_error)

        monkeypatch.setattr(redis.client.Pipeline, "execute", counting_execute)


def _commands(admin: redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()
            if name not in ("cmdstat_config|resetstat", "cmdstat_info")}


def _worker(url: str, tokens_per_step: int) -> tuple[WorkerService, ClockEngine]:
    engine = ClockEngine(max_num_seqs=S, step_ms=0.0, tokens_per_step=tokens_per_step)
    service = WorkerService(cast(Engine, engine), CONFIG, url, worker_id="w1")
    service.queue.redis.zadd(q.WORKERS, {"w1": time.time() + 300})  # live, as its heartbeat would say
    return service, engine


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_a_step_of_a_worker_with_s_streams_sends_one_xadd_per_stream_and_nothing_more(server, monkeypatch,
                                                                                       tokens_per_step):
    service, engine = _worker(server.url, tokens_per_step)
    requests = _admit(server.url, S)
    admin = redis.Redis.from_url(server.url)
    service._iteration()  # takes the S requests and makes their first step (the TTLs are set here)
    assert engine.scheduler.num_running == S and engine.num_steps == 1
    counted = _Counted(monkeypatch)
    steps = MAX_TOKENS // tokens_per_step - 2  # every request runs through all of them
    admin.config_resetstat()
    for _ in range(steps):
        service._iteration()
    assert _commands(admin) == {"xadd": S * steps, "smembers": steps, "zrangebyscore": steps}
    # per step: one read of the streams' names, then one write: an XADD per stream
    assert counted.pipelines == [["SMEMBERS", "ZRANGEBYSCORE"], ["XADD"] * S] * steps
    entry = admin.xrevrange(q.output_key("r0"), count=1)[0][1][q.CHUNK_FIELD]
    assert len(q.decode_chunk(entry).deltas[0].token_ids) == tokens_per_step  # a step's tokens, one entry

    # the last step: each request's final chunk, TTL and ack in one script
    counted.pipelines.clear()
    admin.config_resetstat()
    service._iteration()
    assert engine.num_finished == S
    assert counted.pipelines == [["SMEMBERS", "ZRANGEBYSCORE"], ["EVALSHA"] * S]
    stats = _commands(admin)
    assert {name: stats.pop(name) for name in ("evalsha", "xadd", "expire", "xpending", "xack", "xdel")} == {
        "evalsha": S, "xadd": S, "expire": S, "xpending": S, "xack": S, "xdel": S}
    assert stats == {"smembers": 1, "zrangebyscore": 1}
    assert admin.xlen(q.REQUESTS) == 0  # every entry acknowledged and deleted
    assert all(0 < admin.ttl(q.output_key(r.request_id)) <= q.OUTPUT_TTL for r in requests)

    # and the gateway reads every token exactly once, in order
    assert _outputs(server.url, requests) == {
        r.request_id: [expected_token(r.prompt_token_ids, i) for i in range(MAX_TOKENS)] for r in requests}
    admin.close()


def test_chunks_made_before_one_flush_are_one_entry(server):
    service, _engine = _worker(server.url, 1)
    outbox = service.queue.outbox
    for start in range(3):
        outbox.send("m", Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=start, token_ids=[start], text="a")]))
    outbox.send("m", Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=3, token_ids=[3], text="b",
                                                              finish_reason="length")], done=True))
    outbox.flush()
    [(_, fields)] = service.queue.redis.xrange(q.output_key("m"))
    chunk = q.decode_chunk(fields[q.CHUNK_FIELD])
    assert chunk.done and [d.token_ids for d in chunk.deltas] == [[0], [1], [2], [3]]
    assert service.queue.redis.ttl(q.output_key("m")) > 0


def test_a_final_chunk_is_written_and_acked_after_redis_forgot_the_scripts(server):
    """A Redis restart forgets the scripts: the pass loads them and writes what was refused."""
    service, engine = _worker(server.url, 1)
    [request] = _admit(server.url, 1)
    service._iteration()  # taken, first token out
    service.queue.redis.script_flush()
    for _ in range(MAX_TOKENS - 1):
        service._iteration()
    assert engine.num_finished == 1
    assert service.queue.redis.xlen(q.REQUESTS) == 0  # acknowledged (FINISH ran after the reload)
    assert _outputs(server.url, [request]) == {
        "r0": [expected_token(request.prompt_token_ids, i) for i in range(MAX_TOKENS)]}


def test_with_an_output_interval_a_running_request_writes_its_first_and_last_chunks_only(server, monkeypatch):
    """An interval longer than the request: the first step's chunk goes at once (the client's
    first token is not held back), the steps after it write nothing, and the final chunk
    carries every token since, merged: still exactly the tokens made, in order."""
    engine = ClockEngine(max_num_seqs=S, step_ms=0.0, tokens_per_step=1)
    config = ServeConfig(heartbeat_interval=60.0, worker_timeout=200.0, output_interval=60.0)
    service = WorkerService(cast(Engine, engine), config, server.url, worker_id="w1")
    service.queue.redis.zadd(q.WORKERS, {"w1": time.time() + 300})
    requests = _admit(server.url, S)
    admin = redis.Redis.from_url(server.url)
    service._iteration()
    assert all(admin.xlen(q.output_key(r.request_id)) == 1 for r in requests)
    counted = _Counted(monkeypatch)
    admin.config_resetstat()
    for _ in range(MAX_TOKENS - 2):
        service._iteration()
    assert _commands(admin) == {"smembers": MAX_TOKENS - 2, "zrangebyscore": MAX_TOKENS - 2}  # nothing written
    service._iteration()  # the last step
    assert counted.pipelines[-1] == ["EVALSHA"] * S and engine.num_finished == S
    assert all(admin.xlen(q.output_key(r.request_id)) == 2 for r in requests)
    assert _outputs(server.url, requests) == {
        r.request_id: [expected_token(r.prompt_token_ids, i) for i in range(MAX_TOKENS)] for r in requests}
    admin.close()


def test_a_chunk_held_back_is_dropped_when_its_client_goes_away(server):
    service, _engine = _worker(server.url, 1)
    outbox = service.queue.outbox
    outbox.interval = 60.0
    first = Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=0, token_ids=[1], text="a")])
    outbox.send("c", first)
    outbox.flush()  # the first chunk goes at once
    outbox.send("c", Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=1, token_ids=[2], text="b")]))
    outbox.flush()  # held back
    assert service.queue.redis.xlen(q.output_key("c")) == 1
    outbox.delete_output("c")
    outbox.flush()
    assert not service.queue.redis.exists(q.output_key("c")) and outbox._writes == []


def test_a_chunk_after_its_stream_was_deleted_creates_it_again_only_with_a_ttl(server, monkeypatch):
    """The gateway deletes a request's output stream when its client leaves, and the worker
    may write a chunk before it hears of that: the stream must not come back without a TTL
    (it would outlive every request). A later chunk is XADD NOMKSTREAM; finding no stream,
    it is written again as a first chunk, XADD and EXPIRE."""
    service, _engine = _worker(server.url, 1)
    outbox, client = service.queue.outbox, service.queue.redis
    key = q.output_key("gone")

    def chunk(start: int) -> Chunk:
        return Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=start, token_ids=[start], text="a")])

    outbox.send("gone", chunk(0))
    outbox.flush()
    assert client.xlen(key) == 1 and 0 < client.ttl(key) <= q.OUTPUT_TTL
    outbox.send("gone", chunk(1))
    outbox.flush()  # a later chunk, while the stream is there: one XADD, nothing more
    assert client.xlen(key) == 2
    client.unlink(key)  # as QueueClient.cancel does
    counted = _Counted(monkeypatch)
    outbox.send("gone", chunk(2))
    outbox.flush()
    assert counted.pipelines == [["XADD"], ["XADD", "EXPIRE"]]
    assert client.xlen(key) == 1 and 0 < client.ttl(key) <= q.OUTPUT_TTL
    outbox.delete_output("gone")  # the cancellation reaches the worker
    outbox.flush()
    assert not client.exists(key)
