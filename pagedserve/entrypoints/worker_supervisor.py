"""The `pagedserve serve` workers' supervisor: it starts them, restarts one that exits while
serving (with backoff, within a limit), passes the launcher's stop signals on to them, and
stops them all: drained first, killed past the deadline."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass

from pagedserve.common import queue_protocol as q
from pagedserve.common import redis_clients
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.serve_config import ServeConfig
from pagedserve.common.worker_activity import RESTARTS_ENV
from pagedserve.entrypoints.process_signals import OWN_PROCESS_GROUP, StopSignals, exit_reason
from pagedserve.entrypoints.worker_plan import worker_plan

logger = logging.getLogger(__name__)

#: the first restart of a worker waits this long; each recent restart doubles it, up to
#: --worker-restart-backoff-max
RESTART_BACKOFF_INITIAL = 1.0
#: what workers get past drain_timeout (counted from the first stop signal) before SIGKILL
EXIT_GRACE = 3.0
#: how often the supervisor looks at its workers (seconds)
_WATCH_INTERVAL = 0.2


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
    restarts: int = 0  # processes started after the first (the worker announces it: the console shows it)


class WorkerSupervisor:
    """Starts the workers, restarts one that exits while serving (`watch`), forwards stop
    signals to them, and stops them all (`stop`)."""

    def __init__(self, config: ServeConfig, engine: EngineConfig, redis_url: str, stops: StopSignals):
        self.config = config
        self.stops = stops
        self.argv, envs = worker_plan(config, engine, redis_url)
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
                slot.restarts += 1
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
        # A process group of its own: only the launcher signals it (see process_signals).
        env = {**slot.env, RESTARTS_ENV: str(slot.restarts)}
        slot.process = subprocess.Popen(self.argv, env=env, **OWN_PROCESS_GROUP)
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
    client = redis_clients.sync_client(redis_url)
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
