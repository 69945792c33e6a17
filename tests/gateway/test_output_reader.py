"""The gateway's reader of output streams: every request it waits on is read by one XREAD a
tick, and each gets exactly its own stream's entries, in order."""

from __future__ import annotations

import asyncio
import time

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, CompletionDelta, encode
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient

N = 20  # requests waited on at once


def _write_outputs(client: redis.Redis, request_id: str, tokens: list[int]) -> None:
    """A worker's chunks: one token each, the last one final."""
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        chunk = Chunk(attempt=1, done=last, deltas=[CompletionDelta(index=0, start=i, token_ids=[token], text="t",
                                                                    finish_reason="length" if last else None)])
        client.xadd(q.output_key(request_id), {q.CHUNK_FIELD: encode(chunk)})


def test_requests_waiting_at_once_are_read_by_one_xread_each_their_own_tokens():
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        expected = {f"r{i}": [1000 * i + k for k in range(5 + i)] for i in range(N)}
        for request_id, tokens in expected.items():
            _write_outputs(admin, request_id, tokens)
        admin.config_resetstat()

        async def read_all() -> dict[str, list[int]]:
            client = QueueClient(server.url, ServeConfig(output_poll_interval=1.0))

            async def one(request_id: str) -> list[int]:
                log = None
                async for _deltas, out in client.outputs(request_id, 1, time.time() + 30):
                    log = out
                assert log is not None and log.done
                return log.completions[0].token_ids

            try:
                tokens = await asyncio.gather(*(one(r) for r in expected))
            finally:
                await client.close()
            return dict(zip(expected, tokens, strict=True))

        assert asyncio.run(read_all()) == expected
        stats = admin.info("commandstats")
        assert stats["cmdstat_xread"]["calls"] == 1  # all N streams, one command
        admin.close()


def test_an_idle_reader_waits_in_redis_and_hands_a_first_entry_over_at_once():
    """After a read that found nothing, the next one waits in Redis (XREAD BLOCK) for the
    first entry: it is handed over by that read, not at the next tick (5 s here)."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)

        async def scenario() -> list[int]:
            client = QueueClient(server.url, ServeConfig(output_poll_interval=5.0))

            async def one() -> list[int]:
                log = None
                async for _deltas, out in client.outputs("idle", 1, time.time() + 30):
                    log = out
                assert log is not None and log.done
                return log.completions[0].token_ids

            try:
                reading = asyncio.create_task(one())
                for _ in range(1000):  # until the reader's second read waits in Redis
                    if admin.info("clients")["blocked_clients"] == 1:
                        break
                    await asyncio.sleep(0.01)
                assert admin.info("commandstats")["cmdstat_xread"]["calls"] == 2
                final = Chunk(attempt=1, done=True, deltas=[CompletionDelta(index=0, start=0, token_ids=[7, 8, 9],
                                                                             text="t", finish_reason="length")])
                admin.xadd(q.output_key("idle"), {q.CHUNK_FIELD: encode(final)})  # one entry: one wake-up
                return await asyncio.wait_for(reading, 30)  # a guard: the tick would come after 5 s
            finally:
                await client.close()

        assert asyncio.run(scenario()) == [7, 8, 9]
        # the waiting read returned with the entry; the request then had all it waited for
        assert admin.info("commandstats")["cmdstat_xread"]["calls"] == 2
        admin.close()
