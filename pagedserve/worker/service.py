"""`WorkerService`: the worker process. It pulls requests from the Redis queue into its
engine when it has room, streams every step's tokens back, and keeps the queue's promises:

- an entry is acknowledged only at its final outcome, and only by the worker that owns it;
- a heartbeat thread keeps the worker's entries fresh, so XAUTOCLAIM moves only the entries
  of a worker that stopped; the new owner resumes from what the client was already sent;
- a cancelled request is aborted before the next engine step; a request past its deadline
  ends with a timeout error;
- on SIGTERM it takes nothing new, lets running requests finish for `drain_timeout`
  seconds, then ends the rest with an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.config import ServeConfig
from pagedserve.common.errors import PagedServeError
from pagedserve.common.outputs import RequestOutput
from pagedserve.common.queue_protocol import (
    ChoiceDelta,
    Chunk,
    OutputLog,
    QueuedRequest,
    WireError,
    WorkerInfo,
    decode_chunk,
    decode_request,
    encode,
)
from pagedserve.worker.engine import Engine, ResumedCompletion

logger = logging.getLogger(__name__)

#: how long an idle worker blocks on the queue before it looks at everything else again
_IDLE_BLOCK_MS = 100


@dataclass(slots=True)
class _Running:
    """A queue entry the engine is working on."""

    entry_id: str  # in the requests stream
    request: QueuedRequest
    attempt: int  # delivery count: 1 unless another worker died with it
    sent_tokens: list[int]  # per completion: tokens already in the output stream
    sent_logprobs: list[int]  # per completion: entries of the engine's logprobs list already sent
    ended: list[bool]  # per completion: its finish_reason was sent
    output_key: str = field(init=False)

    def __post_init__(self) -> None:
        self.output_key = q.output_key(self.request.request_id)


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerService:
    def __init__(self, engine: Engine, config: ServeConfig, redis_url: str, worker_id: str | None = None):
        self.engine = engine
        self.config = config
        self.worker_id = worker_id or new_worker_id()
        self.redis = redis.Redis.from_url(redis_url, socket_connect_timeout=2, health_check_interval=10)
        self._count_taken = self.redis.register_script(q.TAKEN)
        self._ack_if_owner = self.redis.register_script(q.ACK_IF_OWNER)
        self._heartbeat_script = self.redis.register_script(q.HEARTBEAT)
        self.running: dict[str, _Running] = {}  # by request id
        self._owned: tuple[str, ...] = ()  # entry ids, for the heartbeat thread (swapped whole)
        self._lost: queue.SimpleQueue[str] = queue.SimpleQueue()  # entries another worker took
        self._outbox: list[tuple[str, bytes]] = []  # (output key, chunk) not yet written
        self._acks: list[str] = []  # entry ids to acknowledge with the next write
        self._stop = threading.Event()
        self._drain_deadline: float | None = None
        self._next_reclaim = 0.0
        self._pubsub = None
        self.num_cancelled = 0
        self.num_taken_over = 0

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until drained (SIGTERM/SIGINT, see `drain`)."""
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        logger.info("worker %s serving %s (max_model_len %d)", self.worker_id, self.engine.config.model, self.engine.max_model_len)
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if not self._iteration():
                    break
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                logger.warning("redis unavailable (%s); retrying in %.1f s", exc, backoff)
                self._pubsub = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug in one pass must not end the worker and its requests
                logger.exception("worker loop error; going on")
                self._stop.wait(0.5)
        self._stop.set()
        heartbeat.join(timeout=5)
        self._deregister()

    def drain(self, *_signal_args) -> None:
        """Take nothing new; running requests get `drain_timeout` seconds to finish."""
        if self._drain_deadline is None:
            logger.info("worker %s draining (%d running)", self.worker_id, len(self.running))
            self._drain_deadline = time.monotonic() + self.config.drain_timeout
        else:  # a second signal: stop now
            self._drain_deadline = 0.0

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.drain)
        signal.signal(signal.SIGINT, self.drain)

    def _deregister(self) -> None:
        try:
            self.redis.zrem(q.WORKERS, self.worker_id)
            self.redis.delete(q.worker_key(self.worker_id))
        except redis.RedisError:
            pass

    # -- one pass of the loop ---------------------------------------------------------------
    def _iteration(self) -> bool:
        """Returns False when the worker is done (drained)."""
        self._flush()  # what an earlier pass could not write goes first, in order
        self._apply_cancellations()
        self._apply_lost()
        self._expire_deadlines()
        if self._drain_deadline is not None:
            if not self.running:
                return False
            if time.monotonic() >= self._drain_deadline:
                for run in list(self.running.values()):
                    self._end(run, WireError(message="the worker shut down before this request finished",
                                             type="server_error", code="worker_shutdown", status_code=503))
                self._flush()
                return False
        else:
            if time.monotonic() >= self._next_reclaim:
                self._reclaim()
                self._next_reclaim = time.monotonic() + self.config.heartbeat_interval
            self._pull()
        if self.engine.has_unfinished_requests():
            self._collect(self.engine.step())
        self._flush()
        return True

    # -- taking requests -------------------------------------------------------------------------
    def _room(self) -> int:
        if getattr(self.engine.scheduler, "num_waiting", 0):
            return 0  # requests still wait inside: leave the rest to other workers
        return self.engine.config.max_num_seqs - len(self.running)

    def _pull(self) -> None:
        room = self._room()
        if room <= 0:
            return
        block = None if self.engine.has_unfinished_requests() else _IDLE_BLOCK_MS
        try:
            reply = self.redis.xreadgroup(q.GROUP, self.worker_id, {q.REQUESTS: ">"}, count=room, block=block)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._ensure_group()
            return
        entries = [(eid, fields) for eid, fields in (reply[0][1] if reply else []) if fields]
        if not entries:
            return
        num_tokens = sum(int(fields.get(q.PROMPT_TOKENS_FIELD, 0)) for _, fields in entries)
        self._count_taken(keys=[q.QUEUED, q.QUEUED_TOKENS], args=[len(entries), num_tokens])
        for entry_id, fields in entries:
            self._start(entry_id.decode(), fields, attempt=1)

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(q.REQUESTS, q.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _reclaim(self) -> None:
        """Take over entries of workers whose heartbeat stopped."""
        room = self._room()
        if room <= 0:
            return
        try:
            reply = self.redis.xautoclaim(q.REQUESTS, q.GROUP, self.worker_id,
                                          min_idle_time=int(self.config.worker_timeout * 1000), count=room)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._ensure_group()
            return
        for entry_id, fields in reply[1]:
            if not fields:
                continue
            entry_id = entry_id.decode()
            pending = self.redis.xpending_range(q.REQUESTS, q.GROUP, min=entry_id, max=entry_id, count=1)
            attempt = pending[0]["times_delivered"] if pending else 2
            logger.warning("worker %s takes over entry %s (delivery %d)", self.worker_id, entry_id, attempt)
            self._start(entry_id, fields, attempt)

    def _start(self, entry_id: str, fields: dict, attempt: int) -> None:
        try:
            request = decode_request(fields[q.REQUEST_FIELD])
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError, PagedServeError) as exc:
            logger.error("dropping malformed queue entry %s: %s", entry_id, exc)
            self._acks.append(entry_id)
            return
        run = _Running(entry_id, request, attempt, [0] * request.params.n, [0] * request.params.n,
                       [False] * request.params.n)
        if self.redis.exists(q.cancelled_key(request.request_id)):
            self._acks.append(entry_id)  # the client left while it was queued
            return
        if attempt > self.config.max_attempts:
            self._end(run, WireError(message=f"the request failed: {attempt - 1} workers died while running it",
                                     type="server_error", code="worker_failed", status_code=500), started=False)
            return
        if time.time() > request.deadline:
            self._end(run, _timeout_error(self.config), started=False)
            return
        resume = None
        if attempt > 1:
            resume = self._resume_state(run)
            if resume is None:
                return
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                    cache_salt=request.cache_salt, resume=resume)
        except PagedServeError as exc:
            self._end(run, WireError(message=exc.message, type=exc.error_type, code=exc.code,
                                     param=exc.param, status_code=exc.status_code), started=False)
            return
        except Exception as exc:  # a bug must fail this request, not the worker
            logger.exception("could not start request %s", request.request_id)
            self.engine.abort_request(request.request_id)
            self._end(run, WireError(message=f"the worker could not start the request: {type(exc).__name__}",
                                     code="internal_error"), started=False)
            return
        self.running[request.request_id] = run
        self.num_taken_over += attempt > 1
        self._owned_changed()

    def _resume_state(self, run: _Running) -> list[ResumedCompletion] | None:
        """Fence off the dead worker, then read what the client has; None if nothing is left."""
        self._flush()
        claim_id = self.redis.xadd(run.output_key, {q.CHUNK_FIELD: encode(Chunk(attempt=run.attempt, claim=True))})
        log = OutputLog(run.request.params.n)
        for _, fields in self.redis.xrange(run.output_key, "-", claim_id):
            log.apply(decode_chunk(fields[q.CHUNK_FIELD]))
        if log.done:
            self._acks.append(run.entry_id)
            return None
        for i, c in enumerate(log.completions):
            run.sent_tokens[i] = len(c.token_ids)  # the engine's logprobs start after them
            run.ended[i] = c.finish_reason is not None
        if all(run.ended):
            self._end(run, None, started=False)
            return None
        return [ResumedCompletion(c.token_ids, c.num_chars, c.finish_reason) for c in log.completions]

    # -- aborts ------------------------------------------------------------------------------
    def _apply_cancellations(self) -> None:
        if self._pubsub is None:
            self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(q.CANCEL_CHANNEL)
        while (message := self._pubsub.get_message(timeout=0)) is not None:
            run = self.running.get(message["data"].decode())
            if run is not None:
                logger.info("request %s cancelled by its client", run.request.request_id)
                self.num_cancelled += 1
                self._forget(run)
                self._acks.append(run.entry_id)
                self._outbox.append((run.output_key, b""))  # deletes the output stream

    def _apply_lost(self) -> None:
        lost = set()
        while not self._lost.empty():
            lost.add(self._lost.get())
        for run in [r for r in self.running.values() if r.entry_id in lost]:
            logger.warning("request %s was taken over by another worker; dropping it here", run.request.request_id)
            self._forget(run)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for run in [r for r in self.running.values() if r.request.deadline < now]:
            self._end(run, _timeout_error(self.config))

    def _untrack(self, request_id: str) -> None:
        self.running.pop(request_id, None)
        self._owned_changed()

    def _owned_changed(self) -> None:
        self._owned = tuple(r.entry_id for r in self.running.values())  # one swap: the thread reads it whole

    def _forget(self, run: _Running) -> None:
        self.engine.abort_request(run.request.request_id)
        self._untrack(run.request.request_id)

    # -- writing outputs ---------------------------------------------------------------------
    def _collect(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            run = self.running.get(out.request_id)
            if run is None:
                continue
            deltas = []
            for c in out.outputs:
                i = c.index
                if run.ended[i]:
                    continue
                new_tokens = c.token_ids[run.sent_tokens[i]:]
                finish = c.finish_reason if c.finish_reason in ("stop", "length") else None
                if not new_tokens and not c.text_delta and finish is None:
                    continue
                logprobs = None
                if c.logprobs is not None:
                    logprobs = c.logprobs[run.sent_logprobs[i]:]
                    run.sent_logprobs[i] += len(logprobs)
                deltas.append(ChoiceDelta(index=i, start=run.sent_tokens[i], token_ids=new_tokens, text=c.text_delta,
                                          logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason if finish else None))
                run.sent_tokens[i] += len(new_tokens)
                run.ended[i] = finish is not None
            if out.finished:
                error = None if out.error is None else WireError(message=out.error, code="engine_error")
                self._outbox.append((run.output_key, encode(Chunk(attempt=run.attempt, deltas=deltas, done=True,
                                                                  error=error, num_cached_tokens=out.num_cached_tokens))))
                self._acks.append(run.entry_id)
                self._untrack(out.request_id)
            elif deltas:
                self._outbox.append((run.output_key, encode(Chunk(attempt=run.attempt, deltas=deltas))))

    def _end(self, run: _Running, error: WireError | None, started: bool = True) -> None:
        """Final outcome outside a normal finish: an error (or nothing left), then the ack."""
        if started:
            self._forget(run)
        self._outbox.append((run.output_key, encode(Chunk(attempt=run.attempt, done=True, error=error))))
        self._acks.append(run.entry_id)

    def _flush(self) -> None:
        """Write queued chunks and acks in one round trip; kept for a retry if Redis is away."""
        if not self._outbox and not self._acks:
            return
        pipe = self.redis.pipeline(transaction=False)
        for key, data in self._outbox:
            if data:
                pipe.xadd(key, {q.CHUNK_FIELD: data})
                pipe.expire(key, q.OUTPUT_TTL)
            else:
                pipe.delete(key)
        for entry_id in self._acks:
            self._ack_if_owner(keys=[q.REQUESTS], args=[q.GROUP, self.worker_id, entry_id], client=pipe)
        results = pipe.execute(raise_on_error=False)  # connection errors raise: all is kept
        self._outbox.clear()
        self._acks.clear()
        for result in results:
            # After a Redis restart the group is gone and acks fail: nothing is left to ack.
            if isinstance(result, Exception) and "NOGROUP" not in str(result):
                logger.error("redis write failed: %s", result)

    # -- heartbeat ---------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        pool = self.engine.kv_manager.pool
        return WorkerInfo(
            worker_id=self.worker_id, model=self.engine.config.model, max_model_len=self.engine.max_model_len,
            pid=os.getpid(), host=socket.gethostname(), max_num_seqs=self.engine.config.max_num_seqs,
            num_running=len(self.running), num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks,
            num_cancelled=self.num_cancelled, num_taken_over=self.num_taken_over,
        )

    def _heartbeat_loop(self) -> None:
        ttl_ms = int(self.config.worker_timeout * 1000)
        while not self._stop.is_set():
            owned = self._owned
            try:
                lost = self._heartbeat_script(keys=[q.REQUESTS, q.WORKERS, q.worker_key(self.worker_id)],
                                              args=[q.GROUP, self.worker_id, ttl_ms, encode(self.info()), *owned])
                for entry_id in lost:
                    self._lost.put(entry_id.decode())
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    with contextlib.suppress(redis.RedisError):
                        self._ensure_group()
                else:
                    logger.error("heartbeat failed: %s", exc)
            except redis.RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)
            self._stop.wait(self.config.heartbeat_interval)


def _timeout_error(config: ServeConfig) -> WireError:
    return WireError(message=f"the request did not finish within the {config.request_timeout:g} s request timeout",
                     type="timeout_error", code="request_timeout", status_code=504)


def run_worker(config: ServeConfig, engine_config, redis_url: str) -> None:
    """A worker process: load the engine, then serve the queue until drained."""
    engine = Engine(engine_config)
    service = WorkerService(engine, config, redis_url)
    service.install_signal_handlers()
    service.run()
