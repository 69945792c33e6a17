"""The Redis server pagedserve starts itself (the machine's own Redis is never used): a
password of its own that no one else sees, and a memory bound that refuses, never evicts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.redis_server import (
    EmbeddedRedis,
    RedisServerNotFound,
    _ping,
    find_redis_server,
)
from pagedserve.common.serve_config import ServeConfig


def test_starts_on_its_own_port_answers_and_stops():
    with EmbeddedRedis() as server:
        assert server.port != 6379
        assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
        assert server.display_url == f"redis://:***@127.0.0.1:{server.port}/0"
        assert _ping(server.port, server.password)
        client = redis.Redis.from_url(server.url)
        client.xadd("pagedserve:test", {"k": "v"})
        assert client.xlen("pagedserve:test") == 1
        assert client.config_get("save") == {"save": ""}  # nothing persisted
        assert client.config_get("maxmemory") == {"maxmemory": str(ServeConfig().redis_maxmemory)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        client.close()
        # its own session: a Ctrl-C to the terminal's process group does not reach it
        assert os.getsid(server.process.pid) == server.process.pid != os.getsid(0)
        port = server.port
    assert not _ping(port, server.password)


def test_a_restart_keeps_the_port_and_the_password():
    """Clients hold `url`: after a restart they must be able to reconnect with it."""
    with EmbeddedRedis() as server:
        url = server.url
        server.stop()
        server.start()
        assert server.url == url
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()


def test_the_password_is_only_in_a_private_config_file():
    with EmbeddedRedis() as server:
        password = server.password
        assert password and len(password) >= 32
        config = Path(server._dir.name) / "redis.conf"
        assert stat.S_IMODE(config.stat().st_mode) == 0o600
        assert f"requirepass {password}" in config.read_text().splitlines()
        pid = server.process.pid
        assert server.process.args == [find_redis_server(), str(config)]  # what it was started with
        # what `ps` shows (redis-server rewrites its title to "redis-server HOST:PORT")
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert password.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        assert password not in server.display_url
        log = Path(server._dir.name) / "redis.log"
        assert "Ready to accept connections" in log.read_text()
        assert password not in log.read_text()


def test_a_client_needs_the_password():
    with EmbeddedRedis() as server:
        once = Retry(NoBackoff(), 0)  # redis-py would retry a refused AUTH for seconds
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, retry=once)
        with pytest.raises(redis.AuthenticationError) as info:
            anonymous.set("k", "v")
        assert "authenticated" in str(info.value)  # redis-py's HELLO, refused before AUTH
        wrong = redis.Redis(host="127.0.0.1", port=server.port, password="not-" + server.password, retry=once)
        with pytest.raises(redis.AuthenticationError) as info:
            wrong.ping()
        assert "invalid username-password pair" in str(info.value)
        assert not _ping(server.port) and not _ping(server.port, "wrong")
        right = redis.Redis(host="127.0.0.1", port=server.port, password=server.password)
        assert right.set("k", "v") and right.get("k") == b"v"
        for client in (anonymous, wrong, right):
            client.close()


def test_past_its_memory_bound_writes_fail_and_nothing_is_evicted():
    value = b"x" * (256 * 1024)
    with EmbeddedRedis(maxmemory=4 * 1024 * 1024) as server:
        client = redis.Redis.from_url(server.url)
        written = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError) as info:
            for i in range(64):  # 16 MiB: four times the bound
                client.set(f"k{i}", value)
                written += 1
        assert "command not allowed when used memory > 'maxmemory'" in str(info.value)  # Redis's OOM reply
        assert 0 < written < 64
        assert client.exists(*[f"k{i}" for i in range(written)]) == written  # noeviction
        assert client.get("k0") == value
        assert client.config_get("maxmemory") == {"maxmemory": str(4 * 1024 * 1024)}
        assert client.delete("k0") == 1  # deleting frees; reads and deletes still work
        client.close()


def test_the_memory_bound_is_checked():
    with pytest.raises(InvalidParameterError) as info:
        ServeConfig(redis_maxmemory=0)
    assert info.value.param == "redis_maxmemory"
    with pytest.raises(ValueError):
        EmbeddedRedis(maxmemory=0)


def test_two_servers_side_by_side():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port and a.password != b.password
        assert _ping(a.port, a.password) and _ping(b.port, b.password)
        assert not _ping(a.port, b.password)


def test_missing_binary_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(RedisServerNotFound) as info:
        find_redis_server()
    assert "PAGEDSERVE_REDIS_SERVER" in str(info.value)
    monkeypatch.delenv("PAGEDSERVE_REDIS_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisServerNotFound) as info:
        find_redis_server()
    assert "apt-get install redis-server" in str(info.value)


def test_a_server_that_cannot_start_says_why():
    with EmbeddedRedis() as first:
        second = EmbeddedRedis(port=first.port)
        with pytest.raises(RuntimeError) as info:
            second.start()  # port taken
    assert "redis-server" in str(info.value)
    assert "Address already in use" in str(info.value)
    assert second.password and second.password not in str(info.value)


@pytest.mark.parametrize("appendonly", [False, True])
def test_a_restart_keeps_the_data_only_with_the_append_only_file(appendonly):
    server = EmbeddedRedis(appendonly=appendonly).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.xadd("s", {"f": "v"})
        client.close()
        server.restart()
        client = redis.Redis.from_url(server.url)
        assert client.xlen("s") == (1 if appendonly else 0)
        client.close()
    finally:
        server.stop()
    assert server._dir is None  # a final stop removes the data
