"""Redis Sentinel URLs (`redis+sentinel://`): how they parse, clients through real Sentinels
on loopback (a primary, a replica, three Sentinels, every one behind a password), and a
failover: the primary is killed and the same clients reach the promoted replica."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest
import redis
from sentinel_cluster import SERVICE, SentinelCluster

from pagedserve.common import queue_protocol as q
from pagedserve.common import redis_clients
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.queue_protocol import WorkerInfo
from pagedserve.common.redis_clients import SentinelTarget, parse_sentinel_url
from pagedserve.common.redis_server import redact_url
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.prefix_cache.index_service import PrefixCacheService
from pagedserve.worker.queue_consumer import QueueConsumer

#: how long after the primary dies a client must be served by the promoted replica
FAILOVER_BUDGET_S = 10.0


# -- the URL ---------------------------------------------------------------------------------

def test_a_full_sentinel_url_parses():
    url = "redis+sentinel://app:pa%40ss@s1:26380,s2,[::1]:26381/mymaster/3?sentinel_password=sp"
    assert parse_sentinel_url(url, environ={}) == SentinelTarget(
        sentinels=(("s1", 26380), ("s2", 26379), ("::1", 26381)), service_name="mymaster", db=3,
        username="app", password="pa@ss", sentinel_password="sp")


def test_passwords_the_url_lacks_come_from_the_environment():
    environ = {redis_clients.PASSWORD_ENV: "from-env", redis_clients.SENTINEL_PASSWORD_ENV: "sentinel-env"}
    assert parse_sentinel_url("redis+sentinel://h:1/svc", environ=environ) == SentinelTarget(
        sentinels=(("h", 1),), service_name="svc", db=0, username=None, password="from-env",
        sentinel_password="sentinel-env")
    # the URL's own win
    target = parse_sentinel_url("redis+sentinel://:url@h:1/svc?sentinel_password=q", environ=environ)
    assert (target.password, target.sentinel_password) == ("url", "q")
    assert parse_sentinel_url("redis+sentinel://h:1/svc", environ={}).password is None


@pytest.mark.parametrize(("url", "message"), [
    ("redis://h:1/0", "starts with redis+sentinel://"),
    ("redis+sentinel:///svc", "names no Sentinel"),
    ("redis+sentinel://h:1", "path is /SERVICE or /SERVICE/DB"),
    ("redis+sentinel://h:1/svc/0/x", "path is /SERVICE or /SERVICE/DB"),
    ("redis+sentinel://h:1/svc/zero", "database 'zero' is not a number"),
    ("redis+sentinel://h:99999/svc", "no valid port"),
    ("redis+sentinel://h:1,:2/svc", "has no host"),
    ("redis+sentinel://h:1/svc?ssl=true", "not ssl"),
])
def test_a_malformed_sentinel_url_is_a_clear_error(url, message):
    with pytest.raises(InvalidParameterError) as info:
        parse_sentinel_url(url, environ={})
    assert info.value.param == "redis_url"
    assert message in str(info.value)


def test_a_sentinel_url_is_logged_without_its_passwords():
    url = "redis+sentinel://:secret@s1:26379,s2:26379/mymaster/0?sentinel_password=other"
    assert redact_url(url) == "redis+sentinel://:***@s1:26379,s2:26379/mymaster/0?sentinel_password=***"


def test_a_plain_url_takes_the_password_from_the_environment_only_when_it_has_none():
    environ = {redis_clients.PASSWORD_ENV: "from-env"}
    with redis_clients.sync_client("redis://h:1/0", environ=environ) as client:
        assert client.connection_pool.connection_kwargs["password"] == "from-env"
    with redis_clients.sync_client("redis://:own@h:1/0", environ=environ) as client:
        assert client.connection_pool.connection_kwargs["password"] == "own"


# -- real Sentinels ----------------------------------------------------------------------------

def _cluster_or_skip(tmp_path_factory) -> SentinelCluster:
    if shutil.which("redis-sentinel") is None and shutil.which("redis-server") is None:
        pytest.skip("needs redis-sentinel or redis-server (apt-get install redis-sentinel)")
    directory = tmp_path_factory.mktemp("sentinel")
    os.chmod(directory, 0o700)
    return SentinelCluster(directory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    running = _cluster_or_skip(tmp_path_factory)
    yield running
    running.stop()


def test_every_client_kind_reaches_the_primary_through_the_sentinels(cluster):
    """The worker's consumer, the gateway's client, the prefix cache service and a KV tier
    client, each from the same Sentinel URL, all talk to the primary (not the replica)."""
    url = cluster.url()
    primary = cluster.data_client("primary")
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=1.0)
    consumer = QueueConsumer(url, config)
    consumer.heartbeat.start(lambda: WorkerInfo(worker_id=consumer.worker_id, model="tiny", max_model_len=64,
                                                pid=os.getpid(), host="test", max_num_seqs=4))
    try:
        deadline = time.monotonic() + 10
        while primary.zscore(q.WORKERS, consumer.worker_id) is None:
            assert time.monotonic() < deadline, "the heartbeat never reached the primary"
            time.sleep(0.05)

        async def gateway_sees_the_worker() -> list[str]:
            gateway = QueueClient(url, config)
            try:
                assert await gateway.ping()
                return [w.worker_id for w in await gateway.live_workers()]
            finally:
                await gateway.close()

        assert asyncio.run(gateway_sees_the_worker()) == [consumer.worker_id]
    finally:
        consumer.stop()
    service = PrefixCacheService(url)
    try:
        assert service.redis.ping() is True
        assert service.redis.connection_pool.get_master_address() == ("127.0.0.1", cluster.ports["primary"])
    finally:
        service.redis.close()
    with redis_clients.sync_client(url) as tier:  # KVTierStore.connect makes its client here
        tier.set("sentinel-test", b"x")
    assert primary.get("sentinel-test") == b"x"


def test_wrong_or_missing_passwords_are_refused(cluster):
    hosts = ",".join(f"127.0.0.1:{p}" for p in cluster.sentinel_ports)
    no_sentinel_password = f"redis+sentinel://:{cluster.password}@{hosts}/{SERVICE}/0"
    wrong_primary_password = f"redis+sentinel://:nope@{hosts}/{SERVICE}/0?sentinel_password={cluster.sentinel_password}"
    with redis_clients.sync_client(no_sentinel_password, environ={}, socket_timeout=2) as client, \
            pytest.raises(redis.ConnectionError, match=f"No master found for '{SERVICE}'"):
        client.ping()
    with redis_clients.sync_client(wrong_primary_password, environ={}, socket_timeout=2) as client, \
            pytest.raises(redis.AuthenticationError):
        client.ping()
    # the passwords from the environment instead of the URL
    environ = {redis_clients.PASSWORD_ENV: cluster.password, redis_clients.SENTINEL_PASSWORD_ENV: cluster.sentinel_password}
    with redis_clients.sync_client(cluster.url(with_passwords=False), environ=environ) as client:
        assert client.ping() is True


def _retry_until_served(operation, started: float) -> float:
    """Seconds from `started` until `operation` succeeds; fails past the failover budget."""
    while True:
        try:
            operation()
            return time.monotonic() - started
        except redis.RedisError as exc:
            assert time.monotonic() - started < FAILOVER_BUDGET_S, f"not served {FAILOVER_BUDGET_S:g} s after the kill: {exc!r}"
            time.sleep(0.1)


def test_after_the_primary_dies_the_same_clients_reach_the_promoted_replica(tmp_path_factory):
    cluster = _cluster_or_skip(tmp_path_factory)
    try:
        url = cluster.url()
        old_primary, replica = cluster.ports["primary"], cluster.ports["replica"]
        sync = redis_clients.sync_client(url, socket_connect_timeout=1, socket_timeout=1)
        sync.set("before", b"1")
        assert sync.wait(1, 2000) == 1  # the replica has it: what was acknowledged by WAIT survives

        async def async_scenario() -> float:
            client = redis_clients.async_client(url, max_connections=8, timeout=5, socket_connect_timeout=1,
                                                socket_timeout=1)
            try:
                assert await client.set("async-before", b"1")
                await client.wait(1, 2000)
                started = time.monotonic()
                cluster.kill("primary")
                while True:
                    try:
                        assert await client.set("async-after", b"2")
                        break
                    except redis.RedisError as exc:
                        assert time.monotonic() - started < FAILOVER_BUDGET_S, f"async client not served: {exc!r}"
                        await asyncio.sleep(0.1)
                assert client.connection_pool.master_address == ("127.0.0.1", replica)
                return time.monotonic() - started
            finally:
                await client.aclose()

        async_seconds = asyncio.run(async_scenario())
        started = time.monotonic()  # the kill was at most async_seconds earlier
        sync_seconds = _retry_until_served(lambda: sync.set("after", b"2"), started)
        print(f"failover: async client served again {async_seconds:.2f} s after the kill, "
              f"sync client {sync_seconds:.2f} s after that")
        assert cluster.primary_port() == replica != old_primary
        assert sync.connection_pool.get_master_address() == ("127.0.0.1", replica)
        assert sync.mget("before", "async-before", "after", "async-after") == [b"1", b"1", b"2", b"2"]
        promoted = cluster.data_client("replica")
        assert promoted.info("replication")["role"] == "master"
        sync.close()
    finally:
        cluster.stop()
