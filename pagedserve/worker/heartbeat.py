"""`Heartbeat`: the thread that tells the cluster this worker lives. Every heartbeat_interval
it renews the worker's place in the worker set and its `WorkerInfo`, keeps the entries of
the requests it runs fresh (so XAUTOCLAIM moves only the entries of a worker that stopped)
and their admitted markers alive, and collects the entries it finds in another worker's
hands (`lost_entries`). It beats only while the step loop moves: a frozen loop looks dead.
`others_accepting` reads the other workers' heartbeats: whether a draining worker has
anyone to hand its requests back to.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import WorkerInfo, decode_worker_info, encode
from pagedserve.common.serve_config import ServeConfig

logger = logging.getLogger(__name__)

#: the idle time `release` gives an entry (ms): above any worker_timeout
_RELEASED_IDLE_MS = 30 * 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class OwnedEntry:
    """A request this worker runs, as its heartbeat keeps it."""

    stream: str
    entry_id: str
    request_id: str


class Heartbeat:
    def __init__(self, client: redis.Redis, config: ServeConfig, worker_id: str, stopped: threading.Event):
        self.redis = client
        self.config = config
        self.worker_id = worker_id
        self._stopped = stopped  # the consumer's: set, the thread ends
        self._script = client.register_script(q.HEARTBEAT)
        self._owned: tuple[OwnedEntry, ...] = ()  # for the heartbeat thread (swapped whole)
        self._lost: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # (stream, entry id) another worker took
        self._thread: threading.Thread | None = None
        self._beating = True  # False while the step loop is stalled (see start)

    def set_owned(self, entries: Iterable[OwnedEntry]) -> None:
        """The entries the heartbeat keeps fresh (swapped whole: the thread reads it whole)."""
        self._owned = tuple(entries)

    def lost_entries(self) -> set[tuple[str, str]]:
        """Entries the heartbeat found in another worker's hands."""
        lost = set()
        while not self._lost.empty():
            lost.add(self._lost.get())
        return lost

    def others_accepting(self) -> bool:
        """Whether another live worker takes requests (its heartbeat is fresh and it is not
        draining). Unreadable Redis: False (nobody to hand requests to)."""
        try:
            ids = cast("list[bytes]", self.redis.zrangebyscore(q.WORKERS, time.time(), "+inf"))
            others = [i.decode() for i in ids if i.decode() != self.worker_id]
            blobs = cast("list[bytes | None]", self.redis.mget([q.worker_key(i) for i in others])) if others else []
        except redis.RedisError as exc:
            logger.warning("worker %s: cannot read the other workers' heartbeats: %s", self.worker_id, exc)
            return False
        return any(blob is not None and not decode_worker_info(blob).draining for blob in blobs)

    def release(self, entries: Iterable[tuple[str, str]]) -> None:
        """Make these entries (stream, entry id) of this worker claimable at once: their idle
        time set as if their owner had been silent for weeks, so the next XAUTOCLAIM of another
        worker takes them without waiting worker_timeout. JUSTID: their delivery count stays."""
        pipe = self.redis.pipeline(transaction=False)
        for stream, entry_id in entries:
            pipe.xclaim(stream, q.GROUP, self.worker_id, 0, [entry_id], idle=_RELEASED_IDLE_MS, justid=True)
        try:
            pipe.execute()
        except redis.RedisError as exc:  # they move after worker_timeout all the same
            logger.warning("worker %s: releasing its entries failed: %s", self.worker_id, exc)

    def start(self, info: Callable[[], WorkerInfo], alive: Callable[[], bool] = lambda: True) -> None:
        """Beat every heartbeat_interval while `alive()` (the worker's step loop is moving): a
        frozen loop stops beating, and its entries move to other workers after worker_timeout."""
        self._thread = threading.Thread(target=self._loop, args=(info, alive), name="heartbeat", daemon=True)
        self._thread.start()

    def _loop(self, info: Callable[[], WorkerInfo], alive: Callable[[], bool]) -> None:
        ttl_ms = int(self.config.worker_timeout * 1000)
        marker_ttl = int(self.config.request_timeout) + 60
        while not self._stopped.is_set():
            if not self._loop_alive(alive):
                self._stopped.wait(self.config.heartbeat_interval)
                continue
            owned = [x for e in self._owned for x in (e.stream, e.entry_id, q.admitted_key(e.request_id))]
            try:
                lost = self._script(keys=[q.WORKERS, q.worker_key(self.worker_id)],
                                    args=[q.GROUP, self.worker_id, ttl_ms, encode(info()), marker_ttl, *owned])
                for stream, entry_id in zip(lost[::2], lost[1::2], strict=True):
                    self._lost.put((stream.decode(), entry_id.decode()))
            except redis.ResponseError as exc:
                logger.error("heartbeat failed: %s", exc)
            except redis.RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)
            self._stopped.wait(self.config.heartbeat_interval)

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

    def leave(self) -> None:
        """Once the consumer is stopped: let the thread end, then leave the worker set."""
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            self.redis.zrem(q.WORKERS, self.worker_id)
            self.redis.delete(q.worker_key(self.worker_id))
