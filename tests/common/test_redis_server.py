"""The Redis server pagedserve starts itself (the machine's own Redis is never used)."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.redis_server import (
    EmbeddedRedis,
    RedisServerNotFound,
    _ping,
    find_redis_server,
)


def test_starts_on_its_own_port_answers_and_stops():
    with EmbeddedRedis() as server:
        assert server.port != 6379
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert _ping(server.port)
        import redis

        client = redis.Redis.from_url(server.url)
        client.xadd("pagedserve:test", {"k": "v"})
        assert client.xlen("pagedserve:test") == 1
        assert client.config_get("save") == {"save": ""}  # nothing persisted
        client.close()
        # its own session: a Ctrl-C to the terminal's process group does not reach it
        import os

        assert os.getsid(server.process.pid) == server.process.pid != os.getsid(0)
        port = server.port
    assert not _ping(port)


def test_two_servers_side_by_side():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port and _ping(a.port) and _ping(b.port)


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
    with EmbeddedRedis() as first, pytest.raises(RuntimeError) as info:
        EmbeddedRedis(port=first.port).start()  # port taken
    assert "redis-server" in str(info.value)
