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
