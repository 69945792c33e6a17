"""`OutputReader`: how the gateway reads the outputs of the requests it admitted.

Every worker writes one entry per step into this gateway's reply stream
(queue_protocol.reply_key): the chunks of that step for this gateway's requests. One task
reads the stream with a single XREAD every `poll_interval` (ServeConfig.output_poll_interval)
and hands each chunk to the request it belongs to (`Subscription.chunks`). Each tick is one
round trip: the trim of what the last read took, the answers to claims, the admitted
markers of the waiting requests when their check is due, then the XREAD. When a read found
nothing, the next one waits in Redis (BLOCK, up to 2 s) and returns at the first entry: an
idle gateway hands over a first token at once, and a busy one, whose reads always find
entries, reads once a tick. So a step of a worker costs Redis one entry for all its streams
of this gateway, not one per stream, and a tick one round trip, not one per waiting request
(docs/scaling.md#redis-budget).

A request is subscribed before its admission (`QueueClient.submit`), so no chunk of it can
come before its subscription. Chunks of requests nobody waits on here (their client left)
are dropped. The reader folds each request's chunks itself (`Subscription.log`, as the
request's reader will): it is the record of what the client has been or will be sent, and a
worker that takes a request over asks for it with a claim chunk, which the reader answers
at its next tick (`fold_key`), whether or not the client is reading quickly; an answer
Redis refused goes again at the tick after. The reader runs from the first subscription
until `close` (a later subscription starts it again), so a claim of a request nobody waits
on is answered too. A slow client's
chunks wait in this process, bounded by its request's output.

A request whose admitted marker two checks in a row (ServeConfig.heartbeat_interval × 2
apart) found gone no longer exists in Redis (it restarted without it, and no worker runs
it): `Subscription.lost`, and its reader ends it with request_lost.

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
from pagedserve.common.output_log import OutputLog
from pagedserve.common.queue_protocol import Chunk, Fold, StreamRead

logger = logging.getLogger(__name__)

#: entries read per read (COUNT); a stream that had more is read again at once
_COUNT = 512
#: seconds the reader waits after Redis failed, before it reads again
_RETRY_AFTER = 0.5
#: the longest a waiting read waits in Redis: below the client's socket timeout (redis-py's
#: default, 5 s), which would otherwise cut the connection of an idle gateway's read
_MAX_WAIT_MS = 2000
#: seconds between two checks that the last entry read is still in the stream
_RESYNC_EVERY = 5.0
#: seconds a subscription nobody opened (`open`) is kept: its admission failed half-way
_UNOPENED_TTL = 120.0
#: checks in a row that must miss a request's admitted marker before it counts as lost
_LOST_AFTER_MISSES = 2


class Subscription:
    """One request's outputs, as the reader hands them over."""

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.chunks: asyncio.Queue[list[Chunk]] = asyncio.Queue()  # new chunks, in order, a batch per read
        self.log = OutputLog(n)  # the reader's fold of every chunk handed over: a claim's answer
        self.opened = False  # its request's reader took it (QueueClient.outputs)
        self.created = time.monotonic()
        self.lost = False  # its chunks may be gone (trimmed unread) or nobody will write them (no marker)
        self.misses = 0  # checks in a row that found its admitted marker gone


class OutputReader:
    def __init__(self, client: aioredis.Redis, key: str, poll_interval: float, marker_check_interval: float):
        self.redis = client
        self.key = key  # this gateway's reply stream
        self.poll_interval = poll_interval
        self.marker_check_interval = marker_check_interval  # seconds between checks of the admitted markers
        self._subscriptions: dict[str, Subscription] = {}  # by request id
        self._last_id: bytes | str = "0-0"  # the last entry read; the next read starts after it
        self._answers: list[tuple[str, bytes]] = []  # (fold key, encoded Fold) not yet written
        self._trim_to: bytes | str | None = None  # the trim not yet made: entries below it were read
        self._next_marker_check = time.monotonic() + marker_check_interval
        self._next_sweep = 0.0
        self._next_resync = 0.0  # time.monotonic() of the next check of the cursor (0: at the next read)
        self._generation = 0  # the running loop's; `close` moves it on, which ends that loop
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, request_id: str, n: int) -> Subscription:
        """Start handing over the chunks of `request_id` (with `n` completions); its
        subscription as it is if it has one (an admission tried again)."""
        if (subscription := self._subscriptions.get(request_id)) is not None:
            return subscription
        subscription = Subscription(request_id, n)
        self._subscriptions[request_id] = subscription
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(self._generation), name="output-reader")
        return subscription

    def open(self, request_id: str, n: int) -> Subscription:
        """The subscription of an admitted request, for its reader (subscribed now if it was not)."""
        subscription = self.subscribe(request_id, n)
        subscription.opened = True
        return subscription

    def unsubscribe(self, request_id: str) -> None:
        self._subscriptions.pop(request_id, None)

    async def close(self) -> None:
        # The generation, not only the cancellation: redis-py may turn a cancellation that
        # meets a blocking read into a connection or timeout error, which the loop would read
        # past. A later subscription starts a new loop (an app's lifespan may start again).
        self._generation += 1
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._task, _MAX_WAIT_MS / 1000 + _RETRY_AFTER)
            self._task = None

    async def _run(self, generation: int) -> None:
        """Read every tick (waiting in Redis while nothing comes), until `close`."""
        loop = asyncio.get_running_loop()
        wait = False  # the last read found nothing: the next one waits in Redis for an entry
        while generation == self._generation:
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
        """One round trip: the claims' answers and the trim of what the last read took, the
        admitted markers of the requests waited on when a check is due, then one XREAD of
        the reply stream, waiting for an entry when `wait`. Hands the chunks over and notes
        the answers and the trim for the next round trip (a failed one keeps them). Returns
        (whether it found entries, whether there were more than one read takes)."""
        if time.monotonic() >= self._next_resync:
            await self._resync_cursor()
        pipe = self.redis.pipeline(transaction=False)
        answers, trim_to = list(self._answers), self._trim_to
        for key, data in answers:
            pipe.rpush(key, data)
            pipe.expire(key, q.FOLD_TTL)
        if trim_to is not None:
            pipe.xtrim(self.key, minid=trim_to, approximate=True)  # what was read goes (the last entry stays)
        checked = self._due_marker_checks()
        for s in checked:
            pipe.exists(q.admitted_key(s.request_id))
        pipe.xread({self.key: self._last_id}, count=_COUNT, block=_MAX_WAIT_MS if wait else None)
        results = await pipe.execute()  # raises (Redis away, full...) with the answers and the trim kept
        del self._answers[:len(answers)]
        if self._trim_to == trim_to:
            self._trim_to = None
        self._note_markers(checked, results[len(results) - 1 - len(checked):-1])
        entries = [e for _name, es in cast(StreamRead, results[-1]) or [] for e in es]
        if not entries:
            return False, False
        if len(entries) == _COUNT:
            await self._check_trimmed()
        batches: dict[str, list[Chunk]] = {}
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
                    self._answers.append((q.fold_key(r.request_id, r.chunk.attempt), q.encode(fold)))
        self._last_id = self._trim_to = entries[-1][0]
        for request_id, chunks in batches.items():
            self._subscriptions[request_id].chunks.put_nowait(chunks)
        return True, len(entries) == _COUNT

    def _due_marker_checks(self) -> list[Subscription]:
        """The requests whose admitted markers this round trip checks: every one read, once
        per `marker_check_interval`."""
        now = time.monotonic()
        if now < self._next_marker_check:
            return []
        self._next_marker_check = now + self.marker_check_interval
        return [s for s in self._subscriptions.values() if s.opened]

    def _note_markers(self, checked: list[Subscription], found: list) -> None:
        """A request whose marker two checks in a row missed no longer exists in Redis (it
        restarted without it, and no worker runs it): nobody will answer it."""
        for subscription, exists in zip(checked, found, strict=True):
            subscription.misses = 0 if exists else subscription.misses + 1
            if subscription.misses >= _LOST_AFTER_MISSES and not subscription.lost:
                subscription.lost = True
                subscription.chunks.put_nowait([])  # wakes its reader

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
