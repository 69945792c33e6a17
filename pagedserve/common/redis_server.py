"""A Redis server that pagedserve starts and owns (for `pagedserve serve` and the tests).

It runs a `redis-server` binary (`$PAGEDSERVE_REDIS_SERVER`, else the one on PATH) on a free
loopback port, with no persistence (or, asked, an append-only file as compose runs it), in a
private directory, and stops it on exit. Nothing
here depends on a Redis that happens to be running on the machine already.

The server asks for a password drawn at start and holds at most `maxmemory` bytes: past them
a write fails with Redis's OOM error instead of evicting queued requests or outputs. The
password lives only in a 0600 config file in the private directory and in `url`: never in
the child's argv or environment, nor in any log line (`display_url` and `redact_url` hide it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pagedserve.common.serve_config import ServeConfig


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


def redact_url(url: str) -> str:
    """The URL with its password (in the user part or a `password=` or `sentinel_password=`
    query field) replaced by `***`, for logs and messages."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
        query = "&".join(f"{name}=***" if name.lower() in ("password", "sentinel_password") else f"{name}={value}"
                         for name, _, value in (pair.partition("=") for pair in parts.query.split("&") if pair))
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return "<a redis url that does not parse>"


def _resp(*args: str) -> bytes:
    """One command in RESP, Redis's wire format: an array of bulk strings."""
    encoded = [arg.encode() for arg in args]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in encoded)


def _ask(port: int, password: str | None, *command: str) -> bytes | None:
    """Send one command over raw RESP (after AUTH, when there is a password), so this module
    needs no client library. Its reply: a simple string's text or a bulk string's bytes; None
    when nothing answers, AUTH is refused, or the reply is an error."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock, sock.makefile("rb") as replies:
            if password is not None:
                sock.sendall(_resp("AUTH", password))
                if replies.readline() != b"+OK\r\n":
                    return None
            sock.sendall(_resp(*command))
            line = replies.readline()
            if line.startswith(b"+"):
                return line[1:].rstrip(b"\r\n")
            if line.startswith(b"$") and int(line[1:]) >= 0:
                return replies.read(int(line[1:]))
            return None
    except (OSError, ValueError):
        return None


def _server_pid(port: int, password: str | None = None) -> int | None:
    """The process id of the Redis answering on this port (INFO server), or None."""
    info = _ask(port, password, "INFO", "server")
    if info is None or b"process_id:" not in info:
        return None
    return int(info.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0])


def _ping(port: int, password: str | None = None) -> bool:
    """Whether a Redis on this port answers PING (with this password, when given)."""
    return _ask(port, password, "PING") == b"PONG"


def _quoted(value: str) -> str:
    """A value for redis.conf, in double quotes (paths may hold spaces)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    """Starts redis-server on a free port with a fresh password; `url` is where it listens
    (with the password: give it only to clients), `display_url` the same without it. Use as
    a context manager, or call `start()` and `stop()`; a restart keeps the port and password,
    so clients holding `url` reconnect."""

    def __init__(self, port: int | None = None, startup_timeout: float = 10.0, maxmemory: int | None = None,
                 appendonly: bool = False):
        self.port = port
        # persistence as compose runs it (AOF, fsync every second): `restart` keeps the data
        self.appendonly = appendonly
        self.startup_timeout = startup_timeout
        # bytes Redis may hold before writes fail (noeviction); None: ServeConfig's default
        self.maxmemory = ServeConfig().redis_maxmemory if maxmemory is None else maxmemory
        if self.maxmemory < 1:
            raise ValueError(f"maxmemory must be >= 1 byte, got {self.maxmemory}")
        self.password: str | None = None  # drawn at the first start
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        assert self.port is not None and self.password is not None, "the server is not started"
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def display_url(self) -> str:
        """`url` with the password hidden, for logs."""
        return redact_url(self.url)

    def _write_config(self, directory: str) -> Path:
        """redis.conf in the private directory, created readable by this user only (the
        mode is set by the open itself: the password is never in a file others can read)."""
        assert self.port is not None and self.password is not None
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"requirepass {self.password}",
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync everysec",
            f"dir {_quoted(directory)}",
            f"logfile {_quoted(str(Path(directory) / 'redis.log'))}",
            f"maxmemory {self.maxmemory}",
            "maxmemory-policy noeviction",
        ]
        path = Path(directory) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def start(self) -> EmbeddedRedis:
        binary = find_redis_server()
        self.port = self.port or _free_port()
        self.password = self.password or secrets.token_urlsafe(32)
        if self._dir is None:  # else a restart that keeps its data (AOF)
            self._dir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")
            self._write_config(self._dir.name)
        config_file = Path(self._dir.name) / "redis.conf"
        # Its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) must not
        # stop Redis before the workers have drained through it; `stop` ends it, last. Its
        # environment is ours: the password is only in the config file.
        self.process = subprocess.Popen([binary, str(config_file)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        # Ready when *our* process answers: another server on the port does not count.
        while _server_pid(self.port, self.password) != self.process.pid:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log = Path(self._dir.name, "redis.log")
                err += log.read_text(errors="replace")[-500:] if log.exists() else ""
                err = err.replace(self.password, "***")  # a config error quotes the line
                self.stop()
                raise RuntimeError(f"redis-server exited at start: {err.strip()[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {self.startup_timeout} s")
            time.sleep(0.02)
        return self

    def restart(self, downtime: float = 0.0) -> None:
        """Stop the server (SIGTERM: with AOF on, Redis writes its log out first) and start it
        again on the same port with the same password; with AOF on, with the data it held."""
        self.stop(keep_data=self.appendonly)
        time.sleep(downtime)
        self.start()

    def stop(self, keep_data: bool = False) -> None:
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
        if self._dir is not None and not keep_data:
            with contextlib.suppress(OSError):
                self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
