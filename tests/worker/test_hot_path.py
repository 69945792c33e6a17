"""The Redis commands of a worker's step, counted exactly: a worker that runs S streams
writes one transaction per step holding one XADD and one EXPIRE per gateway its requests
came from and nothing else (nothing per request), reads the request streams' names once, and ends each
request with its final chunk in that XADD and one ACK_IF_OWNER script. The engine is a
`ClockEngine` (no model), the worker the real `WorkerService`, the requests admitted by the
gateway's `QueueClient`, and the commands counted by the redis-server itself (`INFO
commandstats`) and at the client (what each pipeline held)."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest
import redis

from pagedserve.bench.fake_engine import ClockEngine, expected_token
from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, CompletionDelta, QueuedRequest, Reply
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


GATEWAY = "g1"  # the gateway id of the clients that admit and read (one after the other)


def _admit(url: str, count: int, gateway_id: str = GATEWAY, first: int = 0) -> list[QueuedRequest]:
    async def admit() -> list[QueuedRequest]:
        client = QueueClient(url, CONFIG, gateway_id)
        try:
            requests = [QueuedRequest(request_id=f"r{i}", prompt_token_ids=_prompt(i), deadline=time.time() + 120,
                                      params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                        for i in range(first, first + count)]
            for request in requests:
                await client.submit(request)
            return requests
        finally:
            await client.close()

    return asyncio.run(admit())


def _outputs(url: str, requests: list[QueuedRequest], gateway_id: str = GATEWAY) -> dict[str, list[int]]:
    """Every request's tokens as their gateway reads them (from its reply stream's start)."""
    async def read() -> dict[str, list[int]]:
        client = QueueClient(url, CONFIG, gateway_id)
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


def _replies(admin: redis.Redis, gateway_id: str = GATEWAY) -> list[list[Reply]]:
    """The entries of a gateway's reply stream, decoded."""
    return [q.decode_replies(fields[q.REPLIES_FIELD]) for _, fields in admin.xrange(q.reply_key(gateway_id))]


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_a_step_of_a_worker_with_s_streams_sends_one_xadd_and_nothing_more(server, monkeypatch, tokens_per_step):
    service, engine = _worker(server.url, tokens_per_step)
    requests = _admit(server.url, S)
    admin = redis.Redis.from_url(server.url)
    service._iteration()  # takes the S requests and makes their first step
    assert engine.scheduler.num_running == S and engine.num_steps == 1
    counted = _Counted(monkeypatch)
    steps = MAX_TOKENS // tokens_per_step - 2  # every request runs through all of them
    admin.config_resetstat()
    for _ in range(steps):
        service._iteration()
    assert _commands(admin) == {"multi": steps, "xadd": steps, "expire": steps, "exec": steps, "smembers": steps,
                                "zrangebyscore": steps}
    # per step: one read of the streams' names, then one write: one XADD for the S streams, its TTL
    assert counted.pipelines == [["SMEMBERS", "ZRANGEBYSCORE"], ["XADD", "EXPIRE"]] * steps
    last = _replies(admin)[-1]
    assert [r.request_id for r in last] == [r.request_id for r in requests]  # every stream's chunk, in one entry
    assert all(len(r.chunk.deltas[0].token_ids) == tokens_per_step for r in last)  # a step's tokens, one delta

    # the last step: every final chunk in the one XADD, then each request's ack, in one transaction
    counted.pipelines.clear()
    admin.config_resetstat()
    service._iteration()
    assert engine.num_finished == S
    assert counted.pipelines == [["SMEMBERS", "ZRANGEBYSCORE"], ["XADD", "EXPIRE"] + ["EVALSHA"] * S]
    stats = _commands(admin)
    assert {name: stats.pop(name) for name in ("multi", "exec", "evalsha", "xadd", "expire", "xpending", "xack",
                                               "xdel")} == {
        "multi": 1, "exec": 1, "evalsha": S, "xadd": 1, "expire": 1, "xpending": S, "xack": S, "xdel": S}
    assert stats == {"smembers": 1, "zrangebyscore": 1}
    assert all(r.chunk.done for r in _replies(admin)[-1])
    assert admin.xlen(q.REQUESTS) == 0  # every entry acknowledged and deleted
    assert 0 < admin.ttl(q.reply_key(GATEWAY)) <= q.OUTPUT_TTL

    # and the gateway reads every token exactly once, in order
    assert _outputs(server.url, requests) == {
        r.request_id: [expected_token(r.prompt_token_ids, i) for i in range(MAX_TOKENS)] for r in requests}
    admin.close()


def test_a_step_writes_one_entry_per_gateway(server, monkeypatch):
    """Requests of two gateways: one XADD into each reply stream per step, each entry holding
    only that gateway's requests, and each gateway reads exactly its own."""
    service, engine = _worker(server.url, 1)
    ours = _admit(server.url, S // 2, "g1")
    theirs = _admit(server.url, S // 2, "g2", first=S // 2)
    admin = redis.Redis.from_url(server.url)
    service._iteration()
    counted = _Counted(monkeypatch)
    service._iteration()
    assert counted.pipelines == [["SMEMBERS", "ZRANGEBYSCORE"], ["XADD", "EXPIRE", "XADD", "EXPIRE"]]
    assert {r.request_id for r in _replies(admin, "g1")[-1]} == {r.request_id for r in ours}
    assert {r.request_id for r in _replies(admin, "g2")[-1]} == {r.request_id for r in theirs}
    for _ in range(MAX_TOKENS - 2):
        service._iteration()
    assert engine.num_finished == S
    for gateway, requests in (("g1", ours), ("g2", theirs)):
        assert _outputs(server.url, requests, gateway) == {
            r.request_id: [expected_token(r.prompt_token_ids, i) for i in range(MAX_TOKENS)] for r in requests}
    admin.close()


REPLY_TO = q.reply_key(GATEWAY)


def _delta(start: int, text: str = "a", finish_reason: str | None = None) -> CompletionDelta:
    return CompletionDelta(index=0, start=start, token_ids=[start], text=text, finish_reason=finish_reason)


def test_chunks_made_before_one_flush_are_one_reply(server):
    service, _engine = _worker(server.url, 1)
    outbox = service.queue.outbox
    for start in range(3):
        outbox.send("m", REPLY_TO, Chunk(attempt=1, deltas=[_delta(start)]))
    outbox.send("m", REPLY_TO, Chunk(attempt=1, deltas=[_delta(3, "b", "length")], done=True))
    outbox.flush()
    [[reply]] = _replies(service.queue.redis)
    assert reply.request_id == "m" and reply.chunk.done
    assert [d.token_ids for d in reply.chunk.deltas] == [[0], [1], [2], [3]]
    assert service.queue.redis.ttl(REPLY_TO) > 0


def test_a_final_chunk_is_written_and_acked_after_redis_forgot_the_scripts(server):
    """A Redis restart forgets the scripts: the pass loads them and acks what was refused."""
    service, engine = _worker(server.url, 1)
    [request] = _admit(server.url, 1)
    service._iteration()  # taken, first token out
    service.queue.redis.script_flush()
    for _ in range(MAX_TOKENS - 1):
        service._iteration()
    assert engine.num_finished == 1
    assert service.queue.redis.xlen(q.REQUESTS) == 0  # acknowledged (the ack ran after the reload)
    assert _outputs(server.url, [request]) == {
        "r0": [expected_token(request.prompt_token_ids, i) for i in range(MAX_TOKENS)]}


def test_with_an_output_interval_a_running_request_writes_its_first_and_last_chunks_only(server, monkeypatch):
    """An interval longer than the request: the first step's chunks go at once (the client's
    first token is not held back), the steps after it write nothing, and the final chunk
    carries every token since, merged: still exactly the tokens made, in order."""
    engine = ClockEngine(max_num_seqs=S, step_ms=0.0, tokens_per_step=1)
    config = ServeConfig(heartbeat_interval=60.0, worker_timeout=200.0, output_interval=60.0)
    service = WorkerService(cast(Engine, engine), config, server.url, worker_id="w1")
    service.queue.redis.zadd(q.WORKERS, {"w1": time.time() + 300})
    requests = _admit(server.url, S)
    admin = redis.Redis.from_url(server.url)
    service._iteration()
    assert admin.xlen(REPLY_TO) == 1 and len(_replies(admin)[0]) == S
    counted = _Counted(monkeypatch)
    admin.config_resetstat()
    for _ in range(MAX_TOKENS - 2):
        service._iteration()
    assert _commands(admin) == {"smembers": MAX_TOKENS - 2, "zrangebyscore": MAX_TOKENS - 2}  # nothing written
    service._iteration()  # the last step
    assert counted.pipelines[-1] == ["XADD", "EXPIRE"] + ["EVALSHA"] * S and engine.num_finished == S
    assert admin.xlen(REPLY_TO) == 2
    assert all(len(r.chunk.deltas) == MAX_TOKENS - 1 for r in _replies(admin)[1])
    assert _outputs(server.url, requests) == {
        r.request_id: [expected_token(r.prompt_token_ids, i) for i in range(MAX_TOKENS)] for r in requests}
    admin.close()


def test_a_chunk_held_back_is_dropped_when_its_client_goes_away(server):
    service, _engine = _worker(server.url, 1)
    outbox = service.queue.outbox
    outbox.interval = 60.0
    outbox.send("c", REPLY_TO, Chunk(attempt=1, deltas=[_delta(0)]))
    outbox.flush()  # the first chunk goes at once
    outbox.send("c", REPLY_TO, Chunk(attempt=1, deltas=[_delta(1)]))
    outbox.flush()  # held back
    assert service.queue.redis.xlen(REPLY_TO) == 1 and len(outbox._writes) == 1
    outbox.drop("c")
    outbox.flush()
    assert service.queue.redis.xlen(REPLY_TO) == 1 and outbox._writes == []


def test_every_entry_renews_its_reply_streams_ttl(server, monkeypatch):
    """One EXPIRE per gateway and step, not per request: a reply stream lives OUTPUT_TTL past
    the last entry written to it, also when Redis came back without it (a restart)."""
    service, _engine = _worker(server.url, 1)
    outbox, client = service.queue.outbox, service.queue.redis
    counted = _Counted(monkeypatch)
    outbox.send("t", REPLY_TO, Chunk(attempt=1, deltas=[_delta(0)]))
    outbox.send("u", REPLY_TO, Chunk(attempt=1, deltas=[_delta(0)]))
    outbox.flush()
    assert counted.pipelines == [["XADD", "EXPIRE"]]
    assert 0 < client.ttl(REPLY_TO) <= q.OUTPUT_TTL
    client.flushall()  # as a Redis restarted without persistence
    outbox.send("t", REPLY_TO, Chunk(attempt=1, deltas=[_delta(1)]))
    outbox.flush()
    assert 0 < client.ttl(REPLY_TO) <= q.OUTPUT_TTL


def test_a_transaction_refused_whole_is_written_again_at_the_next_flush(server, monkeypatch):
    """Redis refused the transaction at EXEC (EXECABORT: full when it ran, or read-only during
    a failover): nothing of it was written, so all of it waits for the next flush."""
    service, _engine = _worker(server.url, 1)
    [request] = _admit(server.url, 1)
    [taken] = service.queue.reader.pull(1, None)
    outbox = service.queue.outbox
    outbox.finish("r0", REPLY_TO, Chunk(attempt=1, deltas=[_delta(0, "a", "length")], done=True),
                  taken.stream, taken.entry_id)
    execute = redis.client.Pipeline.execute
    refused = []

    def refuse_once(pipe, raise_on_error=True):
        if not refused:
            refused.append(True)
            raise redis.exceptions.ExecAbortError("EXECABORT Transaction discarded because of: OOM")
        return execute(pipe, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", refuse_once)
    with pytest.raises(redis.exceptions.ExecAbortError):
        outbox.flush()
    assert service.queue.redis.xlen(q.REQUESTS) == 1 and not service.queue.redis.exists(REPLY_TO)
    outbox.flush()
    assert [r.chunk.done for r in _replies(service.queue.redis)[0]] == [True]
    assert service.queue.redis.xlen(q.REQUESTS) == 0  # acknowledged with it
    assert request.request_id == "r0"
