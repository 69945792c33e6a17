"""`pagedserve serve`: a Redis (embedded unless --redis-url), the prefix cache service (with
--kv-events), the workers and the gateway, started in that order and stopped in the reverse
order.

On a stop signal the gateway drains, and the launcher tells the workers to drain at the same
moment; past `drain_timeout` (and EXIT_GRACE) what is left is killed, and Redis stops last.
The Redis URL may hold a password: it is logged only with the password replaced (`redact_url`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import msgspec

from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.model_store import resolve_model
from pagedserve.common.redis_server import EmbeddedRedis, redact_url
from pagedserve.common.serve_config import ServeConfig
from pagedserve.entrypoints.process_signals import (
    StopSignals,
    hang_up,
    interrupt_startup,
    record_stops,
)
from pagedserve.entrypoints.worker_plan import worker_count
from pagedserve.entrypoints.worker_supervisor import EXIT_GRACE, WorkerSupervisor, wait_for_workers

logger = logging.getLogger(__name__)


def serve(config: ServeConfig, engine: EngineConfig) -> int:
    """Serve until SIGINT, SIGTERM or SIGHUP; then drain and stop everything (Redis last)."""
    from pagedserve.gateway.auth import parse_api_keys
    from pagedserve.gateway.server import run_gateway

    # A keys file without keys fails here, before any worker loads, not after.
    parse_api_keys(config.api_keys_file, os.environ.get("PAGEDSERVE_API_KEYS"))
    resolve_model(engine.model)  # pull the default model once, before any worker needs it
    stops = StopSignals()
    record_stops(stops)
    signal.signal(signal.SIGHUP, hang_up)
    embedded: EmbeddedRedis | None = None
    supervisor: WorkerSupervisor | None = None
    prefix_cache = None
    try:
        redis_url = config.redis_url
        if redis_url is None:
            # the shared KV tier, if on, lives in this Redis too: room for it on top of the queue's
            tier = engine.kv_tier_memory if engine.kv_tier_url is None else 0
            embedded = EmbeddedRedis(maxmemory=config.redis_maxmemory + tier + tier // 8)
            redis_url = embedded.start().url
            logger.info("started redis-server at %s", redact_url(redis_url))
        if stops.received:
            return 0
        if config.kv_events is None:  # auto: an index is worth keeping when there is a choice of workers
            config = msgspec.structs.replace(config, kv_events=worker_count(config, engine) > 1)
        if config.kv_events:  # the workers publish their cached blocks: keep the cluster index here
            from pagedserve.prefix_cache.index_service import PrefixCacheService

            try:
                prefix_cache = PrefixCacheService(redis_url).start(config.host, config.prefix_cache_port)
            except OSError as exc:  # the port is taken (another serve here): any free one does for our gateway
                logger.warning("prefix cache port %d: %s; using a free port", config.prefix_cache_port, exc)
                prefix_cache = PrefixCacheService(redis_url).start(config.host, 0)
            logger.info("prefix cache service on http://%s:%d", config.host, prefix_cache.port)
            if config.prefix_cache_url is None:  # the gateway routes by what it knows
                config = msgspec.structs.replace(
                    config, prefix_cache_url=f"http://{config.host}:{prefix_cache.port}")
        supervisor = WorkerSupervisor(config, engine, redis_url, stops)
        supervisor.start()
        logger.info("loading %s in %d worker(s)…", engine.model, len(supervisor.slots))
        if not wait_for_workers(redis_url, supervisor, stops):
            return 0
        supervisor.watch()
        print(f"pagedserve: serving {engine.model} on http://{config.host}:{config.port}/v1 "
              f"({len(supervisor.slots)} worker(s), redis {redact_url(redis_url)})", flush=True)
        if config.console:
            print(f"pagedserve: the console is at http://{config.host}:{config.port}/", flush=True)
        interrupt_startup(stops)
        if not stops.received:  # one that came before the line above is only recorded
            with contextlib.suppress(KeyboardInterrupt):  # a signal before uvicorn took over
                run_gateway(config, engine, redis_url, on_signal=stops.add)
    finally:
        record_stops(stops)  # a signal during the cleanup must not cut it short
        if supervisor is not None:
            supervisor.stop((stops.first_at or time.monotonic()) + config.drain_timeout + EXIT_GRACE)
        if prefix_cache is not None:
            prefix_cache.stop()
        if embedded is not None:
            embedded.stop()
    return 0
