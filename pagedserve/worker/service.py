"""`WorkerService`: the worker process. Each pass of its loop takes requests from the queue
into the engine when there is room, runs one engine step, and forwards the step's deltas
as they are to each request's gateway (its reply stream):

    apply cancellations, lost entries, deadlines → take requests → engine.step() → forward

Each job has its own module: the Redis side (reading, acknowledging, heartbeats, takeover)
is the `QueueConsumer`'s (queue_consumer.py); `RunningRequests` (running.py) holds the
requests the engine runs and settles each one's end; `Intake` (intake.py) takes requests
into the engine; `Drain` (drain.py) stops the worker. The heartbeat beats only while this
loop completes passes, so a frozen loop looks dead and its requests move to other workers.
`run_worker` is the process around it: the engine, its metrics and tracing, then the loop.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import msgspec
import redis
from prometheus_client import CollectorRegistry

from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.queue_protocol import WorkerInfo
from pagedserve.common.serve_config import ServeConfig
from pagedserve.common.step_stats import FinishedRequestStats, StepStats
from pagedserve.engine.engine import Engine
from pagedserve.engine.tensor_parallel import RankFailure
from pagedserve.prefix_cache.publisher import KVEventPublisher
from pagedserve.telemetry.metrics import WorkerMetrics, serve_metrics
from pagedserve.telemetry.tracing import Tracing
from pagedserve.worker.drain import Drain, drain_when_orphaned, shutdown_error
from pagedserve.worker.intake import Intake
from pagedserve.worker.queue_consumer import QueueConsumer
from pagedserve.worker.request_tracing import request_traces
from pagedserve.worker.running import RunningRequests
from pagedserve.worker.totals import WorkerTotals

logger = logging.getLogger(__name__)

#: the environment variable through which `pagedserve serve` gives its workers its pid:
#: a worker whose launcher is gone drains and exits instead of running on as an orphan
SUPERVISOR_PID_ENV = "PAGEDSERVE_SUPERVISOR_PID"


class WorkerService:
    def __init__(self, engine: Engine, config: ServeConfig, redis_url: str, worker_id: str | None = None,
                 tracing: Tracing | None = None, metrics: WorkerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics  # None: no Prometheus metrics (no --worker-metrics-port)
        self.config = config
        self.queue = QueueConsumer(redis_url, config, worker_id)
        self.worker_id = self.queue.worker_id
        self.last_pass = time.monotonic()  # when the loop last completed a pass (the heartbeat's liveness)
        # spans (no-ops when off), under the name clients ask for, as the gateway's and the metrics'
        self.traces = request_traces(tracing, self.worker_id, config.served_model_name or engine.config.model)
        engine.stats.keep_finished = True  # this service pops them every pass (`_observe`)
        self.running = RunningRequests(engine, self.queue.outbox, self.queue.heartbeat, self.traces, config)
        self.intake = Intake(engine, self.queue, self.running, self.traces, config, metrics)
        self.drain = Drain(self.worker_id, config.drain_timeout, self.running)  # called: drains (SIGTERM/SIGINT)
        self.totals = WorkerTotals(engine.config.block_size)  # running sums its heartbeat announces
        self.kv_events: KVEventPublisher | None = None  # the cluster index's feed (--kv-events)
        if config.kv_events:
            self.kv_events = KVEventPublisher(self.queue.redis, self.worker_id, engine.kv_manager.pool,
                                              engine.config.block_size, config.kv_events_max_len)

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until drained (SIGTERM/SIGINT, see `Drain`)."""
        self.last_pass = time.monotonic()
        self.queue.heartbeat.start(self.info, self.loop_alive)
        logger.info("worker %s serving %s (max_model_len %d)", self.worker_id, self.engine.config.model,
                    self.engine.max_model_len)
        backoff = 0.1
        while True:
            try:
                if not self._iteration():
                    break
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.OutOfMemoryError) as exc:
                if self.drain.active and (not self.running or self.drain.expired()):
                    # Draining must end even without Redis (it may have stopped first).
                    logger.warning("worker %s drained with redis unreachable; %d request(s) end unreported",
                                   self.worker_id, len(self.running))
                    break
                logger.warning("redis unavailable (%s); retrying in %.1f s", exc, backoff)
                self.queue.connection_lost()
                if self.queue.wait(backoff):
                    break
                backoff = min(backoff * 2, 2.0)
            except RankFailure as exc:  # the worker is its ranks: it goes down whole, the queue moves its requests
                logger.error("worker %s stops: %s", self.worker_id, exc)
                raise
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

    # -- one pass of the loop ---------------------------------------------------------------
    def _iteration(self) -> bool:
        """Returns False when the worker is done (drained)."""
        self.queue.outbox.flush()  # what an earlier pass could not write goes first, in order
        self.running.cancel(self.queue.cancellations.poll())
        self.running.drop_lost(self.queue.heartbeat.lost_entries())
        self.running.expire_deadlines()
        if self.drain.active:
            if not self.running:
                self._observe(None)  # what this pass's aborts and cancellations ended
                self.queue.outbox.flush()  # their final chunks and acks, written before leaving
                return False
            if self.drain.expired():
                self._end_unfinished()
                self._observe(None)
                self.queue.outbox.flush()
                return False
        else:
            self.intake.take()
        step = None  # engine.last_step stays from an earlier pass when this one runs no step
        if self.engine.has_unfinished_requests():
            self.running.forward(self.engine.step())
            step = self.engine.last_step
        if self.kv_events is not None:
            self.kv_events.publish()
        self._observe(step)
        self.queue.outbox.flush()
        return True

    def _end_unfinished(self) -> None:
        """The drain's time is up: hand the running requests back to the queue when another
        worker takes requests (a scale-down: it resumes them), else end each with an error (the
        whole server stops)."""
        hand_back = self.config.drain_hand_back and self.queue.heartbeat.others_accepting()
        logger.info("worker %s: drain timeout; %s %d request(s)", self.worker_id,
                    "handing back" if hand_back else "ending", len(self.running))
        runs = list(self.running.values())
        for run in runs:
            if hand_back:
                self.running.hand_back(run)
            else:
                self.running.end(run, shutdown_error())
        if hand_back:
            self.queue.outbox.flush()  # what the clients were sent goes first: the taker resumes from it
            self.queue.heartbeat.release((run.stream, run.entry_id) for run in runs)

    def _observe(self, step: StepStats | None) -> None:
        """Hand what the engine did (this pass's step, None if it ran none; the requests that
        ended) to the telemetry."""
        finished = self.engine.pop_finished()
        self.traces.observe(step, finished, self.running)
        self.totals.observe(step, finished)
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

    def info(self) -> WorkerInfo:
        kv = self.engine.kv_manager
        return WorkerInfo(
            worker_id=self.worker_id, model=self.engine.config.model, max_model_len=self.engine.max_model_len,
            pid=os.getpid(), host=socket.gethostname(), max_num_seqs=self.engine.config.max_num_seqs,
            num_running=len(self.running), num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_blocks,
            num_cancelled=self.running.num_cancelled, num_taken_over=self.running.num_taken_over,
            num_waiting=self.engine.scheduler.num_waiting, num_stolen=self.queue.reader.num_stolen,
            block_size=kv.block_size, kv_model_id=kv.model_id, kv_dtype=kv.kv_dtype,
            quantization=self.engine.config.quantization or "",
            activity=self.totals.snapshot(), draining=self.drain.active,
        )


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
    service.drain.install_signal_handlers()
    if supervisor := os.environ.get(SUPERVISOR_PID_ENV):
        drain_when_orphaned(service.drain, int(supervisor))
    try:
        service.run()
    finally:
        engine.close()
        tracing.shutdown()  # the last spans leave before the process exits (cli: os._exit)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()

