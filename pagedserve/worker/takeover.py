"""`Takeover`: how a worker takes over the requests of a worker that stopped. Its heartbeat
stopped, so its entries went idle: `reclaim` moves them to this worker (XAUTOCLAIM, from
every request stream), each with its delivery count. Before it resumes one, `claim_output`
fences the old owner off in the request's output stream and reads what the client has been
sent, so that the request goes on from there. (The other way round, an entry of this worker
that another one took, is what the heartbeat reports: `Heartbeat.lost_entries`.)
"""

from __future__ import annotations

import logging
from typing import cast

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, OutputLog, StreamEntry, decode_chunk, encode
from pagedserve.common.serve_config import ServeConfig
from pagedserve.worker.outbox import Outbox
from pagedserve.worker.request_reader import RequestReader, TakenEntry

logger = logging.getLogger(__name__)


class Takeover:
    def __init__(self, client: redis.Redis, config: ServeConfig, worker_id: str, reader: RequestReader,
                 outbox: Outbox):
        self.redis = client
        self.config = config
        self.worker_id = worker_id
        self._reader = reader  # decodes what it reclaims
        self._outbox = outbox  # flushed before a claim: pending writes go first

    def reclaim(self, room: int) -> list[TakenEntry]:
        """Up to `room` entries of workers whose heartbeat stopped, now this worker's (from
        every request stream: the tenant ones and the routed ones, of any worker)."""
        claimed: list[tuple[str, str, dict[bytes, bytes], int]] = []
        for stream in q.request_streams(cast("set[bytes]", self.redis.smembers(q.TENANTS))):
            if len(claimed) >= room:
                break
            try:
                reply = self.redis.xautoclaim(stream, q.GROUP, self.worker_id, count=room - len(claimed),
                                              min_idle_time=int(self.config.worker_timeout * 1000))
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue
            for entry_id, fields in reply[1]:
                if not fields:
                    continue
                entry_id = entry_id.decode()
                pending = self.redis.xpending_range(stream, q.GROUP, min=entry_id, max=entry_id, count=1)
                attempt = cast(int, pending[0]["times_delivered"]) if pending else 2
                logger.warning("worker %s takes over entry %s of %s (delivery %d)", self.worker_id, entry_id, stream, attempt)
                claimed.append((stream, entry_id, fields, attempt))
        return self._reader.decoded(claimed)

    def claim_output(self, request_id: str, attempt: int, n: int) -> OutputLog:
        """Fence older attempts off in the request's output stream, then fold what the
        client has been sent (pending writes go first)."""
        self._outbox.flush()
        key = q.output_key(request_id)
        claim_id = self.redis.xadd(key, {q.CHUNK_FIELD: encode(Chunk(attempt=attempt, claim=True))})
        log = OutputLog(n)
        for _, fields in cast("list[StreamEntry]", self.redis.xrange(key, "-", claim_id)):
            log.apply(decode_chunk(fields[q.CHUNK_FIELD]))
        return log
