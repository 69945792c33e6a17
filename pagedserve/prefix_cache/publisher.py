"""`KVEventPublisher`: a worker's side of the cluster index.

Once per engine step the worker service calls `publish()`. It takes the pool's events since
the last call and, if there are any, sends them as one `KVEventBatch` to a capped Redis
stream. A consumer that lost track of this worker (a gap, a restart, its own restart) sets
this worker's snapshot key; the publisher checks it at most every `snapshot_check_interval`
seconds and answers with a snapshot batch of every hash the pool holds.

It never stops the step loop. If Redis fails, the batch is dropped and its sequence
number is spent, so the consumer sees a gap and asks for a snapshot.
"""

from __future__ import annotations

import logging
import time
import uuid

from redis import Redis
from redis.exceptions import RedisError

from pagedserve.prefix_cache.block_pool import BlockPool
from pagedserve.prefix_cache.events import BlockStored, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

#: the stream every worker's batches go to (field `batch`: msgpack `KVEventBatch`)
KV_EVENTS = "pagedserve:kv-events"


def snapshot_key(worker_id: str) -> str:
    """Set (with a short expiry) by a consumer that wants this worker's snapshot."""
    return f"pagedserve:kv-snapshot:{worker_id}"


class KVEventPublisher:
    def __init__(self, redis: Redis, worker_id: str, pool: BlockPool, block_size: int, max_len: int = 100_000,
                 snapshot_check_interval: float = 0.5):
        self.redis = redis
        self.worker_id = worker_id
        self.pool = pool
        self.block_size = block_size
        self.max_len = max_len  # the stream keeps about this many batches (XADD MAXLEN ~)
        self.snapshot_check_interval = snapshot_check_interval
        self.epoch = uuid.uuid4().hex  # this process's: its pool started empty
        self.seq = -1
        self.num_failed = 0  # batches Redis did not take
        self._next_check = 0.0
        pool.record_events = True

    def publish(self, now: float | None = None) -> None:
        """Send what the pool changed since the last call (a snapshot instead, if asked)."""
        now = time.monotonic() if now is None else now
        snapshot = False
        if now >= self._next_check:
            self._next_check = now + self.snapshot_check_interval
            try:
                snapshot = bool(self.redis.delete(snapshot_key(self.worker_id)))
            except RedisError as exc:
                logger.warning("could not check for a KV snapshot request: %s", exc)
        events = self.pool.take_events()
        if snapshot:  # every hash held now: the events are part of it
            events = [BlockStored(h, None, self.block_size) for h in self.pool.cached_hashes()]
        elif not events:
            return
        self.seq += 1
        batch = KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, seq=self.seq, sent_at=time.time(),
                             events=events, snapshot=snapshot)
        try:
            self.redis.xadd(KV_EVENTS, {"batch": encode_batch(batch)}, maxlen=self.max_len, approximate=True)
        except RedisError as exc:  # the spent seq is the gap the consumer will see
            self.num_failed += 1
            logger.warning("KV event batch %d not sent (%s); the index will ask for a snapshot", self.seq, exc)
