"""How many workers `pagedserve serve` starts, and what each one gets: its command line and
its environment (its GPU, its metrics port, the Redis URLs; a URL may hold a password, so it
goes into the environment, never argv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import msgspec

from pagedserve.common import options
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.serve_config import ServeConfig

#: where a worker reads the Redis URL (options.build reads it for ServeConfig.redis_url)
_REDIS_URL_ENV = "PAGEDSERVE_REDIS_URL"
#: where a worker reads the KV tier's Redis URL (options.build reads it for EngineConfig.kv_tier_url)
_KV_TIER_URL_ENV = "PAGEDSERVE_KV_TIER_URL"
#: the launcher's pid, for a worker to notice it is gone (pagedserve.worker.service reads it)
_SUPERVISOR_PID_ENV = "PAGEDSERVE_SUPERVISOR_PID"
#: where worker i reads its metrics port (--worker-metrics-port + i)
_METRICS_PORT_ENV = "PAGEDSERVE_WORKER_METRICS_PORT"
#: environment a worker has no use for: the gateway's API keys
_GATEWAY_ONLY_ENV = ("PAGEDSERVE_API_KEYS",)


def count_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def worker_count(config: ServeConfig, engine: EngineConfig, num_gpus: int | None = None) -> int:
    """Workers `serve` starts: --num-workers, else one per GPU, else one."""
    if num_gpus is None:
        num_gpus = count_gpus() if engine.device in ("auto", "cuda") else 0
    return config.num_workers or max(1, num_gpus)


def worker_plan(config: ServeConfig, engine: EngineConfig, redis_url: str) -> tuple[list[str], list[dict[str, str]]]:
    """The workers' command line and one environment per worker. The Redis URL goes into the
    environment: argv is readable by every user of the machine. Worker i's metrics port
    (--worker-metrics-port + i) too, so that one command line serves every worker."""
    num_gpus = count_gpus() if engine.device in ("auto", "cuda") else 0
    count = worker_count(config, engine, num_gpus)
    metrics_port = config.worker_metrics_port
    if metrics_port is not None and metrics_port + count - 1 > 65535:
        raise InvalidParameterError("worker_metrics_port", f"{metrics_port} + {count} workers runs past port 65535")
    if not num_gpus and engine.num_threads is None:
        # CPU workers share the cores instead of each taking all of them.
        engine = msgspec.structs.replace(engine, num_threads=max(1, (os.cpu_count() or 1) // count))
    flags = (options.to_flags(msgspec.structs.replace(config, redis_url=None, worker_metrics_port=None))
             + options.to_flags(msgspec.structs.replace(engine, kv_tier_url=None)))
    argv = [sys.executable, "-m", "pagedserve.entrypoints.cli", "worker", *flags]
    base = {k: v for k, v in os.environ.items() if k not in (*_GATEWAY_ONLY_ENV, _METRICS_PORT_ENV)}
    base.update({_REDIS_URL_ENV: redis_url, _SUPERVISOR_PID_ENV: str(os.getpid())})
    if engine.kv_tier_url is not None:  # a URL may hold a password: never in argv
        base[_KV_TIER_URL_ENV] = engine.kv_tier_url
    envs = []
    for i in range(count):
        env = dict(base, CUDA_VISIBLE_DEVICES=str(i % num_gpus)) if num_gpus else dict(base)
        if metrics_port is not None:
            env[_METRICS_PORT_ENV] = str(metrics_port + i)
        envs.append(env)
    return argv, envs
