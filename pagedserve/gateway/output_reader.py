"""`OutputReader`: how the gateway reads the output streams of the requests it waits on.

One task reads every one of them with a single XREAD each `poll_interval`
(ServeConfig.output_poll_interval), and hands each stream's new entries to the request
that waits on it (`Subscription.batches`). A blocking XREAD per request would cost Redis a
command, a wake-up and a socket write per request and step, the largest share of its CPU
under load (`bench redis-load`); one read per tick costs a key lookup per waiting request,
and a token waits at most one tick longer. When a read found nothing at all, the next one
waits in Redis (BLOCK, one tick at most) and returns at the first entry written to any of
the streams: an idle gateway hands over a first token at once instead of at the next tick,
and a busy one, whose reads always find entries, reads once a tick as before. A stream
whose request has `max_backlog` batches it has not taken yet is left out of the reads
until it catches up, so a slow client's output waits in Redis, not in the gateway.

Entries are handed over in stream order, each once: what a request reads is exactly what
its stream holds, as with a reader of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.common.queue_protocol import StreamEntry, StreamRead

logger = logging.getLogger(__name__)

#: entries read from one stream per read (COUNT); a stream that had more is read again at once
_COUNT = 256
#: seconds the reader waits after Redis failed, before it reads again
_RETRY_AFTER = 0.5
#: the longest a waiting read waits in Redis (below the gateway client's 10 s socket timeout)
_MAX_WAIT_S = 5.0


class Subscription:
    """One request's output stream, as the reader hands it over."""

    def __init__(self, key: str):
        self.key = key  # the output stream (queue_protocol.output_key)
        self.last_id: bytes | str = "0-0"  # the last entry handed over; the next read starts after it
        self.batches: asyncio.Queue[list[StreamEntry]] = asyncio.Queue()  # new entries, in order


class OutputReader:
    def __init__(self, client: aioredis.Redis, poll_interval: float, max_backlog: int = 64):
        self.redis = client
        self.poll_interval = poll_interval
        self.max_backlog = max_backlog
        self._subscriptions: dict[str, Subscription] = {}  # by output key
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, key: str) -> Subscription:
        """Start handing over the entries of `key` (from its first); one subscription per stream."""
        if key in self._subscriptions:
            raise ValueError(f"{key} is read already")
        subscription = Subscription(key)
        self._subscriptions[key] = subscription
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="output-reader")
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        if self._subscriptions.get(subscription.key) is subscription:
            del self._subscriptions[subscription.key]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        """Read every tick while anyone waits; the task ends when nobody does."""
        loop = asyncio.get_running_loop()
        wait = False  # the last read found nothing: the next one waits in Redis for an entry
        while self._subscriptions:
            started = loop.time()
            try:
                found, more = await self._read_once(wait)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                logger.warning("reading the output streams: redis unavailable (%s)", exc)
                wait = False
                await asyncio.sleep(_RETRY_AFTER)
                continue
            except RedisError as exc:
                logger.error("reading the output streams failed: %s", exc)
                wait = False
                await asyncio.sleep(_RETRY_AFTER)
                continue
            if found is None:  # no stream with room: nothing to wait on in Redis
                wait = False
                await asyncio.sleep(max(0.0, started + self.poll_interval - loop.time()))
            elif not found:
                wait = True  # read again at once, waiting in Redis (a waiting read that timed out too)
            elif not more:
                wait = False
                await asyncio.sleep(max(0.0, started + self.poll_interval - loop.time()))

    async def _read_once(self, wait: bool) -> tuple[bool | None, bool]:
        """One XREAD of every stream with room, waiting up to a tick for an entry when `wait`.
        Returns (whether it found entries, None when no stream had room; whether a stream had
        more than one read takes)."""
        streams: dict[bytes | str | memoryview, int | bytes | str | memoryview] = {
            key: s.last_id for key, s in self._subscriptions.items() if s.batches.qsize() < self.max_backlog}
        if not streams:
            return None, False
        block = max(1, round(min(self.poll_interval, _MAX_WAIT_S) * 1000)) if wait else None
        reply = cast(StreamRead, await self.redis.xread(streams, count=_COUNT, block=block))
        found = more = False
        for name, entries in reply or []:
            subscription = self._subscriptions.get(name.decode())
            if subscription is None or not entries:
                continue  # its request stopped waiting meanwhile
            subscription.last_id = entries[-1][0]
            subscription.batches.put_nowait(entries)
            found = True
            more = more or len(entries) == _COUNT
        return found, more
