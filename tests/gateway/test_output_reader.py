"""The gateway's reader of its reply stream: every request it waits on is read by one XREAD a
tick, each gets exactly its own chunks, in order; a worker's claim is answered with what the
client has been sent; what was read is trimmed."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import (
    Chunk,
    CompletionDelta,
    QueuedRequest,
    Reply,
    decode_fold,
    encode_replies,
)
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient

N = 20  # requests waited on at once
GATEWAY = "g1"
KEY = q.reply_key(GATEWAY)


def _chunk(start: int, token: int, last: bool = False, attempt: int = 1) -> Chunk:
    return Chunk(attempt=attempt, done=last, deltas=[CompletionDelta(
        index=0, start=start, token_ids=[token], text="t", finish_reason="length" if last else None)])


def _write(client: redis.Redis, replies: list[Reply]) -> None:
    client.xadd(KEY, {q.REPLIES_FIELD: encode_replies(replies)})


async def _read(client: QueueClient, request_id: str) -> list[int]:
    log = None
    async for _deltas, out in client.outputs(request_id, 1, time.time() + 30):
        log = out
    assert log is not None and log.done
    return log.completions[0].token_ids


def test_requests_waiting_at_once_are_read_by_one_xread_each_their_own_tokens():
    """As workers write them: one entry per step, holding a chunk of every request that made
    a token in it."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        expected = {f"r{i}": [1000 * i + k for k in range(5 + i)] for i in range(N)}
        for step in range(5 + N):
            _write(admin, [Reply(r, _chunk(step, tokens[step], step == len(tokens) - 1))
                           for r, tokens in expected.items() if step < len(tokens)])
        admin.config_resetstat()

        async def read_all() -> dict[str, list[int]]:
            client = QueueClient(server.url, ServeConfig(output_poll_interval=1.0), GATEWAY)
            try:
                tokens = await asyncio.gather(*(_read(client, r) for r in expected))
            finally:
                await client.close()
            return dict(zip(expected, tokens, strict=True))

        assert asyncio.run(read_all()) == expected
        stats = admin.info("commandstats")
        assert stats["cmdstat_xread"]["calls"] == 1  # all N requests, one command
        admin.close()


def test_an_idle_reader_waits_in_redis_and_hands_a_first_entry_over_at_once():
    """After a read that found nothing, the next one waits in Redis (XREAD BLOCK) for the
    first entry: it is handed over by that read, not at the next tick (5 s here)."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)

        async def scenario() -> list[int]:
            client = QueueClient(server.url, ServeConfig(output_poll_interval=5.0), GATEWAY)
            try:
                reading = asyncio.create_task(_read(client, "idle"))
                for _ in range(1000):  # until the reader's second read waits in Redis
                    if admin.info("clients")["blocked_clients"] == 1:
                        break
                    await asyncio.sleep(0.01)
                assert admin.info("commandstats")["cmdstat_xread"]["calls"] == 2
                final = Chunk(attempt=1, done=True, deltas=[CompletionDelta(index=0, start=0, token_ids=[7, 8, 9],
                                                                             text="t", finish_reason="length")])
                _write(admin, [Reply("idle", final)])  # one entry: one wake-up
                return await asyncio.wait_for(reading, 30)  # a guard: the tick would come after 5 s
            finally:
                await client.close()

        assert asyncio.run(scenario()) == [7, 8, 9]
        # the waiting read returned with the entry; the request then had all it waited for
        assert admin.info("commandstats")["cmdstat_xread"]["calls"] == 2
        admin.close()


def test_a_claim_is_answered_with_what_the_client_was_sent_and_voids_the_old_attempt():
    """A worker takes the request over as attempt 2: the reader answers its claim with the
    tokens taken before it (those after it from attempt 1 are void, as the client's own log
    says), and the request ends with attempt 2's tokens. A claim of a request nobody waits
    on here is answered `waiting=False`."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)

        async def scenario() -> list[int]:
            client = QueueClient(server.url, ServeConfig(output_poll_interval=0.01), GATEWAY)
            try:
                reading = asyncio.create_task(_read(client, "r"))
                await asyncio.sleep(0)  # subscribed
                _write(admin, [Reply("r", _chunk(0, 10)), Reply("r", _chunk(1, 11))])
                _write(admin, [Reply("r", Chunk(attempt=2, claim=True)), Reply("gone", Chunk(attempt=3, claim=True))])
                _write(admin, [Reply("r", _chunk(2, 99))])  # the old owner, still writing: void
                answer = await asyncio.to_thread(admin.blpop, [q.fold_key("r", 2)], 10)
                assert answer is not None
                fold = decode_fold(answer[1])
                assert fold.waiting and not fold.done and fold.completions[0].token_ids == [10, 11]
                gone = await asyncio.to_thread(admin.blpop, [q.fold_key("gone", 3)], 10)
                assert gone is not None and not decode_fold(gone[1]).waiting
                _write(admin, [Reply("r", _chunk(2, 12, attempt=2)), Reply("r", _chunk(3, 13, last=True, attempt=2))])
                return await asyncio.wait_for(reading, 30)
            finally:
                await client.close()

        assert asyncio.run(scenario()) == [10, 11, 12, 13]
        admin.close()


def test_a_request_is_subscribed_at_admission_so_no_early_chunk_is_lost():
    """A worker can write a request's first chunk before its gateway starts reading it (the
    admission's reply still on its way): the subscription made at `submit` keeps it."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)

        async def scenario() -> list[int]:
            client = QueueClient(server.url, ServeConfig(queue_without_workers=True), GATEWAY)
            try:
                request = QueuedRequest(request_id="early", prompt_token_ids=[1, 2], deadline=time.time() + 30,
                                        params=SamplingParams(max_tokens=2))
                await client.submit(request)
                [(_, [(_, fields)])] = admin.xread({q.REQUESTS: "0-0"})
                assert q.decode_request(fields[q.REQUEST_FIELD]).reply_to == KEY  # stamped by submit
                _write(admin, [Reply("early", _chunk(0, 5)), Reply("stranger", _chunk(0, 6))])
                _write(admin, [Reply("early", _chunk(1, 6, last=True))])
                for _ in range(500):  # the reader takes both entries before anyone reads "early"
                    if admin.xinfo_stream(KEY)["entries-added"] == 2 and client.reader._last_id != "0-0":
                        break
                    await asyncio.sleep(0.01)
                return await asyncio.wait_for(_read(client, "early"), 30)
            finally:
                await client.close()

        assert asyncio.run(scenario()) == [5, 6]
        admin.close()


def test_after_redis_failed_the_reader_reads_on_from_what_the_stream_still_holds():
    """A restarted Redis or a promoted replica may have lost the last entry read, and give new
    entries ids below it (another host's clock): after a failure, the reader reads again what
    the stream holds."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)

        async def scenario() -> list[int]:
            client = QueueClient(server.url, ServeConfig(), GATEWAY)
            try:
                client.reader._last_id = b"9999999999999-0"  # read on a primary whose clock ran ahead
                reading = asyncio.create_task(_read(client, "r"))
                _write(admin, [Reply("r", _chunk(0, 4))])
                _write(admin, [Reply("r", _chunk(1, 5, last=True))])
                return await asyncio.wait_for(reading, 30)
            finally:
                await client.close()

        assert asyncio.run(scenario()) == [4, 5]
        admin.close()


def test_a_reply_stream_trimmed_past_what_was_read_ends_every_waiting_request_visibly(monkeypatch):
    """A gateway far behind (a read returns COUNT entries) whose unread entries a worker's
    MAXLEN trimmed cannot know whose chunks went: its requests end with request_lost
    instead of waiting for a final chunk that is gone."""
    from pagedserve.gateway import output_reader
    from pagedserve.gateway.queue_client import RequestLost

    monkeypatch.setattr(output_reader, "_COUNT", 2)
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        ids = [admin.xadd(KEY, {q.REPLIES_FIELD: encode_replies([Reply("r", _chunk(i, 10 + i))])}) for i in range(4)]
        admin.xdel(KEY, ids[1])  # as MAXLEN ~ would: the entry after the last one read, unread

        async def scenario() -> None:
            client = QueueClient(server.url, ServeConfig(), GATEWAY)
            try:
                client.reader._last_id = ids[0]  # read up to here
                await asyncio.wait_for(_read(client, "r"), 30)
            finally:
                await client.close()

        with pytest.raises(RequestLost):
            asyncio.run(scenario())
        admin.close()


def test_a_claim_is_answered_while_nobody_waits_on_anything():
    """The reader keeps reading once started: a worker's claim for a request whose client left
    is answered `waiting=False` even when no request waits here any more."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)

        async def scenario() -> bool:
            client = QueueClient(server.url, ServeConfig(), GATEWAY)
            try:
                reading = asyncio.create_task(_read(client, "done"))
                _write(admin, [Reply("done", _chunk(0, 1, last=True))])
                await asyncio.wait_for(reading, 30)
                _write(admin, [Reply("left", Chunk(attempt=2, claim=True))])
                answer = await asyncio.to_thread(admin.blpop, [q.fold_key("left", 2)], 10)
                assert answer is not None
                return decode_fold(answer[1]).waiting
            finally:
                await client.close()

        assert asyncio.run(scenario()) is False
        admin.close()


def test_what_the_reader_read_is_trimmed_at_its_next_tick():
    """XTRIM MINID ~ the last entry read, in the next tick's round trip: whole nodes of entries
    read go (how many entries a node holds is Redis's: stream-node-max-entries and -bytes),
    the node of the last entry read stays."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        for i in range(250):
            _write(admin, [Reply("long", _chunk(i, i, last=i == 249))])

        last = admin.xrevrange(KEY, count=1)[0][0]

        async def scenario() -> int:
            client = QueueClient(server.url, ServeConfig(output_poll_interval=0.01), GATEWAY)
            try:
                assert len(await asyncio.wait_for(_read(client, "long"), 30)) == 250
                for _ in range(500):
                    if admin.xlen(KEY) < 250:
                        break
                    await asyncio.sleep(0.01)
                return admin.xlen(KEY)
            finally:
                await client.close()

        assert 0 < asyncio.run(scenario()) < 250
        assert admin.xrange(KEY, last, last)  # never past what was read
        admin.close()


def test_a_reader_closed_reads_again_for_a_later_request():
    """An app's lifespan can end and start again around the same QueueClient (close, then new
    requests): the next subscription starts the reader again."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)

        async def scenario() -> list[int]:
            client = QueueClient(server.url, ServeConfig(), GATEWAY)
            try:
                first = asyncio.create_task(_read(client, "a"))
                _write(admin, [Reply("a", _chunk(0, 1, last=True))])
                assert await asyncio.wait_for(first, 30) == [1]
                await client.close()
                second = asyncio.create_task(_read(client, "b"))
                _write(admin, [Reply("b", _chunk(0, 2, last=True))])
                return await asyncio.wait_for(second, 30)
            finally:
                await client.close()

        assert asyncio.run(scenario()) == [2]
        admin.close()
