"""`QueueClient`: the gateway's side of the Redis queue (admission, outputs, cancellation)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import cast

import msgspec
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.common import queue_protocol as q
from pagedserve.common import redis_clients
from pagedserve.common.errors import QueueFullError, ServiceUnavailableError, TenantLimitError
from pagedserve.common.output_log import OutputLog
from pagedserve.common.queue_protocol import (
    CompletionDelta,
    QueuedRequest,
    WorkerInfo,
    decode_worker_info,
    encode,
)
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.output_reader import OutputReader

logger = logging.getLogger(__name__)

#: how long a request waits for its next entries before it looks at deadlines and drain again
_WAIT_S = 0.5


class ShuttingDown(Exception):
    """The gateway's drain time ran out before the request finished."""


class RequestLost(Exception):
    """The request, or part of its output, no longer exists in Redis (it restarted without
    them): nobody will answer, or the answer would miss tokens."""


class QueueClient:
    def __init__(self, redis_url: str, config: ServeConfig, gateway_id: str | None = None):
        """`gateway_id` names this gateway's reply stream: a new one by default. Two clients
        given the same id read the same stream: only one may read it at a time."""
        self.config = config
        # The reader of the reply stream holds one connection while it waits in Redis. A pooled
        # connection that a Redis restart closed fails once and is retried on a new one
        # (admission is idempotent, so a retried XADD never queues a request twice).
        # With a Sentinel URL a retried connection asks the Sentinels for the primary again,
        # so after a failover the retry reaches the promoted replica (common/redis_clients.py).
        self.redis = redis_clients.async_client(
            redis_url, max_connections=4096, timeout=10, socket_connect_timeout=2,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._admit = self.redis.register_script(q.ADMIT)
        self._reconcile = self.redis.register_script(q.RECONCILE)
        self.gateway_id = gateway_id or uuid.uuid4().hex  # its reply stream's name
        self.reply_key = q.reply_key(self.gateway_id)
        # The worker running a request renews its admitted marker every heartbeat; the reader
        # checks them spaced so that two misses in a row cannot both fall before a renewal.
        self.reader = OutputReader(self.redis, self.reply_key, config.output_poll_interval,
                                   marker_check_interval=max(1.0, 2 * config.heartbeat_interval))

    async def close(self) -> None:
        await self.reader.close()
        await self.redis.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except RedisError:
            return False

    async def live_workers(self) -> list[WorkerInfo]:
        # decode_responses is off: members and values come back as bytes
        ids = cast("list[bytes]", await self.redis.zrangebyscore(q.WORKERS, time.time(), "+inf"))
        if not ids:
            return []
        infos = cast("list[bytes | None]", await self.redis.mget([q.worker_key(i.decode()) for i in ids]))
        return [decode_worker_info(x) for x in infos if x]

    async def routing_view(self) -> tuple[list[WorkerInfo], dict[str, tuple[int, int]]]:
        """The live workers' heartbeat infos, and per worker the requests and prompt tokens
        queued for it (routed to it and not yet taken), in two round trips."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(q.WORKERS, time.time(), "+inf")
        pipe.hgetall(q.WORKER_QUEUED)
        pipe.hgetall(q.WORKER_TOKENS)
        ids, requests, tokens = cast("tuple[list[bytes], dict[bytes, bytes], dict[bytes, bytes]]",
                                     await pipe.execute())
        infos = cast("list[bytes | None]", await self.redis.mget([q.worker_key(i.decode()) for i in ids])) if ids else []
        workers = []
        for data in infos:
            if data is None:
                continue
            try:
                workers.append(decode_worker_info(data))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("ignoring a malformed worker info: %s", exc)
        queued = {k.decode(): (int(v), int(tokens.get(k, 0))) for k, v in requests.items()}
        return workers, queued

    async def queued_totals(self) -> tuple[int, int]:
        """The queue's counters as they stand: requests and prompt tokens admitted and not yet taken."""
        requests, tokens = cast("list[bytes | None]", await self.redis.mget([q.QUEUED, q.QUEUED_TOKENS]))
        return int(requests or 0), int(tokens or 0)

    async def submit(self, request: QueuedRequest, max_requests: int | None = None,
                     max_queued_tokens: int | None = None, worker_id: str | None = None,
                     cached_tokens: int = 0) -> str:
        """Admit into the tenant's stream, or the stream routed to `worker_id` (the tenant's
        when that worker is no longer live), noting the prompt tokens that worker holds
        cached (`cached_tokens`: a thief waits longer for them); returns the stream written. Raises
        QueueFullError (TenantLimitError when the tenant's own limits, default the
        config's, are reached) / ServiceUnavailableError."""
        config = self.config
        request = msgspec.structs.replace(request, reply_to=self.reply_key)
        max_requests = max_requests or config.tenant_max_requests
        max_queued_tokens = max_queued_tokens or config.tenant_max_queued_tokens
        num_tokens = len(request.prompt_token_ids)
        args: list[int | float | bytes | str] = [
            config.max_queued_requests, config.max_queued_tokens, num_tokens, encode(request),
            max_requests, max_queued_tokens, self.marker_ttl, worker_id or "", cached_tokens,
            1 if config.queue_without_workers else 0]
        tenant_stream = q.requests_key(request.tenant)
        routed = q.routed_key(worker_id, request.tenant) if worker_id else tenant_stream
        keys = [tenant_stream, q.QUEUED, q.QUEUED_TOKENS, q.WORKERS, q.admitted_key(request.request_id),
                q.TENANTS, q.TENANT_TOKENS, routed, q.TENANT_ROUTED, q.WORKER_TOKENS, q.WORKER_QUEUED]
        # subscribed first: a worker may write its first chunk before the script's reply is read
        self.reader.subscribe(request.request_id, request.params.n)
        try:
            admitted, detail, *written = await self._admit(keys=keys, args=args)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self.reader.unsubscribe(request.request_id)
            raise ServiceUnavailableError(f"the queue is unreachable: {exc}") from None
        except RedisOutOfMemoryError:
            # Redis is at its maxmemory (noeviction) and refused the script before it wrote
            # anything: nothing was admitted, and a retry may fit.
            self.reader.unsubscribe(request.request_id)
            raise ServiceUnavailableError("the queue is out of memory (Redis maxmemory); retry later") from None
        except BaseException:
            self.reader.unsubscribe(request.request_id)
            raise
        if admitted:
            # a retried admission ("again") was written by the first try, wherever that was
            return written[0].decode() if written else tenant_stream
        self.reader.unsubscribe(request.request_id)
        if detail == b"no_worker":
            raise ServiceUnavailableError("no worker is serving this model right now; try again shortly")
        if detail == b"tenant_requests":
            raise TenantLimitError(f"your tenant has {max_requests} requests in flight, its limit; retry later",
                                   "tenant_requests_limit")
        if detail == b"tenant_tokens":
            raise TenantLimitError(f"your tenant has {max_queued_tokens} prompt tokens queued, its limit; retry later",
                                   "tenant_tokens_limit")
        raise QueueFullError(
            f"the queue is full ({config.max_queued_requests} requests or "
            f"{config.max_queued_tokens} prompt tokens); retry later"
        )

    @property
    def marker_ttl(self) -> int:
        """Seconds an admitted marker lives unless renewed: past any request's deadline."""
        return int(self.config.request_timeout) + 60

    async def reconcile(self) -> tuple[int, int]:
        """Set the queued counters from the streams themselves; returns (requests, tokens)."""
        queued, tokens = await self._reconcile(
            keys=[q.TENANTS, q.QUEUED, q.QUEUED_TOKENS, q.TENANT_TOKENS, q.TENANT_ROUTED, q.WORKER_TOKENS, q.WORKERS,
                  q.WORKER_QUEUED],
            args=[q.GROUP, q.ROUTED + ":", q.REQUESTS])
        return int(queued), int(tokens)

    async def outputs(self, request_id: str, n: int, deadline: float,
                      give_up: Callable[[], bool] = lambda: False) -> AsyncIterator[tuple[list[CompletionDelta], OutputLog]]:
        """The request's new deltas as they arrive, until its final outcome.

        Survives Redis going away for a while (the worker keeps its output until it can
        write it); raises TimeoutError past the deadline, ShuttingDown once `give_up()`, and
        RequestLost when the request's admitted marker stays gone (Redis restarted without
        it and no worker runs it: nobody will ever answer).
        """
        log = OutputLog(n)
        subscription = self.reader.open(request_id, n)  # subscribed at admission; Redis away: the reader waits
        try:
            while not log.done:
                if time.time() > deadline:
                    raise TimeoutError(request_id)
                if give_up():
                    raise ShuttingDown(request_id)
                try:
                    chunks = await asyncio.wait_for(subscription.chunks.get(), timeout=_WAIT_S)
                except TimeoutError:
                    chunks = []
                if subscription.lost:  # no marker any more, or its chunks trimmed unread
                    raise RequestLost(request_id)
                for chunk in chunks:
                    accepted = log.apply(chunk)
                    if log.gap:  # never hand out an answer with tokens missing in the middle
                        raise RequestLost(request_id)
                    if accepted or log.done:
                        yield accepted, log
        finally:
            self.reader.unsubscribe(request_id)

    async def cancel(self, request_id: str) -> None:
        """Abort a request wherever it is: queued (flag) or running (pub/sub to workers)."""
        self.reader.unsubscribe(request_id)  # its chunks still on their way are dropped
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(q.cancelled_key(request_id), 1, ex=q.OUTPUT_TTL)
                pipe.publish(q.CANCEL_CHANNEL, request_id)
                await pipe.execute()
        except RedisError as exc:
            logger.warning("could not cancel %s: %s", request_id, exc)
