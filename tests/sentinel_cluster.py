"""A Redis primary, one replica and three Sentinels on loopback, for the failover tests.

Every server asks for a password (the data servers one, the Sentinels another), as the
Kubernetes manifests run them. The Sentinels call the primary down after 1 s without an
answer (`down-after-milliseconds`), so a failover takes a few seconds, not the default 30.
`redis-sentinel` (Debian's package) runs the Sentinels; without it, `redis-server --sentinel`.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedserve.common.redis_server import find_redis_server

SERVICE = "mymaster"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sentinel_command(config: Path) -> list[str]:
    """How to start a Sentinel on `config`: `redis-sentinel CONFIG`, else `redis-server CONFIG --sentinel`."""
    binary = shutil.which("redis-sentinel")
    return [binary, str(config)] if binary else [find_redis_server(), str(config), "--sentinel"]


class SentinelCluster:
    def __init__(self, directory: Path, down_after_ms: int = 1000):
        self.directory = directory
        self.password = secrets.token_urlsafe(18)
        self.sentinel_password = secrets.token_urlsafe(18)
        self.processes: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self._start_data("primary", None)
        self._start_data("replica", self.ports["primary"])
        self.sentinel_ports = []
        for i in range(3):
            port = _free_port()
            self.sentinel_ports.append(port)
            config = directory / f"sentinel{i}.conf"
            config.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {directory}", f"logfile {directory / f'sentinel{i}.log'}",
                f"requirepass {self.sentinel_password}", f"sentinel sentinel-pass {self.sentinel_password}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports['primary']} 2",
                f"sentinel auth-pass {SERVICE} {self.password}",
                f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
                f"sentinel failover-timeout {SERVICE} 10000",
            ]) + "\n")
            config.chmod(0o600)
            self.processes[f"sentinel{i}"] = subprocess.Popen(sentinel_command(config), stdout=subprocess.DEVNULL,
                                                              stderr=subprocess.DEVNULL)
            self.ports[f"sentinel{i}"] = port
        self._wait_sentinels_agree()

    def _start_data(self, name: str, primary_port: int | None) -> None:
        port = _free_port()
        config = self.directory / f"{name}.conf"
        lines = [f"port {port}", "bind 127.0.0.1", f"requirepass {self.password}", f"masterauth {self.password}",
                 'save ""', "appendonly no", f"dir {self.directory}", f"dbfilename {name}.rdb",
                 f"logfile {self.directory / f'{name}.log'}"]
        if primary_port is not None:
            lines.append(f"replicaof 127.0.0.1 {primary_port}")
        config.write_text("\n".join(lines) + "\n")
        config.chmod(0o600)
        self.processes[name] = subprocess.Popen([find_redis_server(), str(config)], stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)
        self.ports[name] = port
        self._wait(lambda: self.data_client(name).ping(), f"{name} redis-server")

    def _wait(self, check, what: str, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
                if value:
                    return value
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                logs = {p.name: p.read_text()[-400:] for p in self.directory.glob("*.log")}
                self.stop()
                raise RuntimeError(f"{what} not ready within {timeout:g} s; logs: {logs}")
            time.sleep(0.05)

    def data_client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], password=self.password, socket_timeout=2,
                           retry=Retry(NoBackoff(), 0))

    def sentinel_client(self, i: int) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[i], password=self.sentinel_password, socket_timeout=2,
                           retry=Retry(NoBackoff(), 0))

    def _wait_sentinels_agree(self) -> None:
        """Until every Sentinel knows the replica and the two other Sentinels: a failover
        needs both."""
        def ready() -> bool:
            for i in range(3):
                state = self.sentinel_client(i).sentinel_master(SERVICE)
                if state["num-slaves"] < 1 or state["num-other-sentinels"] < 2:
                    return False
            return self.data_client("replica").info("replication")["master_link_status"] == "up"
        self._wait(ready, "the Sentinels' view of the primary, the replica and each other", timeout=30)

    def url(self, with_passwords: bool = True, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        if not with_passwords:
            return f"redis+sentinel://{hosts}/{SERVICE}/{db}"
        return f"redis+sentinel://:{self.password}@{hosts}/{SERVICE}/{db}?sentinel_password={self.sentinel_password}"

    def primary_port(self) -> int:
        """The primary's port, as the first Sentinel sees it now."""
        return int(self.sentinel_client(0).sentinel_get_master_addr_by_name(SERVICE)[1])

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
