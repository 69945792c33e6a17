"""The worker process's loop, in-process: it drains and exits with Redis gone."""

from __future__ import annotations

import threading
import time

from pagedserve import LLM
from pagedserve.common.config import ServeConfig
from pagedserve.entrypoints.redis_server import EmbeddedRedis
from pagedserve.worker.service import WorkerService


def test_a_worker_drains_and_exits_when_redis_is_gone(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22).engine
    redis_server = EmbeddedRedis().start()
    service = WorkerService(engine, ServeConfig(drain_timeout=1.0, heartbeat_interval=0.2, worker_timeout=1.0),
                            redis_server.url)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not service.queue.redis.zscore("pagedserve:workers", service.worker_id):
            assert time.monotonic() < deadline, "the worker never beat"
            time.sleep(0.05)
    finally:
        redis_server.stop()  # Redis goes first, as a terminal's Ctrl-C once made it
    time.sleep(0.5)  # the loop now meets a closed connection
    started = time.monotonic()
    service.drain()
    thread.join(timeout=1.0 + 5)
    assert not thread.is_alive(), "the worker kept retrying Redis instead of draining"
    assert time.monotonic() - started < 6
