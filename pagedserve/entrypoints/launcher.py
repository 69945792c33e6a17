"""`pagedserve serve`: a Redis (embedded unless --redis-url), the workers and the gateway,
started in that order and stopped in the reverse order.

Who signals whom: the workers run in process groups of their own, so a terminal's Ctrl-C
(sent to the foreground group) or a SIGTERM reaches only the launcher. They stay in the
launcher's session: with the kernel's autogroup scheduling (on by default on desktops), a
session of their own gave the workers a fixed share of the CPU against the gateway's and
cost a quarter of the serve throughput on 2 cores. The gateway drains on it, and the
launcher tells the workers to drain at the same moment; past `drain_timeout` (and a short
grace) what is left is killed, and Redis stops last. A second Ctrl-C stops the workers at
once. A `WorkerSupervisor` thread restarts a worker that exits while serving, with backoff,
within a limit.

The Redis URL may hold a password: workers get it through the environment, never argv, and
it is logged only with the password replaced (`redact_url`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from pagedserve.common import options
from pagedserve.common import queue_protocol as q
from pagedserve.common.config import EngineConfig, ServeConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.model_store import resolve_model
from pagedserve.common.redis_server import EmbeddedRedis, redact_url

logger = logging.getLogger(__name__)

#: the first restart of a worker waits this long; each recent restart doubles it, up to
#: --worker-restart-backoff-max
RESTART_BACKOFF_INITIAL = 1.0
#: what workers get past drain_timeout (counted from the first stop signal) before SIGKILL
EXIT_GRACE = 3.0
#: how often the supervisor looks at its workers (seconds)
_WATCH_INTERVAL = 0.2
#: Popen arguments that start a child in a process group of its own, in this session
#: (Python 3.11 has `process_group`; before it, setpgid in the child before exec)
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp})
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


def exit_reason(returncode: int) -> str:
    """Why a process ended, from its return code: `exit code N` or `killed by SIGNAME`."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def count_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class StopSignals:
    """The stop signals the launcher received, in order. Written from signal handlers, so
    nothing here takes a lock: a list append and an assignment."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.first_at: float | None = None  # monotonic time of the first one

    def add(self, signum: int) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.received.append(signum)


class RestartPolicy:
    """When a worker that exited starts again: after RESTART_BACKOFF_INITIAL seconds, doubled
    for each restart within the last `window` seconds, up to `backoff_max`; never once it
    restarted `limit` times within the window."""

    def __init__(self, limit: int, window: float, backoff_max: float, backoff_initial: float = RESTART_BACKOFF_INITIAL):
        self.limit = limit
        self.window = window
        self.backoff_max = backoff_max
        self.backoff_initial = backoff_initial
        self.restarts: deque[float] = deque()  # monotonic times, oldest first

    def next_delay(self, now: float) -> float | None:
        """Seconds until the restart of a worker that exited at `now` (counted as a restart),
        or None: past the limit, it stays down."""
        while self.restarts and self.restarts[0] <= now - self.window:
            self.restarts.popleft()
        if len(self.restarts) >= self.limit:
            return None
        delay = min(self.backoff_initial * 2 ** len(self.restarts), self.backoff_max)
        self.restarts.append(now)
        return delay


@dataclass(slots=True)
class _Slot:
    """One worker's place (a GPU, or a share of the cores) and the process that holds it."""

    index: int
    env: dict[str, str]
    policy: RestartPolicy
    process: subprocess.Popen | None = None  # None while it waits for a restart, or stays down
    restart_at: float | None = None  # monotonic time of a pending restart
    down: bool = False  # past the restart limit: it stays down


def worker_count(config: ServeConfig, engine: EngineConfig, num_gpus: int | None = None) -> int:
    """Workers `serve` starts: --num-workers, else one per GPU, else one."""
    if num_gpus is None:
        num_gpus = count_gpus() if engine.device in ("auto", "cuda") else 0
    return config.num_workers or max(1, num_gpus)


def _worker_plan(config: ServeConfig, engine: EngineConfig, redis_url: str) -> tuple[list[str], list[dict[str, str]]]:
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


class WorkerSupervisor:
    """Starts the workers, restarts one that exits while serving (`watch`), forwards stop
    signals to them, and stops them all (`stop`)."""

    def __init__(self, config: ServeConfig, engine: EngineConfig, redis_url: str, stops: StopSignals):
        self.config = config
        self.stops = stops
        self.argv, envs = _worker_plan(config, engine, redis_url)
        self.slots = [_Slot(i, env, RestartPolicy(config.worker_restart_limit, config.worker_restart_window,
                                                  config.worker_restart_backoff_max))
                      for i, env in enumerate(envs)]
        self._stopping = False  # no more restarts; the workers were told to drain
        self._signals_seen = 0  # of stops.received, forwarded already
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    def exited_while_loading(self) -> tuple[_Slot, int] | None:
        """(slot, return code) of a worker that exited before `watch` began, if any."""
        for slot in self.slots:
            if slot.process is not None and (rc := slot.process.poll()) is not None:
                return slot, rc
        return None

    def watch(self) -> None:
        """From now on (the workers are loaded) a worker that exits is restarted."""
        self._thread = threading.Thread(target=self._watch, name="worker-supervisor", daemon=True)
        self._thread.start()

    def stop(self, deadline: float) -> None:
        """Tell every worker to drain, wait for them until `deadline` (monotonic), kill the rest."""
        self._finished.set()
        if self._thread is not None:
            self._thread.join()
        self._forward_stop_signals()
        self._begin_stop()
        while time.monotonic() < deadline and any(s.process is not None and s.process.poll() is None for s in self.slots):
            self._forward_stop_signals()  # a second Ctrl-C while waiting
            time.sleep(0.05)
        for slot in self.slots:
            if slot.process is None:
                continue
            if slot.process.poll() is None:
                logger.warning("worker %d (pid %d) did not exit in time; killing it", slot.index, slot.process.pid)
                slot.process.kill()
            logger.info("worker %d (pid %d) stopped (%s)", slot.index, slot.process.pid, exit_reason(slot.process.wait()))
            slot.process = None

    # -- the watch thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._finished.is_set():
            try:
                self._forward_stop_signals()
                self._check(time.monotonic())
            except Exception:  # the supervisor must outlive its own bugs
                logger.exception("worker supervisor error; going on")
            self._finished.wait(_WATCH_INTERVAL)

    def _check(self, now: float) -> None:
        for slot in self.slots:
            if slot.process is not None and (rc := slot.process.poll()) is not None:
                pid, slot.process = slot.process.pid, None
                if self._stopping:
                    logger.info("worker %d (pid %d) stopped (%s)", slot.index, pid, exit_reason(rc))
                else:
                    self._exited(slot, f"pid {pid}, {exit_reason(rc)}", now)
            if slot.restart_at is not None and now >= slot.restart_at and not self._stopping:
                slot.restart_at = None
                try:
                    process = self._spawn(slot)
                except OSError as exc:
                    self._exited(slot, f"could not start: {exc}", now)
                    continue
                logger.warning("worker %d restarted as pid %d", slot.index, process.pid)

    def _exited(self, slot: _Slot, why: str, now: float) -> None:
        """A worker ended while serving: schedule its restart, or leave it down past the limit."""
        delay = slot.policy.next_delay(now)
        if delay is not None:
            slot.restart_at = now + delay
            logger.warning("worker %d exited (%s); restarting it in %g s", slot.index, why, delay)
            return
        slot.down = True
        logger.error("worker %d exited (%s) after %d restart(s) within %g s; it stays down (--worker-restart-limit)",
                     slot.index, why, slot.policy.limit, slot.policy.window)
        if all(s.down for s in self.slots):
            logger.critical("no worker is left: every request gets 503 and /ready fails until pagedserve serve "
                            "is restarted")

    # -- processes and signals -----------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> subprocess.Popen:
        # A process group of its own: only the launcher signals it (see the module docstring).
        slot.process = subprocess.Popen(self.argv, env=slot.env, **_OWN_PROCESS_GROUP)
        return slot.process

    def _signal_all(self, signum: int) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(signum)

    def _begin_stop(self) -> None:
        """No more restarts; every worker drains (running requests get drain_timeout)."""
        if not self._stopping:
            self._stopping = True
            for slot in self.slots:
                slot.restart_at = None
            self._signal_all(signal.SIGTERM)

    def _forward_stop_signals(self) -> None:
        """The first stop signal drains the workers; a later Ctrl-C stops them at once."""
        while self._signals_seen < len(self.stops.received):
            signum = self.stops.received[self._signals_seen]
            self._signals_seen += 1
            if not self._stopping:
                logger.info("%s: stopping; running requests get %g s", signal.Signals(signum).name,
                            self.config.drain_timeout)
                self._begin_stop()
            elif signum == signal.SIGINT:
                logger.warning("SIGINT again: the workers stop now, ending what they run")
                self._signal_all(signal.SIGINT)


def wait_for_workers(redis_url: str, supervisor: WorkerSupervisor, stops: StopSignals, timeout: float = 600.0) -> bool:
    """Until every worker beats (True), or a stop signal came first (False); fails if a
    worker exits while loading."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if stops.received:
                return False
            if client.zcount(q.WORKERS, time.time(), "+inf") >= len(supervisor.slots):
                return True
            if (exited := supervisor.exited_while_loading()) is not None:
                slot, rc = exited
                raise RuntimeError(f"worker {slot.index} exited while loading ({exit_reason(rc)}); see the log above")
            time.sleep(0.2)
        raise RuntimeError(f"no worker was ready within {timeout:g} s")
    finally:
        client.close()


# -- signals -----------------------------------------------------------------------------------
def _record_stops(stops: StopSignals) -> None:
    """SIGINT and SIGTERM are recorded, never raised: the cleanup in `serve` always runs."""
    def record(signum, frame) -> None:
        stops.add(signum)

    signal.signal(signal.SIGINT, record)
    signal.signal(signal.SIGTERM, record)


def _interrupt_startup(stops: StopSignals) -> None:
    """While the gateway starts, a signal ends the start (uvicorn handles them once it runs).
    Once uvicorn stops, it raises the signals it caught again: those are not new."""
    def interrupt(signum, frame) -> None:
        if not stops.received:
            stops.add(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _hang_up(signum, frame) -> None:
    """A closed terminal stops the server like SIGTERM (whoever handles SIGTERM now)."""
    signal.raise_signal(signal.SIGTERM)


# -- serve -------------------------------------------------------------------------------------
def serve(config: ServeConfig, engine: EngineConfig) -> int:
    """Serve until SIGINT, SIGTERM or SIGHUP; then drain and stop everything (Redis last)."""
    from pagedserve.gateway.auth import parse_api_keys
    from pagedserve.gateway.server import run_gateway

    # A keys file without keys fails here, before any worker loads, not after.
    parse_api_keys(config.api_keys_file, os.environ.get("PAGEDSERVE_API_KEYS"))
    resolve_model(engine.model)  # pull the default model once, before any worker needs it
    stops = StopSignals()
    _record_stops(stops)
    signal.signal(signal.SIGHUP, _hang_up)
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
        _interrupt_startup(stops)
        if not stops.received:  # one that came before the line above is only recorded
            with contextlib.suppress(KeyboardInterrupt):  # a signal before uvicorn took over
                run_gateway(config, engine, redis_url, on_signal=stops.add)
    finally:
        _record_stops(stops)  # a signal during the cleanup must not cut it short
        if supervisor is not None:
            supervisor.stop((stops.first_at or time.monotonic()) + config.drain_timeout + EXIT_GRACE)
        if prefix_cache is not None:
            prefix_cache.stop()
        if embedded is not None:
            embedded.stop()
    return 0
