"""The prefix cache service: the cluster's `PrefixIndex`, fed by the workers' event batches
and asked by the gateways.

    pagedserve prefix-cache --redis-url URL [--host 127.0.0.1] [--port 8300] [--max-body-bytes N]

Two threads. The consumer reads `pagedserve:kv-events` (publisher.py), applies each batch,
and asks a worker for a snapshot (its snapshot key) whenever the index says it cannot
trust it. That happens on a gap, on a restart, and at the service's own start, when it
asks every live worker. Every `liveness_interval` it drops the workers whose heartbeat left
`pagedserve:workers`. The HTTP thread runs the service's Litestar app under uvicorn
(http_app.py): `POST /lookup` (a prompt's block hashes → the workers holding its leading
blocks), `GET /health`, `GET /metrics`, and the OpenAPI schema, with the gateway's error
shape and a bound on the body (`max_body_bytes`, by default `MAX_LOOKUP_HASHES` hashes).

A malformed batch is logged and counted, never applied. The service keeps nothing on disk:
after a restart it rebuilds from the snapshots it asks for. A gateway that cannot reach it
routes by load (the client raises, see index_client.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from redis.exceptions import RedisError

from pagedserve.common import queue_protocol as q
from pagedserve.common import redis_clients
from pagedserve.common.errors import InvalidParameterError
from pagedserve.prefix_cache.events import MalformedBatch, decode_batch
from pagedserve.prefix_cache.http_app import HASH_BYTES, MAX_LOOKUP_HASHES, create_app
from pagedserve.prefix_cache.http_server import HTTPServerThread
from pagedserve.prefix_cache.index import Applied, PrefixIndex
from pagedserve.prefix_cache.publisher import KV_EVENTS, snapshot_key

logger = logging.getLogger(__name__)

class PrefixCacheService:
    """`max_body_bytes`: the largest `/lookup` body, beyond it a 413 (None: `MAX_LOOKUP_HASHES`
    hashes); `keep_alive_timeout`: how long an idle HTTP connection stays open (seconds),
    longer than a gateway's client keeps one."""

    def __init__(self, redis_url: str, liveness_interval: float = 1.0, snapshot_ttl: float = 30.0,
                 max_body_bytes: int | None = None, keep_alive_timeout: int = 60):
        if max_body_bytes is not None and max_body_bytes < HASH_BYTES:
            raise InvalidParameterError("max_body_bytes", f"must be at least one hash ({HASH_BYTES} bytes)")
        if keep_alive_timeout < 1:
            raise InvalidParameterError("keep_alive_timeout", "must be at least 1 second")
        self.redis = redis_clients.sync_client(redis_url, socket_timeout=5)
        self.index = PrefixIndex()
        self.lock = threading.Lock()  # the consumer writes the index, the HTTP thread reads it
        self.liveness_interval = liveness_interval
        self.snapshot_ttl = snapshot_ttl
        self.max_body_bytes = max_body_bytes or MAX_LOOKUP_HASHES * HASH_BYTES
        self.keep_alive_timeout = keep_alive_timeout
        self.num_malformed = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.http: HTTPServerThread | None = None
        self.registry = CollectorRegistry()
        self._blocks = Gauge("pagedserve:prefix_index_blocks", "distinct block hashes indexed", registry=self.registry)
        self._workers = Gauge("pagedserve:prefix_index_workers", "workers known to the index", registry=self.registry)
        self._lag = Gauge("pagedserve:prefix_index_event_lag_seconds", "sending to applying, latest batch",
                          registry=self.registry)
        self._applied = Counter("pagedserve:prefix_index_batches", "event batches applied", registry=self.registry)
        self._gaps = Counter("pagedserve:prefix_index_gaps", "workers resynchronised (gap or restart)",
                             registry=self.registry)
        self._malformed = Counter("pagedserve:prefix_index_malformed", "batches refused", registry=self.registry)

    # -- the consumer -----------------------------------------------------------------------
    def consume_once(self, last_id: str, block_ms: int = 500) -> str:
        """Apply the batches after `last_id` (waiting up to block_ms); the new last id."""
        reply = cast(list, self.redis.xread({KV_EVENTS: last_id}, count=512, block=block_ms) or [])
        for _stream, entries in reply:
            for entry_id, fields in entries:
                last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._apply(fields.get(b"batch", b""))
        return last_id

    def _apply(self, data: bytes) -> None:
        try:
            batch = decode_batch(data)
        except MalformedBatch as exc:
            self.num_malformed += 1
            self._malformed.inc()
            logger.warning("ignored a malformed KV event batch: %s", exc)
            return
        with self.lock:
            gaps_before = self.index.stats.gaps
            result = self.index.apply(batch, now=time.time())
            self._gaps.inc(self.index.stats.gaps - gaps_before)
        if result is Applied.NEEDS_SNAPSHOT:
            self.ask_snapshot(batch.worker_id)
        elif result is Applied.APPLIED:
            self._applied.inc()

    def ask_snapshot(self, worker_id: str) -> None:
        self.redis.set(snapshot_key(worker_id), b"1", px=int(self.snapshot_ttl * 1000))

    def live_workers(self) -> set[str]:
        now = time.time()
        return {w.decode() for w in cast(list, self.redis.zrangebyscore(q.WORKERS, now, "+inf"))}

    def check_liveness(self) -> None:
        """Forget the workers whose heartbeat is gone."""
        live = self.live_workers()
        with self.lock:
            for worker in set(self.index.workers()) - live:
                logger.info("worker %s is gone: its cached blocks leave the index", worker)
                self.index.remove_worker(worker)

    def _consume_loop(self) -> None:
        last_id = "$"  # only what comes from now on: the snapshots asked for below cover the past
        asked = False
        next_liveness = 0.0
        while not self._stop.is_set():
            try:
                if not asked:
                    for worker in self.live_workers():
                        self.ask_snapshot(worker)
                    asked = True
                last_id = self.consume_once(last_id)
                if time.monotonic() >= next_liveness:
                    next_liveness = time.monotonic() + self.liveness_interval
                    self.check_liveness()
            except RedisError as exc:
                logger.warning("prefix cache service: Redis failed (%s); retrying", exc)
                self._stop.wait(1.0)

    # -- what the HTTP side asks (http_app.py) ------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """How many of `hashes` (a prompt's chained block hashes) each worker holds, leading."""
        with self.lock:
            return dict(self.index.lookup(hashes))

    def index_size(self) -> tuple[int, int]:
        """(workers, distinct blocks) in the index."""
        with self.lock:
            return len(self.index.workers()), self.index.num_blocks

    def metrics_text(self) -> bytes:
        with self.lock:
            self._blocks.set(self.index.num_blocks)
            self._workers.set(len(self.index.workers()))
            self._lag.set(self.index.stats.last_lag)
        return generate_latest(self.registry)

    def start(self, host: str = "127.0.0.1", port: int = 8300) -> PrefixCacheService:
        """Serve HTTP on host:port (0: a free one; in use: `OSError`) and start consuming."""
        self.http = HTTPServerThread(create_app(self, self.max_body_bytes), host, port, self.keep_alive_timeout)
        self.http.start()
        self._threads = [threading.Thread(target=self._consume_loop, name="prefix-cache-events", daemon=True)]
        for thread in self._threads:
            thread.start()
        logger.info("prefix cache service on %s:%d", host, self.http.port)
        return self

    @property
    def port(self) -> int:
        assert self.http is not None, "start() first"
        return self.http.port

    def stop(self) -> None:
        self._stop.set()
        if self.http is not None:
            self.http.stop()
        for thread in self._threads:
            thread.join(timeout=5)
