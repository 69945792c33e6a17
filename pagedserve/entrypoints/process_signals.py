"""Who signals whom in `pagedserve serve`: the stop signals the launcher records, the handlers
it installs, and the process group each worker runs in.

The workers run in process groups of their own, so a terminal's Ctrl-C (sent to the
foreground group) or a SIGTERM reaches only the launcher. They stay in the launcher's
session: with the kernel's autogroup scheduling (on by default on desktops), a session of
their own gave the workers a fixed share of the CPU against the gateway's and cost a quarter
of the serve throughput on 2 cores. The launcher passes the signals on (`WorkerSupervisor`):
the first drains the workers, a second Ctrl-C stops them at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

#: Popen arguments that start a child in a process group of its own, in this session
#: (Python 3.11 has `process_group`; before it, setpgid in the child before exec)
OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp})


def exit_reason(returncode: int) -> str:
    """Why a process ended, from its return code: `exit code N` or `killed by SIGNAME`."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


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


def record_stops(stops: StopSignals) -> None:
    """SIGINT and SIGTERM are recorded, never raised: the cleanup in `serve` always runs."""
    def record(signum, frame) -> None:
        stops.add(signum)

    signal.signal(signal.SIGINT, record)
    signal.signal(signal.SIGTERM, record)


def interrupt_startup(stops: StopSignals) -> None:
    """While the gateway starts, a signal ends the start (uvicorn handles them once it runs).
    Once uvicorn stops, it raises the signals it caught again: those are not new."""
    def interrupt(signum, frame) -> None:
        if not stops.received:
            stops.add(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def hang_up(signum, frame) -> None:
    """A closed terminal stops the server like SIGTERM (whoever handles SIGTERM now)."""
    signal.raise_signal(signal.SIGTERM)
