"""`Outbox`: what the worker writes back to Redis. Output chunks and acknowledgements wait
here until `flush` writes them all in one round trip per pass (one MULTI/EXEC), in the order
they were made. The hot path is one command per gateway per step and nothing more:
- one XADD per reply stream (queue_protocol.reply_key): every chunk of this pass for the
  requests of one gateway is one entry, a list of `Reply`s, in order. The chunks a request
  gets before a flush are merged into one (their deltas in order), and a step's several
  tokens are one delta already. The entry's cost to Redis is shared by all its requests;
- the reply stream's TTL renewed with each entry (one EXPIRE per gateway per step, not per
  request), so a stream whose gateway is gone expires once workers stop writing to it;
- a request's final chunk and the ack of its entry (ACK_IF_OWNER) are in the same
  transaction: refused whole while Redis is full (the XADD's OOM aborts it, when queued or
  at EXEC), so an entry is never acknowledged before its final chunk is written;
- the script runs by EVALSHA (no SCRIPT EXISTS round trip before it); after a Redis restart
  forgot it, it is loaded and the acks that failed are sent again.
With an `interval` (ServeConfig.output_interval), a running request's chunks go out at most
once per interval, merged: its first chunk and its final one go at once. That trades how
often a client hears of new tokens for fewer bytes; the entries per step stay one per gateway.
Everything is kept for a retry while Redis is away (connection errors raise), full (its
OOM error or EXECABORT is raised) or refuses the transaction otherwise (READONLY during a
failover...). A write repeated that way is harmless: readers take a delta only where
its completion stands (`OutputLog`), and an ack goes through only for the worker that owns
the entry (ACK_IF_OWNER).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, Reply

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Write:
    """One write waiting for the next flush: a chunk, an ack, or both (a request's end)."""

    request_id: str  # whose chunk it is ("" for a bare ack)
    reply_to: str = ""  # with a chunk: the reply stream of the request's gateway
    chunk: Chunk | None = None  # an output chunk to add (None: a bare ack)
    stream: str = ""  # with an ack: the entry's stream
    entry_id: str = ""  # with an ack: the entry


class Outbox:
    def __init__(self, client: redis.Redis, worker_id: str, interval: float = 0.0, max_len: int = 50_000):
        self.redis = client
        self.worker_id = worker_id
        self.interval = interval  # seconds between two writes of a running request's chunks (0: every pass)
        self.max_len = max_len  # entries a reply stream keeps at most (approximately) when its gateway falls behind
        self._next_write: dict[str, float] = {}  # request id → time.monotonic() its next plain chunk may go
        self._writes: list[_Write] = []  # not yet written, in order
        self._open: dict[str, int] = {}  # request id → index in _writes of its chunk, still mergeable
        self._next_sweep = 0.0
        with contextlib.suppress(redis.RedisError):  # else at the first NOSCRIPT (Redis away now)
            self._load_scripts()

    def _load_scripts(self) -> None:
        self.redis.script_load(q.ACK_IF_OWNER)

    def send(self, request_id: str, reply_to: str, chunk: Chunk) -> None:
        i = self._open.get(request_id)
        if i is not None:
            earlier = self._writes[i]
            assert earlier.chunk is not None
            if earlier.chunk.attempt == chunk.attempt and not earlier.chunk.done and not chunk.claim \
                    and not earlier.chunk.claim and not earlier.stream:
                # one chunk for both: the deltas in order, the later chunk's outcome
                earlier.chunk = Chunk(attempt=chunk.attempt, deltas=earlier.chunk.deltas + chunk.deltas,
                                      done=chunk.done, error=chunk.error, num_cached_tokens=chunk.num_cached_tokens)
                return
        self._open[request_id] = len(self._writes)
        self._writes.append(_Write(request_id, reply_to, chunk))

    def finish(self, request_id: str, reply_to: str, chunk: Chunk, stream: str, entry_id: str) -> None:
        """A request's final chunk and the ack of its entry: one write, with any of its chunks
        still waiting merged in before."""
        self.send(request_id, reply_to, chunk)
        i = self._open.pop(request_id, None)
        last = self._writes[i] if i is not None else self._writes[-1]
        last.stream, last.entry_id = stream, entry_id

    def drop(self, request_id: str) -> None:
        """Its client went away: a chunk held back for it is not worth writing."""
        if (i := self._open.pop(request_id, None)) is not None and _plain(self._writes[i]):
            del self._writes[i]
            self._reindex()
        self._next_write.pop(request_id, None)

    def ack(self, stream: str, entry_id: str) -> None:
        """Acknowledge the entry; right after its request's final chunk, both are one write."""
        last = self._writes[-1] if self._writes else None
        if last is not None and last.chunk is not None and last.chunk.done and not last.stream:
            last.stream, last.entry_id = stream, entry_id
            self._open.pop(last.request_id, None)
            return
        self._writes.append(_Write("", stream=stream, entry_id=entry_id))

    def flush(self) -> None:
        """Write everything in one round trip. Kept for a retry whenever the transaction as a
        whole did not go through (the error is raised): Redis away, full, read-only..."""
        if not self._writes:
            return
        writes, self._writes = self._due(self._writes)
        self._reindex()
        if not writes:
            return
        try:
            self._execute(writes)
        except redis.RedisError:  # nothing of the transaction was written (or it is unknown)
            self._writes = writes + self._writes
            self._reindex()
            raise

    def _reindex(self) -> None:
        """Which write a request's next chunk merges into: its last plain chunk waiting."""
        self._open = {w.request_id: i for i, w in enumerate(self._writes) if _plain(w)}

    def _due(self, writes: list[_Write]) -> tuple[list[_Write], list[_Write]]:
        """(what goes now, what waits): with an interval, a running request's plain chunk
        waits until its request's next write is due; its first one goes at once."""
        if self.interval <= 0:
            return writes, []
        now = time.monotonic()
        ending = {w.request_id for w in writes if not _plain(w)}  # their held chunks go first, in order
        due, held = [], []
        for w in writes:
            plain = _plain(w)
            if plain and w.request_id not in ending and now < self._next_write.get(w.request_id, 0.0):
                held.append(w)
                continue
            due.append(w)
            if plain:
                self._next_write[w.request_id] = now + self.interval
            elif w.request_id:
                self._next_write.pop(w.request_id, None)
        return due, held

    def _execute(self, writes: list[_Write]) -> None:
        """One transaction for `writes`: an XADD per reply stream (its chunks in order), then
        the acks. Raises what refused it whole (OOM, a lost connection)."""
        now = time.monotonic()
        if now >= self._next_sweep:  # forget what was not written for a while (due anyway)
            self._next_write = {k: t for k, t in self._next_write.items() if t > now}
            self._next_sweep = now + q.OUTPUT_TTL / 2
        batches: dict[str, list[Reply]] = {}  # reply stream → its replies, in order
        acks = [w for w in writes if w.stream]
        for w in writes:
            if w.chunk is not None:
                batches.setdefault(w.reply_to, []).append(Reply(w.request_id, w.chunk))
        pipe = self.redis.pipeline(transaction=True)
        for key, replies in batches.items():
            pipe.xadd(key, {q.REPLIES_FIELD: q.encode_replies(replies)}, maxlen=self.max_len, approximate=True)
            pipe.expire(key, q.OUTPUT_TTL)
        first_ack = len(pipe.command_stack)
        for w in acks:
            self._queue_ack(pipe, w)
        results = pipe.execute(raise_on_error=False)
        for result in results[:first_ack]:
            if isinstance(result, Exception):
                logger.error("redis write failed: %s", result)
        missing = [w for w, r in zip(acks, results[first_ack:], strict=True) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:  # Redis restarted without the script: load it, then ack those again
            self._load_scripts()
            pipe = self.redis.pipeline(transaction=False)
            for w in missing:
                self._queue_ack(pipe, w)
            results = pipe.execute(raise_on_error=False)
        for result in results[first_ack:] if not missing else results:
            if isinstance(result, Exception):
                logger.error("redis ack failed: %s", result)

    def _queue_ack(self, pipe, w: _Write) -> None:
        tenant = q.tenant_stream_of(w.stream)
        pipe.evalsha(_ACK_SHA, 2, w.stream, q.TENANT_ROUTED, q.GROUP, self.worker_id, w.entry_id,
                     "" if tenant == w.stream else tenant)


def _plain(w: _Write) -> bool:
    """A chunk of a running request: neither its final one nor a claim nor an ack."""
    return w.chunk is not None and not w.chunk.done and not w.chunk.claim and not w.stream


_ACK_SHA = hashlib.sha1(q.ACK_IF_OWNER.encode()).hexdigest()
