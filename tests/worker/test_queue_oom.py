"""The worker's side of the queue when Redis is full (past `maxmemory`, noeviction): what it
could not write must wait for room, not be dropped, and nothing it takes may go uncounted."""

from __future__ import annotations

import contextlib
import time

import pytest
import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.output_log import OutputLog
from pagedserve.common.queue_protocol import (
    Chunk,
    CompletionDelta,
    QueuedRequest,
    WorkerInfo,
    encode,
)
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.worker.queue_consumer import QueueConsumer

from serve_helpers import chunks_of

REPLY_TO = q.reply_key("g1")


@pytest.fixture()
def full_redis():
    """A Redis, a client of it, and a switch that makes it full (every command that may grow
    its memory is refused with the OOM error) or gives it room again."""
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)

        def set_full(full: bool) -> None:
            client.config_set("maxmemory", 1 if full else ServeConfig().redis_maxmemory)

        yield server, client, set_full
        client.close()


def _queue(client: redis.Redis, *request_ids: str) -> None:
    """Queued as the gateway's admission leaves them: entries, the tenants set and the counters."""
    for request_id in request_ids:
        request = QueuedRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4),
                                deadline=time.time() + 60)
        client.xadd(q.REQUESTS, {q.REQUEST_FIELD: encode(request), q.PROMPT_TOKENS_FIELD: 3})
    client.sadd(q.TENANTS, q.REQUESTS)  # the stream of callers without a tenant
    client.incrby(q.QUEUED, len(request_ids))
    client.incrby(q.QUEUED_TOKENS, 3 * len(request_ids))


def test_a_final_chunk_that_does_not_fit_waits_and_its_entry_stays_unacknowledged(full_redis):
    server, client, set_full = full_redis
    consumer = QueueConsumer(server.url, ServeConfig())
    consumer.reader.ensure_groups([q.REQUESTS])
    _queue(client, "r0")
    [taken] = consumer.reader.pull(1, None)
    set_full(True)
    final = Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=0, token_ids=[5], text="a", finish_reason="stop")],
                  done=True)
    consumer.outbox.send("r0", REPLY_TO, final)
    consumer.outbox.ack(taken.stream, taken.entry_id)
    with contextlib.suppress(redis.exceptions.OutOfMemoryError):  # raising is one way to say "not written"
        consumer.outbox.flush()
    # not written, so not acknowledged either: the entry is still this worker's
    assert client.xpending(q.REQUESTS, q.GROUP)["pending"] == 1
    set_full(False)
    consumer.outbox.flush()  # the next pass writes it, then acknowledges
    log = OutputLog(1)
    for chunk in chunks_of(client, REPLY_TO, "r0"):
        log.apply(chunk)
    assert log.done and log.completions[0].token_ids == [5]
    assert client.xpending(q.REQUESTS, q.GROUP)["pending"] == 0 and client.xlen(q.REQUESTS) == 0


def test_what_a_pull_takes_under_oom_is_served_and_counted_out(full_redis):
    server, client, set_full = full_redis
    consumer = QueueConsumer(server.url, ServeConfig())
    consumer.reader.ensure_groups([q.REQUESTS])
    _queue(client, "r1")
    set_full(True)
    taken = []
    with contextlib.suppress(redis.exceptions.OutOfMemoryError):
        taken += consumer.reader.pull(1, None)
    set_full(False)
    taken += consumer.reader.pull(1, None)  # if not taken under OOM, then now
    assert [t.request.request_id for t in taken] == ["r1"]
    assert int(client.get(q.QUEUED)) == 0 and int(client.get(q.QUEUED_TOKENS)) == 0


def test_a_full_redis_still_takes_the_heartbeat(full_redis):
    """Otherwise every worker would look dead and their requests would move between them."""
    server, client, set_full = full_redis
    consumer = QueueConsumer(server.url, ServeConfig(heartbeat_interval=0.1, worker_timeout=1.0), worker_id="w1")
    set_full(True)
    consumer.heartbeat.start(lambda: WorkerInfo(worker_id="w1", model="m", max_model_len=64, pid=1, host="h",
                                                 max_num_seqs=1))
    try:
        deadline = time.monotonic() + 10
        while client.zscore(q.WORKERS, "w1") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.zscore(q.WORKERS, "w1") is not None and client.exists(q.worker_key("w1"))
    finally:
        consumer.stop()
        set_full(False)
