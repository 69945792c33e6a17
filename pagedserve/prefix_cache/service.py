"""The prefix cache service: the cluster's `PrefixIndex`, fed by the workers' event batches
and asked by the gateways.

    pagedserve prefix-cache --redis-url URL [--host 127.0.0.1] [--port 8300]

Two threads. The consumer reads `pagedserve:kv-events` (publisher.py), applies each batch,
and asks a worker for a snapshot (its snapshot key) whenever the index says it cannot
trust it. That happens on a gap, on a restart, and at the service's own start, when it
asks every live worker. Every `liveness_interval` it drops the workers whose heartbeat left
`pagedserve:workers`. The HTTP server answers:

    POST /lookup   body: a prompt's chained block hashes, 32 bytes each, concatenated
                   → {"workers": {worker id: leading blocks held}}
    GET /health    → {"status": "ok", "workers": N, "blocks": M}
    GET /metrics   → Prometheus text: index size, event lag, batches, gaps, malformed

A malformed batch is logged and counted, never applied. The service keeps nothing on disk:
after a restart it rebuilds from the snapshots it asks for. A gateway that cannot reach it
routes by load (the client raises, see index_client.py).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from redis import Redis
from redis.exceptions import RedisError

from pagedserve.common import queue_protocol as q
from pagedserve.prefix_cache.events import MalformedBatch, decode_batch
from pagedserve.prefix_cache.index import Applied, PrefixIndex
from pagedserve.prefix_cache.publisher import KV_EVENTS, snapshot_key

logger = logging.getLogger(__name__)

HASH_BYTES = 32  # SHA-256
#: the most hashes one lookup may send (a 1M-token prompt at block size 16)
MAX_LOOKUP_HASHES = 65_536


class PrefixCacheService:
    def __init__(self, redis_url: str, liveness_interval: float = 1.0, snapshot_ttl: float = 30.0):
        self.redis = Redis.from_url(redis_url, socket_timeout=5)
        self.index = PrefixIndex()
        self.lock = threading.Lock()  # the consumer writes the index, HTTP threads read it
        self.liveness_interval = liveness_interval
        self.snapshot_ttl = snapshot_ttl
        self.num_malformed = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.http: ThreadingHTTPServer | None = None
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

    # -- the HTTP side ----------------------------------------------------------------------
    def lookup(self, body: bytes) -> dict[str, int]:
        if len(body) % HASH_BYTES or len(body) // HASH_BYTES > MAX_LOOKUP_HASHES:
            raise ValueError(f"the body must be at most {MAX_LOOKUP_HASHES} hashes of {HASH_BYTES} bytes")
        hashes = [body[i : i + HASH_BYTES] for i in range(0, len(body), HASH_BYTES)]
        with self.lock:
            return dict(self.index.lookup(hashes))

    def metrics_text(self) -> bytes:
        with self.lock:
            self._blocks.set(self.index.num_blocks)
            self._workers.set(len(self.index.workers()))
            self._lag.set(self.index.stats.last_lag)
        return generate_latest(self.registry)

    def start(self, host: str = "127.0.0.1", port: int = 8300) -> PrefixCacheService:
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a gateway's lookups reuse one connection

            def setup(self) -> None:
                super().setup()
                # headers and body go out as two writes: without this, a kept-alive
                # connection waits for the client's delayed ACK (40 ms) between them
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    with service.lock:
                        state = {"status": "ok", "workers": len(service.index.workers()),
                                 "blocks": service.index.num_blocks}
                    self._send(200, json.dumps(state).encode())
                elif self.path == "/metrics":
                    self._send(200, service.metrics_text(), CONTENT_TYPE_PLAIN_0_0_4)
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                if self.path != "/lookup":
                    self._send(404, b'{"error": "not found"}')
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0 or length > MAX_LOOKUP_HASHES * HASH_BYTES:
                    self._send(413, b'{"error": "a Content-Length of at most 65536 hashes is required"}')
                    return
                try:
                    workers = service.lookup(self.rfile.read(length))
                except ValueError as exc:
                    self._send(400, json.dumps({"error": str(exc)}).encode())
                    return
                self._send(200, json.dumps({"workers": workers}).encode())

        self.http = ThreadingHTTPServer((host, port), Handler)
        self.http.daemon_threads = True
        self._threads = [threading.Thread(target=self.http.serve_forever, name="prefix-cache-http", daemon=True),
                         threading.Thread(target=self._consume_loop, name="prefix-cache-events", daemon=True)]
        for thread in self._threads:
            thread.start()
        logger.info("prefix cache service on %s:%d", host, self.http.server_address[1])
        return self

    @property
    def port(self) -> int:
        assert self.http is not None, "start() first"
        return int(self.http.server_address[1])

    def stop(self) -> None:
        self._stop.set()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
