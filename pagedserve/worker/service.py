"""`WorkerService`: the worker process. Each pass of its loop takes requests from the queue
into the engine when there is room, runs one engine step, and forwards the step's deltas
as they are to each request's output stream:

    apply cancellations, lost entries, deadlines → take requests → engine.step() → forward

The Redis side (reading, acknowledging, heartbeats, takeover) is the `QueueConsumer`'s;
its heartbeat beats only while this loop completes passes, so a frozen loop looks dead
and its requests move to other workers. A cancelled request is aborted before the next
engine step; a request past its deadline ends with a timeout error; on SIGTERM the worker
takes nothing new, lets running requests finish for `drain_timeout` seconds, then ends the
rest with an error.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import msgspec
import redis
from prometheus_client import CollectorRegistry

from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import PagedServeError
from pagedserve.common.outputs import RequestDelta
from pagedserve.common.queue_protocol import Chunk, WireError, WorkerInfo, tenant_stream_of
from pagedserve.common.serve_config import ServeConfig
from pagedserve.common.step_stats import FinishedRequestStats, StepStats
from pagedserve.engine.engine import Engine
from pagedserve.engine.input_processor import ResumedCompletion
from pagedserve.prefix_cache.publisher import KVEventPublisher
from pagedserve.telemetry.metrics import WorkerMetrics, serve_metrics
from pagedserve.telemetry.tracing import Tracing
from pagedserve.worker.queue_consumer import OwnedEntry, QueueConsumer, StreamView, TakenEntry
from pagedserve.worker.request_tracing import request_traces

logger = logging.getLogger(__name__)

#: how long an idle worker blocks on the queue before it looks at everything else again
_IDLE_BLOCK_MS = 100

#: the environment variable through which `pagedserve serve` gives its workers its pid:
#: a worker whose launcher is gone drains and exits instead of running on as an orphan
SUPERVISOR_PID_ENV = "PAGEDSERVE_SUPERVISOR_PID"


@dataclass(slots=True)
class _Running:
    """A queue entry the engine is working on."""

    stream: str  # the stream of its entry (a tenant stream or a routed one)
    entry_id: str  # in that stream
    request_id: str
    attempt: int  # delivery count: 1 unless another worker died with it
    deadline: float  # unix seconds


class WorkerService:
    def __init__(self, engine: Engine, config: ServeConfig, redis_url: str, worker_id: str | None = None,
                 tracing: Tracing | None = None, metrics: WorkerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics  # None: no Prometheus metrics (no --worker-metrics-port)
        self.config = config
        self.queue = QueueConsumer(redis_url, config, worker_id)
        self.worker_id = self.queue.worker_id
        self.running: dict[str, _Running] = {}  # by request id
        self._drain_deadline: float | None = None
        self._next_reclaim = 0.0
        self.last_pass = time.monotonic()  # when the loop last completed a pass (the heartbeat's liveness)
        self.num_cancelled = 0
        self.num_taken_over = 0
        # spans (no-ops when off), under the name clients ask for, as the gateway's and the metrics'
        self.traces = request_traces(tracing, self.worker_id, config.served_model_name or engine.config.model)
        engine.stats.keep_finished = True  # this service pops them every pass (`_observe`)
        self.kv_events: KVEventPublisher | None = None  # the cluster index's feed (--kv-events)
        if config.kv_events:
            self.kv_events = KVEventPublisher(self.queue.redis, self.worker_id, engine.kv_manager.pool,
                                              engine.config.block_size, config.kv_events_max_len)

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until drained (SIGTERM/SIGINT, see `drain`)."""
        self.last_pass = time.monotonic()
        self.queue.start_heartbeat(self.info, self.loop_alive)
        logger.info("worker %s serving %s (max_model_len %d)", self.worker_id, self.engine.config.model,
                    self.engine.max_model_len)
        backoff = 0.1
        while True:
            try:
                if not self._iteration():
                    break
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.OutOfMemoryError) as exc:
                if self._drain_deadline is not None and (not self.running or time.monotonic() >= self._drain_deadline):
                    # Draining must end even without Redis (it may have stopped first).
                    logger.warning("worker %s drained with redis unreachable; %d request(s) end unreported",
                                   self.worker_id, len(self.running))
                    break
                logger.warning("redis unavailable (%s); retrying in %.1f s", exc, backoff)
                self.queue.connection_lost()
                if self.queue.wait(backoff):
                    break
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug in one pass must not end the worker and its requests
                logger.exception("worker loop error; going on")
                if self.queue.wait(0.5):
                    break
            self.last_pass = time.monotonic()
        self.traces.close()  # spans of requests still here (Redis gone while draining) end now
        self.queue.stop()

    def loop_alive(self) -> bool:
        """Whether the loop completed a pass within worker_timeout: the heartbeat beats only then."""
        return time.monotonic() - self.last_pass < self.config.worker_timeout

    def drain(self, *_signal_args) -> None:
        """Take nothing new; running requests get `drain_timeout` seconds to finish."""
        if self._drain_deadline is None:
            logger.info("worker %s draining (%d running)", self.worker_id, len(self.running))
            self._drain_deadline = time.monotonic() + self.config.drain_timeout
        else:  # called again (a second Ctrl-C): stop now
            self._drain_deadline = 0.0

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        """The first signal drains; a second SIGINT (Ctrl-C again) stops now. A repeated SIGTERM
        changes nothing: a launcher and a service manager may both send one for the same stop."""
        if not self.draining or signum == signal.SIGINT:
            self.drain()

    # -- one pass of the loop ---------------------------------------------------------------
    def _iteration(self) -> bool:
        """Returns False when the worker is done (drained)."""
        self.queue.flush()  # what an earlier pass could not write goes first, in order
        self._apply_cancellations()
        self._apply_lost()
        self._expire_deadlines()
        if self._drain_deadline is not None:
            if not self.running:
                self._observe(None)  # what this pass's aborts and cancellations ended
                return False
            if time.monotonic() >= self._drain_deadline:
                for run in list(self.running.values()):
                    self._end(run, WireError(message="the worker shut down before this request finished",
                                             type="server_error", code="worker_shutdown", status_code=503))
                self._observe(None)
                self.queue.flush()
                return False
        else:
            self._take_requests()
        step = None  # engine.last_step stays from an earlier pass when this one runs no step
        if self.engine.has_unfinished_requests():
            self._forward(self.engine.step())
            step = self.engine.last_step
        if self.kv_events is not None:
            self.kv_events.publish()
        self._observe(step)
        self.queue.flush()
        return True

    def _observe(self, step: StepStats | None) -> None:
        """Hand what the engine did (this pass's step, None if it ran none; the requests that
        ended) to the telemetry."""
        finished = self.engine.pop_finished()
        self.traces.observe(step, finished, self.running)
        if self.metrics is not None:
            self._record_metrics(step, finished)

    def _record_metrics(self, step: StepStats | None, finished: list[FinishedRequestStats]) -> None:
        assert self.metrics is not None
        if step is not None:
            self.metrics.observe_step(step)
        else:  # aborts, or nothing left: the gauges follow the engine between steps too
            scheduler = self.engine.scheduler
            self.metrics.set_state(scheduler.num_running, scheduler.num_waiting, self.engine.kv_cache_usage())
        for request in finished:
            self.metrics.observe_finished(request)
        if self.engine.kv_tier is not None:
            self.metrics.observe_kv_tier(self.engine.kv_tier.totals())

    # -- taking requests ----------------------------------------------------------------------
    def _room(self) -> int:
        if self.engine.scheduler.num_waiting:
            return 0  # requests still wait inside: leave the rest to other workers
        return self.engine.config.max_num_seqs - len(self.running)

    def _take_requests(self) -> None:
        if time.monotonic() >= self._next_reclaim:
            if (room := self._room()) > 0:
                for entry in self.queue.reclaim(room):
                    self._start(entry)
            self._next_reclaim = time.monotonic() + self.config.heartbeat_interval
        view = self.queue.streams()
        if (room := self._room()) > 0:
            block = None if self.engine.has_unfinished_requests() else _IDLE_BLOCK_MS
            # a busy worker leaves other workers' queued prompts to them (and to their caches)
            taken = self.queue.pull(room, block, view, steal=len(self.running) <= self.config.steal_max_running)
        else:
            # Full: still take one request of each tenant that has nothing here, so that the
            # scheduler can give it its share at the next step instead of after the others.
            # (One per stream: a tenant's own routed stream and its shared one count apart.)
            present = {tenant_stream_of(run.stream) for run in self.running.values()}
            newcomers = [s for s in view.own + view.shared if tenant_stream_of(s) not in present]
            taken = self.queue.pull(len(newcomers), None, StreamView(own=[], shared=newcomers, others=[],
                                                                     orphaned=view.orphaned)) if newcomers else []
        if self.metrics is not None and (stolen := sum(e.stolen for e in taken)):
            self.metrics.count_steals(stolen)
        for entry in taken:
            self._start(entry)

    def _start(self, entry: TakenEntry) -> None:
        request = entry.request
        if (mine := self.running.get(request.request_id)) is not None:
            # Reclaimed by this worker itself: its loop paused past worker_timeout (a slow step),
            # so its heartbeat left the entry idle and XAUTOCLAIM gave it back. It runs here
            # already: carry on. (Another entry under the same id is a duplicate: leave it.)
            if (mine.stream, mine.entry_id) != (entry.stream, entry.entry_id):
                logger.error("entry %s of %s repeats running request %s; dropped", entry.entry_id, entry.stream,
                             request.request_id)
                self.queue.ack(entry.stream, entry.entry_id)
            return
        run = _Running(entry.stream, entry.entry_id, request.request_id, entry.attempt, request.deadline)
        if self.metrics is not None and entry.attempt == 1 and request.enqueued_at is not None:
            # a later delivery's wait since admission includes the run on a worker that died
            self.metrics.observe_queue_time(time.time() - request.enqueued_at)
        if self.queue.is_cancelled(request.request_id):
            self.queue.ack(entry.stream, entry.entry_id)  # the client left while it was queued
            self._count_unstarted("abort", request.params.n)
            return
        self.traces.start(request, entry.attempt)
        if entry.attempt > self.config.max_attempts:
            self._end(run, WireError(message=f"the request failed: {entry.attempt - 1} workers died while running it",
                                     type="server_error", code="worker_failed", status_code=500), started=False)
            self._count_unstarted("error", request.params.n)
            return
        if time.time() > request.deadline:
            self._end(run, _timeout_error(self.config), started=False)
            self._count_unstarted("abort", request.params.n)  # as a running request past its deadline
            return
        resume = None
        if entry.attempt > 1:
            resume = self._resume_state(run, request.params.n)
            if resume is None:
                return
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                    cache_salt=request.cache_salt, resume=resume, tenant=request.tenant)
        except PagedServeError as exc:
            self._end(run, WireError(message=exc.message, type=exc.error_type, code=exc.code,
                                     param=exc.param, status_code=exc.status_code), started=False)
            self._count_unstarted("error", request.params.n)
            return
        except Exception as exc:  # a bug must fail this request, not the worker
            logger.exception("could not start request %s", request.request_id)
            if self.engine.abort_request(request.request_id, "error") is None:  # else the engine reports its end
                self._count_unstarted("error", request.params.n)
            self._end(run, WireError(message=f"the worker could not start the request: {type(exc).__name__}",
                                     code="internal_error"), started=False)
            return
        self.running[request.request_id] = run
        self.num_taken_over += entry.attempt > 1
        self._owned_changed()

    def _count_unstarted(self, reason: str, n: int) -> None:
        """A request this worker took and ended before the engine had it (the engine counts
        the rest): its n completions count under `reason` in request_success_total."""
        if self.metrics is not None:
            self.metrics.count_finished(reason, n)

    def _resume_state(self, run: _Running, n: int) -> list[ResumedCompletion] | None:
        """What the client has of each completion; None (and the entry settled) if nothing is left."""
        log = self.queue.claim_output(run.request_id, run.attempt, n)
        if log.done:
            self.queue.ack(run.stream, run.entry_id)
            return None
        if all(c.finish_reason is not None for c in log.completions):
            self._end(run, None, started=False)
            return None
        return [ResumedCompletion(c.token_ids, c.num_chars, c.finish_reason) for c in log.completions]

    # -- aborts ------------------------------------------------------------------------------
    def _apply_cancellations(self) -> None:
        for request_id in self.queue.cancellations():
            run = self.running.get(request_id)
            if run is not None:
                logger.info("request %s cancelled by its client", request_id)
                self.num_cancelled += 1
                self._forget(run)
                self.queue.ack(run.stream, run.entry_id)
                self.queue.delete_output(request_id)

    def _apply_lost(self) -> None:
        lost = self.queue.lost_entries()
        for run in [r for r in self.running.values() if (r.stream, r.entry_id) in lost]:
            logger.warning("request %s was taken over by another worker; dropping it here", run.request_id)
            self._forget(run, record=False)  # the worker that took it over counts it

    def _expire_deadlines(self) -> None:
        now = time.time()
        for run in [r for r in self.running.values() if r.deadline < now]:
            self._end(run, _timeout_error(self.config))

    def _owned_changed(self) -> None:
        self.queue.set_owned(OwnedEntry(r.stream, r.entry_id, r.request_id) for r in self.running.values())

    def _forget(self, run: _Running, record: bool = True) -> None:
        self.engine.abort_request(run.request_id, record=record)
        self.running.pop(run.request_id, None)
        self._owned_changed()

    # -- outputs -----------------------------------------------------------------------------
    def _forward(self, outputs: list[RequestDelta]) -> None:
        """Each step's deltas go out as they are; a finished request is settled."""
        for out in outputs:
            run = self.running.get(out.request_id)
            if run is None:
                continue
            deltas = out.deltas
            if out.finished:
                error = None if out.error is None else WireError(message=out.error, code="engine_error")
                self.queue.send(run.request_id, Chunk(attempt=run.attempt, deltas=deltas, done=True, error=error,
                                                      num_cached_tokens=out.num_cached_tokens))
                self.queue.ack(run.stream, run.entry_id)
                self.running.pop(run.request_id, None)
                self._owned_changed()
            elif deltas:
                self.queue.send(run.request_id, Chunk(attempt=run.attempt, deltas=deltas))

    def _end(self, run: _Running, error: WireError | None, started: bool = True) -> None:
        """Final outcome outside a normal finish: an error (or nothing left), then the ack."""
        self.traces.error(run.request_id, error, started)
        if started:
            self._forget(run)
        self.queue.send(run.request_id, Chunk(attempt=run.attempt, done=True, error=error))
        self.queue.ack(run.stream, run.entry_id)

    def info(self) -> WorkerInfo:
        kv = self.engine.kv_manager
        return WorkerInfo(
            worker_id=self.worker_id, model=self.engine.config.model, max_model_len=self.engine.max_model_len,
            pid=os.getpid(), host=socket.gethostname(), max_num_seqs=self.engine.config.max_num_seqs,
            num_running=len(self.running), num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_blocks,
            num_cancelled=self.num_cancelled, num_taken_over=self.num_taken_over,
            num_waiting=self.engine.scheduler.num_waiting, num_stolen=self.queue.num_stolen,
            block_size=kv.block_size, kv_model_id=kv.model_id, kv_dtype=kv.kv_dtype,
        )


def _timeout_error(config: ServeConfig) -> WireError:
    return WireError(message=f"the request did not finish within the {config.request_timeout:g} s request timeout",
                     type="timeout_error", code="request_timeout", status_code=504)


def run_worker(config: ServeConfig, engine_config: EngineConfig, redis_url: str) -> None:
    """A worker process: load the engine, then serve the queue until drained."""
    if engine_config.kv_tier_memory and engine_config.kv_tier_url is None:  # the tier lives beside the queue
        engine_config = msgspec.structs.replace(engine_config, kv_tier_url=redis_url)
    try:
        engine = Engine(engine_config)
    except KeyboardInterrupt:  # stopped while loading: nothing to drain
        logger.info("worker interrupted while loading %s", engine_config.model)
        return
    metrics, metrics_server = None, None
    if config.worker_metrics_port is not None:
        registry = CollectorRegistry()  # this process's own, never prometheus_client's global one
        metrics = WorkerMetrics(registry, config.served_model_name or engine_config.model, engine.config.block_size,
                                engine_config.speculative_method)
        metrics_server = serve_metrics(registry, config.worker_metrics_host, config.worker_metrics_port)
        if metrics_server is None:  # nobody could read them: keep none
            metrics = None
    tracing = Tracing.from_env("pagedserve-worker")
    service = WorkerService(engine, config, redis_url, tracing=tracing, metrics=metrics)
    service.install_signal_handlers()
    if supervisor := os.environ.get(SUPERVISOR_PID_ENV):
        _drain_when_orphaned(service, int(supervisor))
    try:
        service.run()
    finally:
        engine.close()
        tracing.shutdown()  # the last spans leave before the process exits (cli: os._exit)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


def _drain_when_orphaned(service: WorkerService, supervisor_pid: int, interval: float = 1.0) -> None:
    """Drain once the launcher that started this worker is gone (killed without its cleanup)."""
    def watch() -> None:
        while os.getppid() == supervisor_pid:
            time.sleep(interval)
        if not service.draining:
            logger.warning("worker %s: its launcher (pid %d) is gone; draining", service.worker_id, supervisor_pid)
            service.drain()

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
