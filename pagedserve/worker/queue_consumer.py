"""`QueueConsumer`: the worker's side of the Redis queue, mirroring the gateway's
`QueueClient`. It reads requests, takes over those of dead workers, writes output chunks,
acknowledges entries, listens for cancellations and keeps the heartbeat.

Requests wait in one stream per tenant, and in streams routed to one worker (per worker and
tenant, `queue_protocol.routed_key`). A pull reads in this order (`StreamView`):
1. this worker's own routed streams;
2. the shared tenant streams, and the routed streams of workers no longer live (orphans: a
   dead worker's unread entries are everyone's);
3. with room left and nothing read, the entries of live workers' routed streams that have
   waited longer than `steal_after` (their owner is too busy): a steal.
Each step shares the room among its streams in turn (`fair_shares`), so a tenant that floods
the queue does not push another tenant's request back behind its own.

Its promises (the gateway relies on them):
- an entry is acknowledged only at its final outcome, and only by the worker that owns it;
- a heartbeat thread keeps the worker's entries fresh, so XAUTOCLAIM moves only the entries
  of a worker that stopped; before a new owner resumes a request it fences the old owner
  off in the output stream and reads what the client has been sent;
- writes are batched into one round trip per pass and kept for a retry while Redis is away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import msgspec
import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.errors import PagedServeError
from pagedserve.common.queue_protocol import (
    Chunk,
    OutputLog,
    QueuedRequest,
    StreamEntry,
    StreamRead,
    WorkerInfo,
    decode_chunk,
    decode_request,
    encode,
)
from pagedserve.common.serve_config import ServeConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TakenEntry:
    """A request this worker took from the queue."""

    stream: str  # the stream it waits in (a tenant stream, or a routed one)
    entry_id: str  # in that stream
    request: QueuedRequest
    attempt: int  # delivery count: 1 unless other workers died with it
    stolen: bool = False  # taken from another worker's routed stream (that worker busy or dead)


@dataclass(frozen=True, slots=True)
class StreamView:
    """The request streams as one worker sees them at one pull."""

    own: list[str]  # routed to this worker
    shared: list[str]  # the tenant streams, and the routed streams of workers no longer live
    others: list[str]  # routed to other live workers: stolen from once their entries wait too long
    orphaned: frozenset[str] = frozenset()  # of `shared`, the routed ones (reading them is a steal)

    @property
    def all(self) -> list[str]:
        return self.own + self.shared + self.others


@dataclass(frozen=True, slots=True)
class OwnedEntry:
    """A request this worker runs, as its heartbeat keeps it."""

    stream: str
    entry_id: str
    request_id: str


#: rounds of one pull that hand the room an idle tenant left to the busy ones
_PULL_ROUNDS = 3


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def fair_shares(streams: list[str], room: int, start: int) -> dict[str, int]:
    """How many entries to read from each tenant stream: `room` split evenly, round-robin
    from `start`, so a tenant that floods the queue takes no more than its share of a
    pull and every other tenant's next request is taken at the next pull. With less room
    than streams, the first `room` streams in turn get one each (`start` rotates)."""
    if not streams or room <= 0:
        return {}
    order = streams[start % len(streams):] + streams[: start % len(streams)]
    per_stream, extra = divmod(room, len(order))
    return {s: per_stream + (i < extra) for i, s in enumerate(order) if per_stream + (i < extra) > 0}


class QueueConsumer:
    def __init__(self, redis_url: str, config: ServeConfig, worker_id: str | None = None):
        self.config = config
        self.worker_id = q.check_worker_id(worker_id or new_worker_id())
        self.redis = redis.Redis.from_url(redis_url, socket_connect_timeout=2, health_check_interval=10)
        self._count_taken = self.redis.register_script(q.TAKEN)
        self._steal = self.redis.register_script(q.STEAL)
        self._ack_if_owner = self.redis.register_script(q.ACK_IF_OWNER)
        self._heartbeat_script = self.redis.register_script(q.HEARTBEAT)
        self._outbox: list[tuple[str, bytes]] = []  # (output key, chunk; b"": delete) not yet written
        self._acks: list[tuple[str, str]] = []  # (stream, entry id) to acknowledge with the next write
        self._owned: tuple[OwnedEntry, ...] = ()  # for the heartbeat thread (swapped whole)
        self._lost: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # (stream, entry id) another worker took
        self._pubsub: redis.client.PubSub | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._turn = 0  # the tenant stream the next pull starts from (round-robin)
        self._beating = True  # False while the step loop is stalled (see start_heartbeat)
        self.num_stolen = 0  # entries taken from other workers' routed streams, since start

    # -- reading ------------------------------------------------------------------------------
    def tenant_streams(self) -> list[str]:
        """Every request stream that may hold requests (tenant and routed), in a fixed order."""
        return sorted(s.decode() for s in cast("set[bytes]", self.redis.smembers(q.TENANTS)))

    def streams(self) -> StreamView:
        """The request streams, sorted into this worker's own, the shared ones and other live
        workers' (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(q.TENANTS)
        pipe.zrangebyscore(q.WORKERS, time.time(), "+inf")
        members, live_ids = pipe.execute()
        live = {x.decode() for x in live_ids}
        own: list[str] = []
        shared: list[str] = []
        others: list[str] = []
        orphaned = set()
        for stream in sorted(x.decode() for x in members):
            owner = q.routed_owner(stream)
            if owner is None:
                shared.append(stream)
            elif owner == self.worker_id:
                own.append(stream)
            elif owner in live:
                others.append(stream)
            else:
                shared.append(stream)
                orphaned.add(stream)
        return StreamView(own, shared, others, frozenset(orphaned))

    def pull(self, room: int, block_ms: int | None, view: StreamView | None = None,
             steal: bool = True) -> list[TakenEntry]:
        """Up to `room` new requests: from this worker's own routed streams first, then the
        shared ones, each shared fairly among its streams (`fair_shares`); with room left,
        nothing read and `steal`, stolen from other workers' streams (entries older than steal_after);
        waiting up to `block_ms` for the own and shared streams when none are queued (None:
        do not wait). They are counted out of the queue's bounds at once."""
        view = self.streams() if view is None else view
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        try:
            entries += self._read_fairly(view.own, room)
            entries += self._read_fairly(view.shared, room - len(entries))
            if steal and not entries and room > 0 and view.others:
                entries += self._read_stolen(view.others, room)
            if not entries and block_ms:
                entries += self._wait_and_read(view.own + view.shared, room, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis restarted: the tenant streams come back with their groups (routed ones
            # come back at their next admission)
            self.ensure_groups(s for s in view.shared if q.routed_owner(s) is None)
        if not entries:
            return []
        tenant_tokens: dict[str, int] = {}
        worker_taken: dict[str, tuple[int, int]] = {}  # worker routed to → (requests, tokens)
        for key, _, fields in entries:
            n = int(fields.get(q.PROMPT_TOKENS_FIELD, 0))
            tenant = q.tenant_stream_of(key)
            tenant_tokens[tenant] = tenant_tokens.get(tenant, 0) + n
            if (owner := q.routed_owner(key)) is not None:
                requests, tokens = worker_taken.get(owner, (0, 0))
                worker_taken[owner] = (requests + 1, tokens + n)
        self._count_taken(keys=[q.QUEUED, q.QUEUED_TOKENS, q.TENANT_TOKENS, q.WORKER_TOKENS, q.WORKER_QUEUED],
                          args=[len(entries), sum(tenant_tokens.values()), len(tenant_tokens),
                                *[x for pair in tenant_tokens.items() for x in pair],
                                *[x for worker, (r, t) in worker_taken.items() for x in (worker, r, t)]])
        stolen = set(view.others) | view.orphaned
        taken = self._decoded((key, eid, fields, 1) for key, eid, fields in entries)
        for entry in taken:
            entry.stolen = entry.stream in stolen
        self.num_stolen += sum(entry.stolen for entry in taken)
        return taken

    def _read_fairly(self, streams: list[str], room: int) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Up to `room` new entries of these streams, shared fairly, without waiting.
        Rounds: the room a stream could not use (it held fewer than its share) goes to the
        streams that filled theirs, so one busy tenant among idle ones still fills it."""
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        shares = fair_shares(streams, room, self._turn)
        self._turn += len(shares)
        for _ in range(_PULL_ROUNDS):
            if not shares:
                break
            got = self._read(shares, None)
            entries += got
            counts = Counter(stream for stream, _, _ in got)
            full = [s for s in shares if counts[s] == shares[s]]
            shares = fair_shares(full, room - len(entries), 0)
        return entries

    def _wait_and_read(self, streams: list[str], room: int, block_ms: int) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Idle: wait up to `block_ms` for the first request of any of these streams, then
        read up to `room` fairly."""
        shares = fair_shares(streams, room, self._turn)
        if not shares:
            self.wait(block_ms / 1000)
            return []
        self._turn += len(shares)
        entries = self._read(dict.fromkeys(shares, 1), block_ms)
        if entries:
            entries += self._read_fairly(streams, room - len(entries))
        return entries

    def _read_stolen(self, streams: list[str], room: int) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Up to `room` entries of other live workers' routed streams that waited longer than
        steal_after, plus steal_cached_token_ms for each prompt token their worker holds
        cached (the STEAL script: atomic, so never one younger)."""
        delay_ms = int(self.config.steal_after * 1000)
        reply = self._steal(keys=streams, args=[q.GROUP, self.worker_id, room, delay_ms,
                                                self.config.steal_cached_token_ms])
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        for name, read in reply or []:
            for eid, flat in read:
                fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}
                if fields:
                    entries.append((name.decode(), eid.decode(), fields))
        return entries

    def _read(self, shares: dict[str, int], block_ms: int | None) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """New entries of these streams, up to each one's share: (stream, entry id, fields).
        Only the first command blocks (the callers block only with every share 1: one command)."""
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        # One XREADGROUP per share size (COUNT applies to each stream of a command).
        for count in sorted(set(shares.values()), reverse=True):
            keys: dict[str | bytes | memoryview, str | int | bytes | memoryview] = {
                s: ">" for s, c in shares.items() if c == count}
            reply = cast(StreamRead, self.redis.xreadgroup(q.GROUP, self.worker_id, keys, count=count,
                                                           block=block_ms if not entries else None))
            for name, read in reply or []:
                entries += [(name.decode(), eid.decode(), fields) for eid, fields in read if fields]
            block_ms = None
        return entries

    def reclaim(self, room: int) -> list[TakenEntry]:
        """Up to `room` entries of workers whose heartbeat stopped, now this worker's (from
        every request stream: the tenant ones and the routed ones, of any worker)."""
        claimed: list[tuple[str, str, dict[bytes, bytes], int]] = []
        for stream in self.tenant_streams():
            if len(claimed) >= room:
                break
            try:
                reply = self.redis.xautoclaim(stream, q.GROUP, self.worker_id, count=room - len(claimed),
                                              min_idle_time=int(self.config.worker_timeout * 1000))
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue
            for entry_id, fields in reply[1]:
                if not fields:
                    continue
                entry_id = entry_id.decode()
                pending = self.redis.xpending_range(stream, q.GROUP, min=entry_id, max=entry_id, count=1)
                attempt = cast(int, pending[0]["times_delivered"]) if pending else 2
                logger.warning("worker %s takes over entry %s of %s (delivery %d)", self.worker_id, entry_id, stream, attempt)
                claimed.append((stream, entry_id, fields, attempt))
        return self._decoded(claimed)

    def _decoded(self, entries: Iterable[tuple[str, str, dict[bytes, bytes], int]]) -> list[TakenEntry]:
        taken = []
        for stream, entry_id, fields, attempt in entries:
            try:
                request = decode_request(fields[q.REQUEST_FIELD])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError, PagedServeError) as exc:
                logger.error("dropping malformed queue entry %s of %s: %s", entry_id, stream, exc)
                self.ack(stream, entry_id)
                continue
            taken.append(TakenEntry(stream, entry_id, request, attempt))
        return taken

    def ensure_groups(self, streams: Iterable[str]) -> None:
        for stream in streams:
            try:
                self.redis.xgroup_create(stream, q.GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def is_cancelled(self, request_id: str) -> bool:
        """Whether the client left while the request was queued."""
        return bool(self.redis.exists(q.cancelled_key(request_id)))

    def cancellations(self) -> list[str]:
        """Request ids whose clients went away since the last call."""
        if self._pubsub is None:
            self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(q.CANCEL_CHANNEL)
        ids = []
        while (message := self._pubsub.get_message(timeout=0)) is not None:
            ids.append(message["data"].decode())
        return ids

    def lost_entries(self) -> set[tuple[str, str]]:
        """Entries the heartbeat found in another worker's hands."""
        lost = set()
        while not self._lost.empty():
            lost.add(self._lost.get())
        return lost

    def claim_output(self, request_id: str, attempt: int, n: int) -> OutputLog:
        """Fence older attempts off in the request's output stream, then fold what the
        client has been sent (pending writes go first)."""
        self.flush()
        key = q.output_key(request_id)
        claim_id = self.redis.xadd(key, {q.CHUNK_FIELD: encode(Chunk(attempt=attempt, claim=True))})
        log = OutputLog(n)
        for _, fields in cast("list[StreamEntry]", self.redis.xrange(key, "-", claim_id)):
            log.apply(decode_chunk(fields[q.CHUNK_FIELD]))
        return log

    def connection_lost(self) -> None:
        """Redis went away: subscribe again once it is back."""
        self._pubsub = None

    # -- writing ------------------------------------------------------------------------------
    def send(self, request_id: str, chunk: Chunk) -> None:
        self._outbox.append((q.output_key(request_id), encode(chunk)))

    def delete_output(self, request_id: str) -> None:
        self._outbox.append((q.output_key(request_id), b""))

    def ack(self, stream: str, entry_id: str) -> None:
        self._acks.append((stream, entry_id))

    def flush(self) -> None:
        """Write queued chunks, then acks. Everything is kept for a retry while Redis is away
        (connection errors raise) or full (its OOM error is raised): an entry is never
        acknowledged before its final chunk is written."""
        if self._outbox:
            pipe = self.redis.pipeline(transaction=False)
            for key, data in self._outbox:
                if data:
                    pipe.xadd(key, {q.CHUNK_FIELD: data})
                    pipe.expire(key, q.OUTPUT_TTL)
                else:
                    pipe.delete(key)
            results = pipe.execute(raise_on_error=False)
            full = [r for r in results if isinstance(r, redis.exceptions.OutOfMemoryError)]
            if full:
                # All chunks are written again: the readers' OutputLog takes a delta only
                # where its completion stands, so a chunk written twice counts once.
                raise full[0]
            self._outbox.clear()
            for result in results:
                if isinstance(result, Exception):
                    logger.error("redis write failed: %s", result)
        if self._acks:
            pipe = self.redis.pipeline(transaction=False)
            for stream, entry_id in self._acks:
                tenant = q.tenant_stream_of(stream)
                self._ack_if_owner(keys=[stream, q.TENANT_ROUTED],
                                   args=[q.GROUP, self.worker_id, entry_id, "" if tenant == stream else tenant],
                                   client=pipe)
            results = pipe.execute(raise_on_error=False)
            self._acks.clear()
            for result in results:
                # After a Redis restart the group is gone and acks fail: nothing is left to ack.
                if isinstance(result, Exception) and "NOGROUP" not in str(result):
                    logger.error("redis ack failed: %s", result)

    # -- heartbeat ----------------------------------------------------------------------------
    def set_owned(self, entries: Iterable[OwnedEntry]) -> None:
        """The entries the heartbeat keeps fresh (swapped whole: the thread reads it whole)."""
        self._owned = tuple(entries)

    def start_heartbeat(self, info: Callable[[], WorkerInfo], alive: Callable[[], bool] = lambda: True) -> None:
        """Beat every heartbeat_interval while `alive()` (the worker's step loop is moving): a
        frozen loop stops beating, and its entries move to other workers after worker_timeout."""
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(info, alive), name="heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self, info: Callable[[], WorkerInfo], alive: Callable[[], bool]) -> None:
        ttl_ms = int(self.config.worker_timeout * 1000)
        marker_ttl = int(self.config.request_timeout) + 60
        while not self._stop.is_set():
            if not self._loop_alive(alive):
                self._stop.wait(self.config.heartbeat_interval)
                continue
            owned = [x for e in self._owned for x in (e.stream, e.entry_id, q.admitted_key(e.request_id))]
            try:
                lost = self._heartbeat_script(keys=[q.WORKERS, q.worker_key(self.worker_id)],
                                              args=[q.GROUP, self.worker_id, ttl_ms, encode(info()), marker_ttl, *owned])
                for stream, entry_id in zip(lost[::2], lost[1::2], strict=True):
                    self._lost.put((stream.decode(), entry_id.decode()))
            except redis.ResponseError as exc:
                logger.error("heartbeat failed: %s", exc)
            except redis.RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)
            self._stop.wait(self.config.heartbeat_interval)

    def _loop_alive(self, alive: Callable[[], bool]) -> bool:
        """`alive()`, logging each change: a stalled loop is a worker that looks dead."""
        now_alive = alive()
        if now_alive != self._beating:
            if now_alive:
                logger.warning("worker %s: its step loop moves again; beating again", self.worker_id)
            else:
                logger.error("worker %s: its step loop has not completed a pass within %g s; heartbeat paused, "
                             "its requests move to other workers", self.worker_id, self.config.worker_timeout)
            self._beating = now_alive
        return now_alive

    def wait(self, seconds: float) -> bool:
        """Sleep, unless stopped; True when stopped."""
        return self._stop.wait(seconds)

    def stop(self) -> None:
        """Stop the heartbeat and leave the worker set."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            self.redis.zrem(q.WORKERS, self.worker_id)
            self.redis.delete(q.worker_key(self.worker_id))
