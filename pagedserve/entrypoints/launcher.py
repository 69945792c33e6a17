"""`pagedserve serve`: a Redis (embedded unless --redis-url), the workers, and the gateway,
started in that order and stopped in the reverse order."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import msgspec
import redis

from pagedserve.common import options
from pagedserve.common import queue_protocol as q
from pagedserve.common.config import EngineConfig, ServeConfig
from pagedserve.common.model_store import resolve_model
from pagedserve.entrypoints.redis_server import EmbeddedRedis

logger = logging.getLogger(__name__)


def count_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def start_workers(config: ServeConfig, engine: EngineConfig, redis_url: str) -> list[subprocess.Popen]:
    num_gpus = count_gpus() if engine.device in ("auto", "cuda") else 0
    count = config.num_workers or max(1, num_gpus)
    if not num_gpus and engine.num_threads is None:
        # CPU workers share the cores instead of each taking all of them.
        engine = msgspec.structs.replace(engine, num_threads=max(1, (os.cpu_count() or 1) // count))
    flags = options.to_flags(msgspec.structs.replace(config, redis_url=redis_url)) + options.to_flags(engine)
    procs = []
    for i in range(count):
        env = dict(os.environ)
        if num_gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(i % num_gpus)
        procs.append(subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "worker", *flags], env=env))
    return procs


def wait_for_workers(redis_url: str, procs: list[subprocess.Popen], timeout: float = 600.0) -> None:
    """Until every worker beats; fails if one of them exits while loading."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if client.zcount(q.WORKERS, time.time(), "+inf") >= len(procs):
                return
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a worker exited while loading; see the log above")
            time.sleep(0.2)
        raise RuntimeError(f"no worker was ready within {timeout:g} s")
    finally:
        client.close()


def stop_workers(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve(config: ServeConfig, engine: EngineConfig) -> int:
    from pagedserve.gateway.auth import parse_api_keys
    from pagedserve.gateway.server import run_gateway

    # A keys file without keys fails here, before any worker loads, not after.
    parse_api_keys(config.api_keys_file, os.environ.get("PAGEDSERVE_API_KEYS"))
    resolve_model(engine.model)  # pull the default model once, before any worker needs it
    embedded = None
    redis_url = config.redis_url
    if redis_url is None:
        embedded = EmbeddedRedis().start()
        logger.info("started redis-server at %s", embedded.url)
        redis_url = embedded.url
    procs: list[subprocess.Popen] = []
    try:
        procs = start_workers(config, engine, redis_url)
        logger.info("loading %s in %d worker(s)…", engine.model, len(procs))
        wait_for_workers(redis_url, procs)
        print(f"pagedserve: serving {engine.model} on http://{config.host}:{config.port}/v1 "
              f"({len(procs)} worker(s), redis {redis_url})", flush=True)
        run_gateway(config, engine, redis_url)
    finally:
        stop_workers(procs, config.drain_timeout + 10)
        if embedded is not None:
            embedded.stop()
    return 0
