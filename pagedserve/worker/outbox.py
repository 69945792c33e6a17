"""`Outbox`: what the worker writes back to Redis. Output chunks and acknowledgements wait
here until `flush` writes them all in one pipelined round trip per pass, in the order they
were made. The hot path is one command per request per step and nothing more:
- one XADD per output stream: the chunks a request gets before a flush are merged into one
  entry (their deltas in order), and a step's several tokens are one delta already;
- no EXPIRE per chunk: an output stream's TTL is set at its first chunk from this worker and
  renewed only when half of it has run out; the final chunk sets it once more. A later
  chunk never creates the stream (XADD NOMKSTREAM): once the gateway deleted it (its client
  left) or Redis lost it, the chunk is written again as a first one, with its TTL, so no
  output stream ever lives without one;
- a final chunk and its ack are one FINISH script: atomic, and refused whole while Redis is
  full, so an entry is never acknowledged before its final chunk is written;
- scripts run by EVALSHA in the pipeline (no SCRIPT EXISTS round trip before it); after a
  Redis restart forgot them, they are loaded and the rest of the pass is written again.
With an `interval` (ServeConfig.output_interval), a running request's chunks go out at most
once per interval, merged: its first chunk and its final one go at once. That trades how
often a client hears of new tokens for fewer entries, the unit of Redis's cost.
Everything is kept for a retry while Redis is away (connection errors raise) or full (its
OOM error is raised): from the first write refused, in order. A write repeated that way is
harmless: readers take a delta only where its completion stands (`OutputLog`), and an ack
goes through only for the worker that owns the entry (ACK_IF_OWNER, FINISH).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, encode

logger = logging.getLogger(__name__)


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


@dataclass(slots=True)
class _Write:
    """One write waiting for the next flush."""

    request_id: str  # whose output stream it touches ("" for a bare ack)
    chunk: Chunk | None = None  # an output chunk to add (None: delete the output, or a bare ack)
    stream: str = ""  # with an ack: the entry's stream
    entry_id: str = ""  # with an ack: the entry
    delete: bool = False  # delete the output stream (its client went away)


class Outbox:
    def __init__(self, client: redis.Redis, worker_id: str, interval: float = 0.0):
        self.redis = client
        self.worker_id = worker_id
        self.interval = interval  # seconds between two writes of a running request's chunks (0: every pass)
        self._next_write: dict[str, float] = {}  # request id → time.monotonic() its next plain chunk may go
        self._writes: list[_Write] = []  # not yet written, in order
        self._open: dict[str, int] = {}  # request id → index in _writes of its chunk, still mergeable
        self._ttl_due: dict[str, float] = {}  # output key → time.monotonic() when its TTL is renewed next
        self._next_sweep = 0.0
        with contextlib.suppress(redis.RedisError):  # else at the first NOSCRIPT (Redis away now)
            self._load_scripts()

    def _load_scripts(self) -> None:
        self.redis.script_load(q.FINISH)
        self.redis.script_load(q.ACK_IF_OWNER)

    def send(self, request_id: str, chunk: Chunk) -> None:
        i = self._open.get(request_id)
        if i is not None:
            earlier = self._writes[i]
            assert earlier.chunk is not None
            if earlier.chunk.attempt == chunk.attempt and not earlier.chunk.done and not earlier.stream:
                # one entry for both: the deltas in order, the later chunk's outcome
                earlier.chunk = Chunk(attempt=chunk.attempt, deltas=earlier.chunk.deltas + chunk.deltas,
                                      done=chunk.done, error=chunk.error, num_cached_tokens=chunk.num_cached_tokens)
                return
        self._open[request_id] = len(self._writes)
        self._writes.append(_Write(request_id, chunk))

    def finish(self, request_id: str, chunk: Chunk, stream: str, entry_id: str) -> None:
        """A request's final chunk and the ack of its entry: one write (FINISH), with any of its
        chunks still waiting merged in before."""
        self.send(request_id, chunk)
        i = self._open.pop(request_id, None)
        last = self._writes[i] if i is not None else self._writes[-1]
        last.stream, last.entry_id = stream, entry_id

    def delete_output(self, request_id: str) -> None:
        if (i := self._open.pop(request_id, None)) is not None:  # a chunk held back: nobody reads it now
            del self._writes[i]
            self._open = {r: j - (j > i) for r, j in self._open.items()}
        self._next_write.pop(request_id, None)
        self._writes.append(_Write(request_id, delete=True))

    def ack(self, stream: str, entry_id: str) -> None:
        """Acknowledge the entry; right after its request's final chunk, both are one write."""
        last = self._writes[-1] if self._writes else None
        if last is not None and last.chunk is not None and last.chunk.done and not last.stream:
            last.stream, last.entry_id = stream, entry_id
            self._open.pop(last.request_id, None)
            return
        self._writes.append(_Write("", stream=stream, entry_id=entry_id))

    def connection_lost(self) -> None:
        """Redis may come back empty: every output stream gets its TTL again at its next chunk."""
        self._ttl_due.clear()

    def flush(self) -> None:
        """Write everything in one round trip. Kept for a retry, from the first write refused:
        while Redis is away (connection errors raise) or full (its OOM error is raised)."""
        if not self._writes:
            return
        writes, self._writes = self._due(self._writes)
        self._reindex()
        if not writes:
            return
        try:
            results = self._execute(writes)
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
                # Redis restarted without the scripts: load them, then write the rest again
                self._load_scripts()
                first = next(i for i, r in enumerate(results) if isinstance(r, redis.exceptions.NoScriptError))
                writes, results = writes[first:], self._execute(writes[first:])
        except (redis.ConnectionError, redis.TimeoutError):
            self._writes = writes + self._writes
            self._reindex()
            raise
        full = [i for i, r in enumerate(results) if isinstance(r, redis.exceptions.OutOfMemoryError)]
        if full:
            self._writes = writes[full[0]:] + self._writes
            self._reindex()
            raise results[full[0]]
        for result in results:
            if isinstance(result, Exception):
                logger.error("redis write failed: %s", result)

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

    def _execute(self, writes: list[_Write]) -> list:
        """One pipeline for `writes`; the replies, one per write (errors as values)."""
        now = time.monotonic()
        if now >= self._next_sweep:  # forget streams not written for a while (their TTL is due anyway)
            self._ttl_due = {k: t for k, t in self._ttl_due.items() if t > now}
            self._next_write = {k: t for k, t in self._next_write.items() if t > now}  # past: due anyway
            self._next_sweep = now + q.OUTPUT_TTL / 2
        pipe = self.redis.pipeline(transaction=False)
        slots = []  # per write, its reply's index in the pipeline
        renewed = []
        later = []  # (write, its reply's index): chunks that must not create their stream
        for w in writes:
            slots.append(len(pipe.command_stack))
            key = q.output_key(w.request_id)
            if w.delete:
                pipe.delete(key)
                self._ttl_due.pop(key, None)
            elif w.chunk is None:
                tenant = q.tenant_stream_of(w.stream)
                pipe.evalsha(_ACK_SHA, 2, w.stream, q.TENANT_ROUTED, q.GROUP, self.worker_id, w.entry_id,
                             "" if tenant == w.stream else tenant)
            elif w.stream:
                tenant = q.tenant_stream_of(w.stream)
                pipe.evalsha(_FINISH_SHA, 3, key, w.stream, q.TENANT_ROUTED, encode(w.chunk), q.OUTPUT_TTL, q.GROUP,
                             self.worker_id, w.entry_id, "" if tenant == w.stream else tenant)
                self._ttl_due.pop(key, None)
            else:
                first = key not in self._ttl_due
                if not first:
                    later.append((w, len(pipe.command_stack)))
                pipe.xadd(key, {q.CHUNK_FIELD: encode(w.chunk)}, nomkstream=not first)
                if self._ttl_due.get(key, 0.0) <= now:
                    pipe.expire(key, q.OUTPUT_TTL)
                    renewed.append((key, len(pipe.command_stack) - 1))
        results = pipe.execute(raise_on_error=False)
        for key, i in renewed:
            if results[i] == 1:  # the stream existed (its XADD went through) and has its TTL now
                self._ttl_due[key] = now + q.OUTPUT_TTL / 2
        missing = [w for w, i in later if results[i] is None]  # NOMKSTREAM: no stream, nothing written
        if missing:
            self._create(missing, now)
        return [results[i] for i in slots]

    def _create(self, writes: list[_Write], now: float) -> None:
        """Chunks whose stream was gone (deleted by the gateway when its client left, or lost
        by Redis): written again as first chunks, each stream created with its TTL."""
        pipe = self.redis.pipeline(transaction=False)
        for w in writes:
            assert w.chunk is not None
            key = q.output_key(w.request_id)
            pipe.xadd(key, {q.CHUNK_FIELD: encode(w.chunk)})
            pipe.expire(key, q.OUTPUT_TTL)
        results = pipe.execute(raise_on_error=False)
        for w, result in zip(writes, results[::2], strict=True):
            key = q.output_key(w.request_id)
            if isinstance(result, Exception):
                logger.error("redis write failed: %s", result)
                self._ttl_due.pop(key, None)
            else:
                self._ttl_due[key] = now + q.OUTPUT_TTL / 2


def _plain(w: _Write) -> bool:
    """A chunk of a running request: neither its final one nor an ack nor a delete."""
    return w.chunk is not None and not w.chunk.done and not w.stream


_ACK_SHA = _sha(q.ACK_IF_OWNER)
_FINISH_SHA = _sha(q.FINISH)
