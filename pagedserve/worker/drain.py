"""`Drain`: how a worker stops. The first SIGTERM or SIGINT, or the loss of the launcher that
started it (`drain_when_orphaned`), drains: the worker takes nothing new and its running
requests get drain_timeout seconds to finish; the loop then ends the rest with a
`shutdown_error`. A second SIGINT (Ctrl-C again) stops now.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sized

from pagedserve.common.queue_protocol import WireError

logger = logging.getLogger(__name__)


class Drain:
    def __init__(self, worker_id: str, timeout: float, running: Sized):
        self.worker_id = worker_id
        self.timeout = timeout
        self.running = running  # the requests it waits for (only counted, for the log)
        self.deadline: float | None = None  # monotonic; None: not draining

    def __call__(self, *_signal_args) -> None:
        """Take nothing new; running requests get `timeout` seconds to finish."""
        if self.deadline is None:
            logger.info("worker %s draining (%d running)", self.worker_id, len(self.running))
            self.deadline = time.monotonic() + self.timeout
        else:  # called again (a second Ctrl-C): stop now
            self.deadline = 0.0

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def expired(self) -> bool:
        """Draining, and the running requests' time is up."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        """The first signal drains; a second SIGINT (Ctrl-C again) stops now. A repeated SIGTERM
        changes nothing: a launcher and a service manager may both send one for the same stop."""
        if not self.active or signum == signal.SIGINT:
            self()


def shutdown_error() -> WireError:
    return WireError(message="the worker shut down before this request finished",
                     type="server_error", code="worker_shutdown", status_code=503)


def drain_when_orphaned(drain: Drain, supervisor_pid: int, interval: float = 1.0) -> None:
    """Drain once the launcher that started this worker is gone (killed without its cleanup)."""
    def watch() -> None:
        while os.getppid() == supervisor_pid:
            time.sleep(interval)
        if not drain.active:
            logger.warning("worker %s: its launcher (pid %d) is gone; draining", drain.worker_id, supervisor_pid)
            drain()

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
