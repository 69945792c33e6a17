"""The worker's side of the queue against a real Redis: fair pulls across tenant streams, and
a heartbeat that renews the markers of the requests it runs."""

from __future__ import annotations

import time

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import QueuedRequest, WorkerInfo, encode
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.worker.heartbeat import OwnedEntry
from pagedserve.worker.queue_consumer import QueueConsumer
from pagedserve.worker.request_reader import fair_shares


def test_fair_shares_split_the_room_in_turn():
    assert fair_shares(["a", "b", "c"], 7, 0) == {"a": 3, "b": 2, "c": 2}
    assert fair_shares(["a", "b", "c"], 7, 1) == {"b": 3, "c": 2, "a": 2}
    assert fair_shares(["a", "b", "c"], 2, 2) == {"c": 1, "a": 1}  # less room than streams: in turn
    assert fair_shares(["a"], 5, 9) == {"a": 5}
    assert fair_shares([], 5, 0) == {} and fair_shares(["a"], 0, 0) == {}


def _admit(client: redis.Redis, request_id: str, tenant: str | None, num_tokens: int = 3,
           worker: str | None = None, cached_tokens: int = 0) -> None:
    message = QueuedRequest(request_id=request_id, prompt_token_ids=[1] * num_tokens, tenant=tenant,
                            params=SamplingParams(max_tokens=2), deadline=time.time() + 60)
    if not client.zscore(q.WORKERS, worker or "someone"):
        client.zadd(q.WORKERS, {worker or "someone": time.time() + 60})
    routed = q.routed_key(worker, tenant) if worker else q.requests_key(tenant)
    keys = [q.requests_key(tenant), q.QUEUED, q.QUEUED_TOKENS, q.WORKERS, q.admitted_key(request_id), q.TENANTS,
            q.TENANT_TOKENS, routed, q.TENANT_ROUTED, q.WORKER_TOKENS, q.WORKER_QUEUED]
    args = [100, 10_000, num_tokens, encode(message), 100, 10_000, 60, worker or "", cached_tokens]
    admitted, _, stream = client.register_script(q.ADMIT)(keys=keys, args=args)
    assert (admitted, stream.decode()) == (1, routed)


def test_a_pull_takes_from_every_tenant_before_a_second_from_any():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        for i in range(5):
            _admit(client, f"a{i}", "A")
        _admit(client, "b0", "B")
        _admit(client, "n0", None)
        consumer = QueueConsumer(server.url, ServeConfig())
        first = consumer.reader.pull(3, None)
        assert sorted(e.request.request_id for e in first) == ["a0", "b0", "n0"]
        assert {e.stream for e in first} == {q.requests_key("A"), q.requests_key("B"), q.REQUESTS}
        assert [e.request.request_id for e in consumer.reader.pull(10, None)] == ["a1", "a2", "a3", "a4"]
        # counted out of the queue's bounds, per tenant too
        assert int(client.get(q.QUEUED)) == 0 and int(client.get(q.QUEUED_TOKENS)) == 0
        assert client.hgetall(q.TENANT_TOKENS) == {}
        client.close()
        consumer.redis.close()


def test_the_heartbeat_renews_the_markers_of_running_requests():
    config = ServeConfig(heartbeat_interval=0.1, worker_timeout=1.0, request_timeout=100)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        _admit(client, "mine", "A")
        _admit(client, "theirs", "A")
        consumer = QueueConsumer(server.url, config, worker_id="w1")
        mine, theirs = consumer.reader.pull(2, None)
        # another worker took "theirs" over; Redis lost the entry and marker of "mine"
        client.xclaim(theirs.stream, q.GROUP, "w2", 0, [theirs.entry_id])
        client.xdel(mine.stream, mine.entry_id)
        client.delete(q.admitted_key("mine"), q.admitted_key("theirs"))
        consumer.heartbeat.set_owned([OwnedEntry(e.stream, e.entry_id, e.request.request_id) for e in (mine, theirs)])
        consumer.heartbeat.start(lambda: WorkerInfo(worker_id="w1", model="m", max_model_len=64, pid=1, host="h",
                                                     max_num_seqs=1))
        deadline = time.monotonic() + 10
        while not client.exists(q.admitted_key("mine")) and time.monotonic() < deadline:
            time.sleep(0.02)
        lost: set = set()
        while not lost and time.monotonic() < deadline:
            lost = consumer.heartbeat.lost_entries()
            time.sleep(0.02)
        consumer.stop()
        assert 90 < client.ttl(q.admitted_key("mine")) <= 160  # request_timeout + 60
        assert lost == {(theirs.stream, theirs.entry_id)}
        assert not client.exists(q.admitted_key("theirs"))  # not this worker's to keep alive
        client.close()
        consumer.redis.close()


# -- routed streams ----------------------------------------------------------------------------
def _try_admit(client: redis.Redis, request_id: str, tenant: str | None, num_tokens: int, worker: str | None,
               max_queued: int = 100, tenant_max: int = 100, tenant_tokens: int = 10_000) -> tuple[int, str]:
    """ADMIT as the gateway runs it: (1, stream written) or (0, reason)."""
    message = QueuedRequest(request_id=request_id, prompt_token_ids=[1] * num_tokens, tenant=tenant,
                            params=SamplingParams(max_tokens=2), deadline=time.time() + 60)
    routed = q.routed_key(worker, tenant) if worker else q.requests_key(tenant)
    keys = [q.requests_key(tenant), q.QUEUED, q.QUEUED_TOKENS, q.WORKERS, q.admitted_key(request_id), q.TENANTS,
            q.TENANT_TOKENS, routed, q.TENANT_ROUTED, q.WORKER_TOKENS, q.WORKER_QUEUED]
    args = [max_queued, 10_000, num_tokens, encode(message), tenant_max, tenant_tokens, 60, worker or ""]
    admitted, detail, *stream = client.register_script(q.ADMIT)(keys=keys, args=args)
    return admitted, (stream[0] if stream else detail).decode()


def _counters(client: redis.Redis) -> dict:
    def ints(h):
        return {k.decode(): int(v) for k, v in client.hgetall(h).items()}
    return {"queued": int(client.get(q.QUEUED) or 0), "tokens": int(client.get(q.QUEUED_TOKENS) or 0),
            "tenant_tokens": ints(q.TENANT_TOKENS), "tenant_routed": ints(q.TENANT_ROUTED),
            "worker_tokens": ints(q.WORKER_TOKENS), "worker_queued": ints(q.WORKER_QUEUED)}


def _reconcile(client: redis.Redis) -> list[int]:
    keys = [q.TENANTS, q.QUEUED, q.QUEUED_TOKENS, q.TENANT_TOKENS, q.TENANT_ROUTED, q.WORKER_TOKENS, q.WORKERS,
            q.WORKER_QUEUED]
    return client.register_script(q.RECONCILE)(keys=keys, args=[q.GROUP, q.ROUTED + ":", q.REQUESTS])


def test_the_stream_names_say_whose_they_are():
    assert q.routed_key("w1", None) == "pagedserve:routed:w1"
    assert q.routed_key("w1", "a:b") == "pagedserve:routed:w1:a:b"
    assert [q.routed_owner(s) for s in ("pagedserve:routed:w1:a:b", "pagedserve:routed:w1", q.requests_key("A"))] \
        == ["w1", "w1", None]
    assert q.tenant_stream_of("pagedserve:routed:w1:a:b") == q.requests_key("a:b")
    assert q.tenant_stream_of("pagedserve:routed:w1") == q.REQUESTS
    assert q.tenant_stream_of(q.requests_key("A")) == q.requests_key("A")
    for bad in ("", "host:1"):
        try:
            q.check_worker_id(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted as a worker id")


def test_admission_into_a_worker_stream_keeps_every_bound_and_counts_per_worker():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        assert _try_admit(client, "x", "A", 5, "w1") == (0, "no_worker")
        client.zadd(q.WORKERS, {"w1": time.time() + 60, "gone": time.time() - 1})
        assert _try_admit(client, "r0", "A", 5, "w1") == (1, q.routed_key("w1", "A"))
        assert _try_admit(client, "s0", "A", 7, None) == (1, q.requests_key("A"))
        # a tenant's requests in flight are its routed entries plus its shared ones: 2 of 2
        assert _try_admit(client, "r1", "A", 1, "w1", tenant_max=2) == (0, "tenant_requests")
        # its queued tokens count the routed ones too: 12 + 5 > 15
        assert _try_admit(client, "r1", "A", 5, "w1", tenant_tokens=15) == (0, "tenant_tokens")
        # the queue's own bound: 2 queued of 2
        assert _try_admit(client, "r1", "B", 1, "w1", max_queued=2) == (0, "full")
        # routed to a worker no longer live: the tenant's stream
        assert _try_admit(client, "r2", "B", 2, "gone") == (1, q.requests_key("B"))
        assert _try_admit(client, "r2", "B", 2, "gone") == (1, "again")  # a retry queues nothing more
        assert client.xlen(q.requests_key("B")) == 1
        expected = {"queued": 3, "tokens": 14, "tenant_tokens": {q.requests_key("A"): 12, q.requests_key("B"): 2},
                    "tenant_routed": {q.requests_key("A"): 1}, "worker_tokens": {"w1": 5}, "worker_queued": {"w1": 1}}
        assert _counters(client) == expected
        # the reconciliation finds the same in the streams
        client.delete(q.TENANT_TOKENS, q.TENANT_ROUTED, q.WORKER_TOKENS, q.WORKER_QUEUED)
        assert _reconcile(client) == [3, 14]
        assert _counters(client) == expected
        # taken: out of the queue's counters; in flight for the tenant until its final outcome
        consumer = QueueConsumer(server.url, ServeConfig(), worker_id="w1")
        [routed] = consumer.reader.pull(1, None)
        assert (routed.request.request_id, routed.stream, routed.stolen) == ("r0", q.routed_key("w1", "A"), False)
        after_take = _counters(client)
        assert (after_take["worker_tokens"], after_take["worker_queued"], after_take["tenant_routed"]) \
            == ({}, {}, {q.requests_key("A"): 1})
        assert after_take["tenant_tokens"] == {q.requests_key("A"): 7, q.requests_key("B"): 2}
        consumer.outbox.ack(routed.stream, routed.entry_id)
        consumer.outbox.flush()
        assert _counters(client)["tenant_routed"] == {} and client.xlen(routed.stream) == 0
        client.close()
        consumer.redis.close()


def test_a_worker_reads_its_own_stream_first_then_the_shared_ones():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.zadd(q.WORKERS, {"w1": time.time() + 60, "w2": time.time() + 60})
        _admit(client, "s0", "A")
        _admit(client, "s1", "B")
        _admit(client, "mine0", "A", worker="w1")
        _admit(client, "mine1", "B", worker="w1")
        _admit(client, "theirs", "A", worker="w2")
        w1 = QueueConsumer(server.url, ServeConfig(steal_after=60), worker_id="w1")
        view = w1.reader.streams()
        assert (view.own, view.others) == ([q.routed_key("w1", "A"), q.routed_key("w1", "B")], [q.routed_key("w2", "A")])
        assert view.shared == [q.requests_key("A"), q.requests_key("B")] and not view.orphaned
        assert sorted(e.request.request_id for e in w1.reader.pull(2, None)) == ["mine0", "mine1"]
        # then the shared ones; w2's entry is young and w2 lives: not w1's to take
        assert sorted(e.request.request_id for e in w1.reader.pull(10, None)) == ["s0", "s1"]
        assert w1.reader.pull(10, None) == [] and w1.reader.num_stolen == 0
        w2 = QueueConsumer(server.url, ServeConfig(), worker_id="w2")
        assert [e.request.request_id for e in w2.reader.pull(10, None)] == ["theirs"]
        assert _counters(client)["queued"] == 0
        for c in (client, w1.redis, w2.redis):
            c.close()


def test_a_worker_with_room_steals_what_waited_too_long_in_a_busy_workers_stream():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.zadd(q.WORKERS, {"w1": time.time() + 60, "busy": time.time() + 60})
        _admit(client, "old0", "A", worker="busy")
        _admit(client, "old1", None, worker="busy")
        thief = QueueConsumer(server.url, ServeConfig(steal_after=0.3), worker_id="w1")
        assert thief.reader.pull(4, None) == []  # younger than steal_after: left to their worker
        time.sleep(0.35)
        _admit(client, "young", "A", worker="busy")
        stolen = thief.reader.pull(4, None)
        assert sorted(e.request.request_id for e in stolen) == ["old0", "old1"]  # never the young one
        assert all(e.stolen for e in stolen) and thief.reader.num_stolen == 2
        assert _counters(client)["worker_queued"] == {"busy": 1}
        # what it stole, it owns: its ack settles the entry
        for e in stolen:
            thief.outbox.ack(e.stream, e.entry_id)
        thief.outbox.flush()
        assert client.xlen(q.routed_key("busy", "A")) == 1 and client.xlen(q.routed_key("busy", None)) == 0
        client.close()
        thief.redis.close()


def test_a_thief_waits_longer_for_a_request_whose_prefix_its_worker_holds():
    """steal_after 0.1 s plus 1 ms per cached token: tenant A's entry, routed for 300 cached
    tokens, is stolen only after 0.4 s; B's, with nothing cached, after 0.1 s. Each stream is
    read in order, so A's young entry also holds back the one behind it."""
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.zadd(q.WORKERS, {"w1": time.time() + 60, "busy": time.time() + 60})
        _admit(client, "warm", "A", num_tokens=400, worker="busy", cached_tokens=300)
        _admit(client, "behind", "A", worker="busy")
        _admit(client, "cold", "B", num_tokens=400, worker="busy")
        fields = client.xrange(q.routed_key("busy", "A"))[0][1]
        assert fields[q.CACHED_TOKENS_FIELD] == b"300"
        thief = QueueConsumer(server.url, ServeConfig(steal_after=0.1, steal_cached_token_ms=1.0), worker_id="w1")
        time.sleep(0.15)
        assert [e.request.request_id for e in thief.reader.pull(4, None)] == ["cold"]
        time.sleep(0.3)
        assert [e.request.request_id for e in thief.reader.pull(4, None)] == ["warm", "behind"]
        assert thief.reader.num_stolen == 3
        client.close()
        thief.redis.close()


def test_a_dead_workers_stream_is_taken_by_a_worker_that_is_not_idle():
    """Undelivered entries of a dead worker's stream are everyone's (read with the shared
    ones, not only when idle); the entries it had read are reclaimed; once settled, its
    stream is deleted."""
    config = ServeConfig(steal_after=60, heartbeat_interval=0.05, worker_timeout=0.2)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.zadd(q.WORKERS, {"w1": time.time() + 60, "dead": time.time() + 60})
        for i in range(3):
            _admit(client, f"d{i}", "A", worker="dead")
        _admit(client, "s0", "A")
        dead = QueueConsumer(server.url, config, worker_id="dead")
        [running] = dead.reader.pull(1, None)  # it runs d0, then dies
        client.zadd(q.WORKERS, {"dead": time.time() - 1})
        w1 = QueueConsumer(server.url, config, worker_id="w1")
        taken = w1.reader.pull(8, None)
        assert sorted((e.request.request_id, e.stolen) for e in taken) == [("d1", True), ("d2", True), ("s0", False)]
        for e in taken:  # settled (w1 beats no heartbeat here: unsettled, they would move too)
            w1.outbox.ack(e.stream, e.entry_id)
        w1.outbox.flush()
        time.sleep(0.25)  # past worker_timeout: d0's entry is idle long enough to move
        [moved] = w1.takeover.reclaim(8)
        assert (moved.request.request_id, moved.attempt, moved.stream) == ("d0", 2, running.stream)
        assert dead.outbox.ack(running.stream, running.entry_id) is None
        dead.outbox.flush()  # not its own anymore: nothing happens
        assert client.xlen(running.stream) == 1
        for e in [moved]:
            w1.outbox.ack(e.stream, e.entry_id)
        w1.outbox.flush()
        assert _reconcile(client) == [0, 0]
        assert not client.exists(running.stream) and client.smembers(q.TENANTS) == set()
        assert _counters(client)["tenant_routed"] == {}
        for c in (client, w1.redis, dead.redis):
            c.close()


def test_a_busy_worker_does_not_steal():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.zadd(q.WORKERS, {"w1": time.time() + 60, "busy": time.time() + 60})
        _admit(client, "old0", "A", worker="busy")
        thief = QueueConsumer(server.url, ServeConfig(steal_after=0.0), worker_id="w1")
        time.sleep(0.01)
        assert thief.reader.pull(4, None, steal=False) == []  # what the service passes while it runs requests
        assert [e.request.request_id for e in thief.reader.pull(4, None)] == ["old0"]
        client.close()
        thief.redis.close()
