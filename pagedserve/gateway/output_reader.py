"""`OutputReader`: how the gateway reads the outputs of the requests it admitted.

Every worker writes one entry per step into this gateway's reply stream
(queue_protocol.reply_key): the chunks of that step for this gateway's requests. One task
reads the stream with a single XREAD every `poll_interval` (ServeConfig.output_poll_interval)
and hands each chunk to the request it belongs to (`Subscription.chunks`), then trims what
it read. When a read found nothing, the next one waits in Redis (BLOCK, up to 5 s) and
returns at the first entry: an idle gateway hands over a first token at once, and a busy
one, whose reads always find entries, reads once a tick. So a step of a worker costs Redis one entry for all
its streams of this gateway, not one per stream, and a read is one key, not one per waiting
request (docs/scaling.md#redis-budget).

A request is subscribed before its admission (`QueueClient.submit`), so no chunk of it can
come before its subscription. Chunks of requests nobody waits on here (their client left)
are dropped. The reader folds each request's chunks itself (`Subscription.log`, as the
request's reader will): it is the record of what the client has been or will be sent, and a
worker that takes a request over asks for it with a claim chunk, which the reader answers
in the same round trip as its trim (`fold_key`), whether or not the client is reading
quickly; an answer Redis refused goes again at the next read. The reader runs from the
first subscription until `close`, so a claim of a request nobody waits on is answered too.
A slow client's chunks wait in this process, bounded by its request's output.

Entries lost: after a Redis failure, and every few seconds, the reader checks that the last
entry it read is still there (a restart or a promoted replica may have lost it, and give
new entries lower ids); if not, it reads again what the stream holds (harmless: each delta
is taken once). When it is far behind, it checks whether workers' MAXLEN trimmed entries it
had not read (`max-deleted-entry-id`): then every request it waits on ends with
request_lost, as it cannot know whose chunks were lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, Fold, OutputLog, StreamRead

logger = logging.getLogger(__name__)

#: entries read per read (COUNT); a stream that had more is read again at once
_COUNT = 512
#: seconds the reader waits after Redis failed, before it reads again
_RETRY_AFTER = 0.5
#: the longest a waiting read waits in Redis (the gateway's client has no socket timeout)
_MAX_WAIT_MS = 5000
#: seconds between two checks that the last entry read is still in the stream
_RESYNC_EVERY = 5.0
#: seconds a subscription nobody opened (`open`) is kept: its admission failed half-way
_UNOPENED_TTL = 120.0


class Subscription:
    """One request's outputs, as the reader hands them over."""

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.chunks: asyncio.Queue[list[Chunk]] = asyncio.Queue()  # new chunks, in order, a batch per read
        self.log = OutputLog(n)  # the reader's fold of every chunk handed over: a claim's answer
        self.opened = False  # its request's reader took it (QueueClient.outputs)
        self.created = time.monotonic()
        self.lost = False  # entries were trimmed unread: some of its chunks may be gone


class OutputReader:
    def __init__(self, client: aioredis.Redis, key: str, poll_interval: float):
        self.redis = client
        self.key = key  # this gateway's reply stream
        self.poll_interval = poll_interval
        self._subscriptions: dict[str, Subscription] = {}  # by request id
        self._last_id: bytes | str = "0-0"  # the last entry read; the next read starts after it
        self._answers: list[tuple[str, bytes]] = []  # (fold key, encoded Fold) not yet written
        self._next_sweep = 0.0
        self._next_resync = 0.0  # time.monotonic() of the next check of the cursor (0: at the next read)
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, request_id: str, n: int) -> Subscription:
        """Start handing over the chunks of `request_id` (with `n` completions); its
        subscription as it is if it has one (an admission tried again)."""
        if (subscription := self._subscriptions.get(request_id)) is not None:
            return subscription
        subscription = Subscription(request_id, n)
        self._subscriptions[request_id] = subscription
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="output-reader")
        return subscription

    def open(self, request_id: str, n: int) -> Subscription:
        """The subscription of an admitted request, for its reader (subscribed now if it was not)."""
        subscription = self.subscribe(request_id, n)
        subscription.opened = True
        return subscription

    def unsubscribe(self, request_id: str) -> None:
        self._subscriptions.pop(request_id, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        """Read every tick (waiting in Redis while nothing comes), until `close`."""
        loop = asyncio.get_running_loop()
        wait = False  # the last read found nothing: the next one waits in Redis for an entry
        while True:
            started = loop.time()
            try:
                found, more = await self._read_once(wait)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                logger.warning("reading the reply stream: redis unavailable (%s)", exc)
                wait, self._next_resync = False, 0.0
                await asyncio.sleep(_RETRY_AFTER)
                continue
            except RedisError as exc:
                logger.error("reading the reply stream failed: %s", exc)
                wait = False
                await asyncio.sleep(_RETRY_AFTER)
                continue
            self._sweep()
            if not found:
                wait = True  # read again at once, waiting in Redis (a waiting read that timed out too)
            elif not more:
                wait = False
                await asyncio.sleep(max(0.0, started + self.poll_interval - loop.time()))

    async def _read_once(self, wait: bool) -> tuple[bool, bool]:
        """One XREAD of the reply stream, waiting for an entry when `wait` (and no answer is
        left to write); hands the chunks over, answers the claims, trims what was read.
        Returns (whether it found entries, whether there were more than one read takes)."""
        if time.monotonic() >= self._next_resync:
            await self._resync_cursor()
        block = _MAX_WAIT_MS if wait and not self._answers else None
        reply = cast(StreamRead, await self.redis.xread({self.key: self._last_id}, count=_COUNT, block=block))
        entries = [e for _name, es in reply or [] for e in es]
        if not entries:
            if self._answers:
                await self._write_answers(self.redis.pipeline(transaction=False))
            return False, False
        if len(entries) == _COUNT:
            await self._check_trimmed()
        batches: dict[str, list[Chunk]] = {}
        answers = self._answers  # with any a failed write left
        for _entry_id, fields in entries:
            try:
                replies = q.decode_replies(fields[q.REPLIES_FIELD])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("ignoring a malformed entry of %s: %s", self.key, exc)
                continue
            for r in replies:
                subscription = self._subscriptions.get(r.request_id)
                if subscription is not None:
                    subscription.log.apply(r.chunk)
                    batches.setdefault(r.request_id, []).append(r.chunk)
                if r.chunk.claim:
                    fold = subscription.log.fold() if subscription is not None else Fold(waiting=False)
                    answers.append((q.fold_key(r.request_id, r.chunk.attempt), q.encode(fold)))
        self._last_id = entries[-1][0]
        for request_id, chunks in batches.items():
            self._subscriptions[request_id].chunks.put_nowait(chunks)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xtrim(self.key, minid=self._last_id, approximate=True)  # what was read goes (the last entry stays)
        await self._write_answers(pipe)
        return True, len(entries) == _COUNT

    async def _write_answers(self, pipe) -> None:
        """The claims' answers, with what `pipe` holds; kept for the next read if it fails."""
        for key, data in self._answers:
            pipe.rpush(key, data)
            pipe.expire(key, q.FOLD_TTL)
        await pipe.execute()  # raises with the answers kept
        self._answers.clear()

    async def _check_trimmed(self) -> None:
        """Far behind: did a worker's MAXLEN trim entries this reader had not read? Then the
        chunks of any request may be gone: each ends with request_lost."""
        info = await self.redis.xinfo_stream(self.key)
        deleted = info.get("max-deleted-entry-id", b"0-0")
        if self._last_id != "0-0" and _entry_id(deleted) > _entry_id(self._last_id):
            logger.error("%s was trimmed past what this gateway had read (it fell %s entries behind): "
                         "its %d waiting requests end with request_lost", self.key, info.get("length"),
                         len(self._subscriptions))
            for subscription in self._subscriptions.values():
                subscription.lost = True
                subscription.chunks.put_nowait([])  # wakes its reader

    async def _resync_cursor(self) -> None:
        """After Redis failed, and every few seconds (a failover the client's retries hid): a
        restarted Redis or a promoted replica may have lost the last entry read, and give new
        entries ids below it (another host's clock). Then everything
        the stream still holds is read again: little, as the reader trims what it read, and
        harmless, as a request's log takes each delta once (a claim is answered again)."""
        if self._last_id != "0-0" and not await self.redis.xrange(self.key, self._last_id, self._last_id):
            self._last_id = "0-0"
        self._next_resync = time.monotonic() + _RESYNC_EVERY

    def _sweep(self) -> None:
        """Forget subscriptions whose request's reader never came (admission failed half-way)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        for request_id in [r for r, s in self._subscriptions.items() if not s.opened and now - s.created > _UNOPENED_TTL]:
            del self._subscriptions[request_id]


def _entry_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)
