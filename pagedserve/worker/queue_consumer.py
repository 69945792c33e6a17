"""`QueueConsumer`: the worker's side of the Redis queue, mirroring the gateway's
`QueueClient`. It reads requests, takes over those of dead workers, writes output chunks,
acknowledges entries, listens for cancellations and keeps the heartbeat.

Its promises (the gateway relies on them):
- an entry is acknowledged only at its final outcome, and only by the worker that owns it;
- a heartbeat thread keeps the worker's entries fresh, so XAUTOCLAIM moves only the entries
  of a worker that stopped; before a new owner resumes a request it fences the old owner
  off in the output stream and reads what the client has been sent;
- writes are batched into one round trip per pass and kept for a retry while Redis is away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import msgspec
import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.config import ServeConfig
from pagedserve.common.errors import PagedServeError
from pagedserve.common.queue_protocol import (
    Chunk,
    OutputLog,
    QueuedRequest,
    StreamEntry,
    StreamRead,
    WorkerInfo,
    decode_chunk,
    decode_request,
    encode,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TakenEntry:
    """A request this worker took from the queue."""

    entry_id: str  # in the requests stream
    request: QueuedRequest
    attempt: int  # delivery count: 1 unless other workers died with it


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class QueueConsumer:
    def __init__(self, redis_url: str, config: ServeConfig, worker_id: str | None = None):
        self.config = config
        self.worker_id = worker_id or new_worker_id()
        self.redis = redis.Redis.from_url(redis_url, socket_connect_timeout=2, health_check_interval=10)
        self._count_taken = self.redis.register_script(q.TAKEN)
        self._ack_if_owner = self.redis.register_script(q.ACK_IF_OWNER)
        self._heartbeat_script = self.redis.register_script(q.HEARTBEAT)
        self._outbox: list[tuple[str, bytes]] = []  # (output key, chunk; b"": delete) not yet written
        self._acks: list[str] = []  # entry ids to acknowledge with the next write
        self._owned: tuple[str, ...] = ()  # entry ids, for the heartbeat thread (swapped whole)
        self._lost: queue.SimpleQueue[str] = queue.SimpleQueue()  # entries another worker took
        self._pubsub: redis.client.PubSub | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._beating = True  # False while the step loop is stalled (see start_heartbeat)

    # -- reading ------------------------------------------------------------------------------
    def pull(self, room: int, block_ms: int | None) -> list[TakenEntry]:
        """Up to `room` new requests, waiting up to `block_ms` when None are queued (None:
        do not wait). They are counted out of the queue's bounds at once."""
        try:
            reply = cast(StreamRead, self.redis.xreadgroup(q.GROUP, self.worker_id, {q.REQUESTS: ">"},
                                                           count=room, block=block_ms))
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()
            return []
        entries = [(eid, fields) for eid, fields in (reply[0][1] if reply else []) if fields]
        if not entries:
            return []
        num_tokens = sum(int(fields.get(q.PROMPT_TOKENS_FIELD, 0)) for _, fields in entries)
        self._count_taken(keys=[q.QUEUED, q.QUEUED_TOKENS], args=[len(entries), num_tokens])
        return self._decoded((eid.decode(), fields, 1) for eid, fields in entries)

    def reclaim(self, room: int) -> list[TakenEntry]:
        """Up to `room` entries of workers whose heartbeat stopped, now this worker's."""
        try:
            reply = self.redis.xautoclaim(q.REQUESTS, q.GROUP, self.worker_id,
                                          min_idle_time=int(self.config.worker_timeout * 1000), count=room)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()
            return []
        claimed: list[tuple[str, dict[bytes, bytes], int]] = []
        for entry_id, fields in reply[1]:
            if not fields:
                continue
            entry_id = entry_id.decode()
            pending = self.redis.xpending_range(q.REQUESTS, q.GROUP, min=entry_id, max=entry_id, count=1)
            attempt = cast(int, pending[0]["times_delivered"]) if pending else 2
            logger.warning("worker %s takes over entry %s (delivery %d)", self.worker_id, entry_id, attempt)
            claimed.append((entry_id, fields, attempt))
        return self._decoded(claimed)

    def _decoded(self, entries: Iterable[tuple[str, dict[bytes, bytes], int]]) -> list[TakenEntry]:
        taken = []
        for entry_id, fields, attempt in entries:
            try:
                request = decode_request(fields[q.REQUEST_FIELD])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError, PagedServeError) as exc:
                logger.error("dropping malformed queue entry %s: %s", entry_id, exc)
                self.ack(entry_id)
                continue
            taken.append(TakenEntry(entry_id, request, attempt))
        return taken

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(q.REQUESTS, q.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def is_cancelled(self, request_id: str) -> bool:
        """Whether the client left while the request was queued."""
        return bool(self.redis.exists(q.cancelled_key(request_id)))

    def cancellations(self) -> list[str]:
        """Request ids whose clients went away since the last call."""
        if self._pubsub is None:
            self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(q.CANCEL_CHANNEL)
        ids = []
        while (message := self._pubsub.get_message(timeout=0)) is not None:
            ids.append(message["data"].decode())
        return ids

    def lost_entries(self) -> set[str]:
        """Entries the heartbeat found in another worker's hands."""
        lost = set()
        while not self._lost.empty():
            lost.add(self._lost.get())
        return lost

    def claim_output(self, request_id: str, attempt: int, n: int) -> OutputLog:
        """Fence older attempts off in the request's output stream, then fold what the
        client has been sent (pending writes go first)."""
        self.flush()
        key = q.output_key(request_id)
        claim_id = self.redis.xadd(key, {q.CHUNK_FIELD: encode(Chunk(attempt=attempt, claim=True))})
        log = OutputLog(n)
        for _, fields in cast("list[StreamEntry]", self.redis.xrange(key, "-", claim_id)):
            log.apply(decode_chunk(fields[q.CHUNK_FIELD]))
        return log

    def connection_lost(self) -> None:
        """Redis went away: subscribe again once it is back."""
        self._pubsub = None

    # -- writing ------------------------------------------------------------------------------
    def send(self, request_id: str, chunk: Chunk) -> None:
        self._outbox.append((q.output_key(request_id), encode(chunk)))

    def delete_output(self, request_id: str) -> None:
        self._outbox.append((q.output_key(request_id), b""))

    def ack(self, entry_id: str) -> None:
        self._acks.append(entry_id)

    def flush(self) -> None:
        """Write queued chunks and acks in one round trip; kept for a retry if Redis is away."""
        if not self._outbox and not self._acks:
            return
        pipe = self.redis.pipeline(transaction=False)
        for key, data in self._outbox:
            if data:
                pipe.xadd(key, {q.CHUNK_FIELD: data})
                pipe.expire(key, q.OUTPUT_TTL)
            else:
                pipe.delete(key)
        for entry_id in self._acks:
            self._ack_if_owner(keys=[q.REQUESTS], args=[q.GROUP, self.worker_id, entry_id], client=pipe)
        results = pipe.execute(raise_on_error=False)  # connection errors raise: all is kept
        self._outbox.clear()
        self._acks.clear()
        for result in results:
            # After a Redis restart the group is gone and acks fail: nothing is left to ack.
            if isinstance(result, Exception) and "NOGROUP" not in str(result):
                logger.error("redis write failed: %s", result)

    # -- heartbeat ----------------------------------------------------------------------------
    def set_owned(self, entry_ids: Iterable[str]) -> None:
        """The entries the heartbeat keeps fresh (swapped whole: the thread reads it whole)."""
        self._owned = tuple(entry_ids)

    def start_heartbeat(self, info: Callable[[], WorkerInfo], alive: Callable[[], bool] = lambda: True) -> None:
        """Beat every heartbeat_interval while `alive()` (the worker's step loop is moving): a
        frozen loop stops beating, and its entries move to other workers after worker_timeout."""
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(info, alive), name="heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self, info: Callable[[], WorkerInfo], alive: Callable[[], bool]) -> None:
        ttl_ms = int(self.config.worker_timeout * 1000)
        while not self._stop.is_set():
            if not self._loop_alive(alive):
                self._stop.wait(self.config.heartbeat_interval)
                continue
            owned = self._owned
            try:
                lost = self._heartbeat_script(keys=[q.REQUESTS, q.WORKERS, q.worker_key(self.worker_id)],
                                              args=[q.GROUP, self.worker_id, ttl_ms, encode(info()), *owned])
                for entry_id in lost:
                    self._lost.put(entry_id.decode())
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    with contextlib.suppress(redis.RedisError):
                        self.ensure_group()
                else:
                    logger.error("heartbeat failed: %s", exc)
            except redis.RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)
            self._stop.wait(self.config.heartbeat_interval)

    def _loop_alive(self, alive: Callable[[], bool]) -> bool:
        """`alive()`, logging each change: a stalled loop is a worker that looks dead."""
        now_alive = alive()
        if now_alive != self._beating:
            if now_alive:
                logger.warning("worker %s: its step loop moves again; beating again", self.worker_id)
            else:
                logger.error("worker %s: its step loop has not completed a pass within %g s; heartbeat paused, "
                             "its requests move to other workers", self.worker_id, self.config.worker_timeout)
            self._beating = now_alive
        return now_alive

    def wait(self, seconds: float) -> bool:
        """Sleep, unless stopped; True when stopped."""
        return self._stop.wait(seconds)

    def stop(self) -> None:
        """Stop the heartbeat and leave the worker set."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            self.redis.zrem(q.WORKERS, self.worker_id)
            self.redis.delete(q.worker_key(self.worker_id))
