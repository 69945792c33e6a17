"""A Redis server that pagedserve starts and owns (for `pagedserve serve` and the tests).

It runs a `redis-server` binary (`$PAGEDSERVE_REDIS_SERVER`, else the one on PATH) on a free
loopback port, with no persistence, in a private directory, and stops it on exit. Nothing
here depends on a Redis that happens to be running on the machine already.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServerNotFound(RuntimeError):
    """No redis-server binary to start."""


def find_redis_server() -> str:
    """The redis-server binary: $PAGEDSERVE_REDIS_SERVER, else the one on PATH."""
    explicit = os.environ.get("PAGEDSERVE_REDIS_SERVER")
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise RedisServerNotFound(f"PAGEDSERVE_REDIS_SERVER={explicit} is not an executable file")
        return explicit
    found = shutil.which("redis-server")
    if found is None:
        raise RedisServerNotFound(
            "no redis-server on PATH: install Redis (e.g. apt-get install redis-server), "
            "set PAGEDSERVE_REDIS_SERVER, or pass --redis-url for a server you run"
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_pid(port: int) -> int | None:
    """The process id of the Redis answering on this port (INFO server), or None."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            data = b""
            while b"process_id:" not in data or not data.split(b"process_id:", 1)[1].count(b"\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    return None
                data += chunk
    except OSError:
        return None
    return int(data.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0])


def _ping(port: int) -> bool:
    """A raw RESP PING, so this module needs no client library."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """Starts redis-server on a free port; `url` is where it listens. Use as a context
    manager, or call `start()` and `stop()`."""

    def __init__(self, port: int | None = None, startup_timeout: float = 10.0):
        self.port = port
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "the server is not started"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        binary = find_redis_server()
        self.port = self.port or _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self._dir.name, "--logfile", str(Path(self._dir.name) / "redis.log")]
        # Its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) must not
        # stop Redis before the workers have drained through it; `stop` ends it, last.
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        # Ready when *our* process answers: another server on the port does not count.
        while _server_pid(self.port) != self.process.pid:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log = Path(self._dir.name, "redis.log")
                err += log.read_text(errors="replace")[-500:] if log.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server exited at start: {err.strip()[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {self.startup_timeout} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._dir is not None:
            with contextlib.suppress(OSError):
                self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
