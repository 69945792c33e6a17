"""The worker's side of the queue against a real Redis: fair pulls across tenant streams, and
a heartbeat that renews the markers of the requests it runs."""

from __future__ import annotations

import time

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.config import ServeConfig
from pagedserve.common.queue_protocol import QueuedRequest, WorkerInfo, encode
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.entrypoints.redis_server import EmbeddedRedis
from pagedserve.worker.queue_consumer import OwnedEntry, QueueConsumer, fair_shares


def test_fair_shares_split_the_room_in_turn():
    assert fair_shares(["a", "b", "c"], 7, 0) == {"a": 3, "b": 2, "c": 2}
    assert fair_shares(["a", "b", "c"], 7, 1) == {"b": 3, "c": 2, "a": 2}
    assert fair_shares(["a", "b", "c"], 2, 2) == {"c": 1, "a": 1}  # less room than streams: in turn
    assert fair_shares(["a"], 5, 9) == {"a": 5}
    assert fair_shares([], 5, 0) == {} and fair_shares(["a"], 0, 0) == {}


def _admit(client: redis.Redis, request_id: str, tenant: str | None, num_tokens: int = 3,
           worker: str | None = None) -> None:
    message = QueuedRequest(request_id=request_id, prompt_token_ids=[1] * num_tokens, tenant=tenant,
                            params=SamplingParams(max_tokens=2), deadline=time.time() + 60)
    if not client.zscore(q.WORKERS, worker or "someone"):
        client.zadd(q.WORKERS, {worker or "someone": time.time() + 60})
    routed = q.routed_key(worker, tenant) if worker else q.requests_key(tenant)
    keys = [q.requests_key(tenant), q.QUEUED, q.QUEUED_TOKENS, q.WORKERS, q.admitted_key(request_id), q.TENANTS,
            q.TENANT_TOKENS, routed, q.TENANT_ROUTED, q.WORKER_TOKENS, q.WORKER_QUEUED]
    args = [100, 10_000, num_tokens, encode(message), 100, 10_000, 60, worker or ""]
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
        first = consumer.pull(3, None)
        assert sorted(e.request.request_id for e in first) == ["a0", "b0", "n0"]
        assert {e.stream for e in first} == {q.requests_key("A"), q.requests_key("B"), q.REQUESTS}
        assert [e.request.request_id for e in consumer.pull(10, None)] == ["a1", "a2", "a3", "a4"]
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
        mine, theirs = consumer.pull(2, None)
        # another worker took "theirs" over; Redis lost the entry and marker of "mine"
        client.xclaim(theirs.stream, q.GROUP, "w2", 0, [theirs.entry_id])
        client.xdel(mine.stream, mine.entry_id)
        client.delete(q.admitted_key("mine"), q.admitted_key("theirs"))
        consumer.set_owned([OwnedEntry(e.stream, e.entry_id, e.request.request_id) for e in (mine, theirs)])
        consumer.start_heartbeat(lambda: WorkerInfo(worker_id="w1", model="m", max_model_len=64, pid=1, host="h",
                                                    max_num_seqs=1))
        deadline = time.monotonic() + 10
        while not client.exists(q.admitted_key("mine")) and time.monotonic() < deadline:
            time.sleep(0.02)
        lost: set = set()
        while not lost and time.monotonic() < deadline:
            lost = consumer.lost_entries()
            time.sleep(0.02)
        consumer.stop()
        assert 90 < client.ttl(q.admitted_key("mine")) <= 160  # request_timeout + 60
        assert lost == {(theirs.stream, theirs.entry_id)}
        assert not client.exists(q.admitted_key("theirs"))  # not this worker's to keep alive
        client.close()
        consumer.redis.close()
