"""`Outbox`: what the worker writes back to Redis. Output chunks and acknowledgements wait
here until `flush` writes them in one round trip per pass: chunks first, then acks, so an
entry is acknowledged only once its final chunk is written. Everything is kept for a retry
while Redis is away or full; an ack goes through only for the worker that owns the entry
(the ACK_IF_OWNER script).
"""

from __future__ import annotations

import logging

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, encode

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, client: redis.Redis, worker_id: str):
        self.redis = client
        self.worker_id = worker_id
        self._ack_if_owner = client.register_script(q.ACK_IF_OWNER)
        self._outbox: list[tuple[str, bytes]] = []  # (output key, chunk; b"": delete) not yet written
        self._acks: list[tuple[str, str]] = []  # (stream, entry id) to acknowledge with the next write

    def send(self, request_id: str, chunk: Chunk) -> None:
        self._outbox.append((q.output_key(request_id), encode(chunk)))

    def delete_output(self, request_id: str) -> None:
        self._outbox.append((q.output_key(request_id), b""))

    def ack(self, stream: str, entry_id: str) -> None:
        self._acks.append((stream, entry_id))

    def flush(self) -> None:
        """Write queued chunks, then acks. Everything is kept for a retry while Redis is away
        (connection errors raise) or full (its OOM error is raised): an entry is never
        acknowledged before its final chunk is written."""
        if self._outbox:
            pipe = self.redis.pipeline(transaction=False)
            for key, data in self._outbox:
                if data:
                    pipe.xadd(key, {q.CHUNK_FIELD: data})
                    pipe.expire(key, q.OUTPUT_TTL)
                else:
                    pipe.delete(key)
            results = pipe.execute(raise_on_error=False)
            full = [r for r in results if isinstance(r, redis.exceptions.OutOfMemoryError)]
            if full:
                # All chunks are written again: the readers' OutputLog takes a delta only
                # where its completion stands, so a chunk written twice counts once.
                raise full[0]
            self._outbox.clear()
            for result in results:
                if isinstance(result, Exception):
                    logger.error("redis write failed: %s", result)
        if self._acks:
            pipe = self.redis.pipeline(transaction=False)
            for stream, entry_id in self._acks:
                tenant = q.tenant_stream_of(stream)
                self._ack_if_owner(keys=[stream, q.TENANT_ROUTED],
                                   args=[q.GROUP, self.worker_id, entry_id, "" if tenant == stream else tenant],
                                   client=pipe)
            results = pipe.execute(raise_on_error=False)
            self._acks.clear()
            for result in results:
                # After a Redis restart the group is gone and acks fail: nothing is left to ack.
                if isinstance(result, Exception) and "NOGROUP" not in str(result):
                    logger.error("redis ack failed: %s", result)
