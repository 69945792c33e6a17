"""`Intake`: how requests get from the queue into the engine. On a pass with room it takes
back the entries of dead workers (every heartbeat_interval), then pulls new ones; a full
worker still takes one request of each tenant it runs nothing of, so that the scheduler
can give that tenant its share at the next step. Each entry taken is checked before the
engine gets it: a client gone while it was queued, too many deliveries, a deadline passed
in the queue end it here; one another worker ran before resumes where its client's output
stands, as its gateway answers the claim (`Takeover.claim_outputs`, one wait for all the
entries taken together).
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from pagedserve.common.errors import PagedServeError
from pagedserve.common.queue_protocol import Fold, WireError, tenant_stream_of
from pagedserve.common.serve_config import ServeConfig
from pagedserve.engine.engine import Engine
from pagedserve.engine.input_processor import ResumedCompletion
from pagedserve.telemetry.metrics import WorkerMetrics
from pagedserve.worker.queue_consumer import QueueConsumer
from pagedserve.worker.request_reader import StreamView, TakenEntry
from pagedserve.worker.request_tracing import NoRequestTraces
from pagedserve.worker.running import Running, RunningRequests, timeout_error

logger = logging.getLogger(__name__)

#: how long an idle worker blocks on the queue before it looks at everything else again
_IDLE_BLOCK_MS = 100


class Intake:
    def __init__(self, engine: Engine, queue: QueueConsumer, running: RunningRequests, traces: NoRequestTraces,
                 config: ServeConfig, metrics: WorkerMetrics | None):
        self.engine = engine
        self.queue = queue
        self.running = running
        self.traces = traces
        self.config = config
        self.metrics = metrics
        self._next_reclaim = 0.0

    def _room(self) -> int:
        if self.engine.scheduler.num_waiting:
            return 0  # requests still wait inside: leave the rest to other workers
        return self.engine.config.max_num_seqs - len(self.running)

    def take(self) -> None:
        if time.monotonic() >= self._next_reclaim:
            if (room := self._room()) > 0:
                self._start_all(self.queue.takeover.reclaim(room))
            self._next_reclaim = time.monotonic() + self.config.heartbeat_interval
        view = self.queue.reader.streams()
        if (room := self._room()) > 0:
            block = None if self.engine.has_unfinished_requests() else _IDLE_BLOCK_MS
            # a busy worker leaves other workers' queued prompts to them (and to their caches)
            taken = self.queue.reader.pull(room, block, view, steal=len(self.running) <= self.config.steal_max_running)
        else:
            # Full: still take one request of each tenant that has nothing here, so that the
            # scheduler can give it its share at the next step instead of after the others.
            # (One per stream: a tenant's own routed stream and its shared one count apart.)
            present = {tenant_stream_of(run.stream) for run in self.running.values()}
            newcomers = [s for s in view.own + view.shared if tenant_stream_of(s) not in present]
            taken = self.queue.reader.pull(len(newcomers), None, StreamView(own=[], shared=newcomers, others=[],
                                                                            orphaned=view.orphaned)) if newcomers else []
        if self.metrics is not None and (stolen := sum(e.stolen for e in taken)):
            self.metrics.count_steals(stolen)
        self._start_all(taken)

    def _start_all(self, entries: list[TakenEntry]) -> None:
        """Start each entry; the ones other workers ran before resume from their gateways'
        answers to one claim each, waited for together."""
        runs: list[tuple[TakenEntry, Running]] = []
        seen: set[str] = set()
        for entry in entries:
            if entry.request.request_id in seen:  # one batch, one id twice
                logger.error("entry %s of %s repeats request %s taken with it; dropped", entry.entry_id, entry.stream,
                             entry.request.request_id)
                self.queue.outbox.ack(entry.stream, entry.entry_id)
                continue
            seen.add(entry.request.request_id)
            if (run := self._checked(entry)) is not None:
                runs.append((entry, run))
        claims = [(run.request_id, run.reply_to, run.attempt) for _, run in runs if run.attempt > 1]
        try:
            folds = self.queue.takeover.claim_outputs(claims)
        except RedisError as exc:
            # Left as they are: this worker's and unrefreshed, they are taken over again after
            # worker_timeout (XAUTOCLAIM), the delivery count one higher. The rest start now.
            logger.warning("claiming %d request(s) taken over failed (%s); they go back to the queue", len(claims), exc)
            runs, folds = [(e, r) for e, r in runs if r.attempt == 1], {}
        for entry, run in runs:
            resume = None
            if run.attempt > 1:
                resume = self._resume_state(run, entry.request.params.n, folds[run.request_id])
                if resume is None:
                    continue
            self._start(entry, run, resume)

    def _checked(self, entry: TakenEntry) -> Running | None:
        """The entry's run if it goes to the engine; None when it ends (or carries on) here."""
        request = entry.request
        if (mine := self.running.get(request.request_id)) is not None:
            # Reclaimed by this worker itself: its loop paused past worker_timeout (a slow step),
            # so its heartbeat left the entry idle and XAUTOCLAIM gave it back. It runs here
            # already: carry on. (Another entry under the same id is a duplicate: leave it.)
            if (mine.stream, mine.entry_id) != (entry.stream, entry.entry_id):
                logger.error("entry %s of %s repeats running request %s; dropped", entry.entry_id, entry.stream,
                             request.request_id)
                self.queue.outbox.ack(entry.stream, entry.entry_id)
            return None
        run = Running(entry.stream, entry.entry_id, request.request_id, entry.attempt, request.deadline,
                      request.reply_to)
        if self.metrics is not None and entry.attempt == 1 and request.enqueued_at is not None:
            # a later delivery's wait since admission includes the run on a worker that died
            self.metrics.observe_queue_time(time.time() - request.enqueued_at)
        if self.queue.cancellations.is_cancelled(request.request_id):
            self.queue.outbox.ack(entry.stream, entry.entry_id)  # the client left while it was queued
            self._count_unstarted("abort", request.params.n)
            return None
        if not request.reply_to:  # admitted by a gateway older than the reply streams: no way to answer
            logger.error("request %s names no reply stream; acknowledged unanswered", request.request_id)
            self.queue.outbox.ack(entry.stream, entry.entry_id)
            self._count_unstarted("error", request.params.n)
            return None
        self.traces.start(request, entry.attempt)
        if entry.attempt > self.config.max_attempts:
            self.running.end(run, WireError(message=f"the request failed: {entry.attempt - 1} workers died while running it",
                                            type="server_error", code="worker_failed", status_code=500), started=False)
            self._count_unstarted("error", request.params.n)
            return None
        if time.time() > request.deadline:
            self.running.end(run, timeout_error(self.config), started=False)
            self._count_unstarted("abort", request.params.n)  # as a running request past its deadline
            return None
        return run

    def _start(self, entry: TakenEntry, run: Running, resume: list[ResumedCompletion] | None) -> None:
        request = entry.request
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                    cache_salt=request.cache_salt, resume=resume, tenant=request.tenant)
        except PagedServeError as exc:
            self.running.end(run, WireError(message=exc.message, type=exc.error_type, code=exc.code,
                                            param=exc.param, status_code=exc.status_code), started=False)
            self._count_unstarted("error", request.params.n)
            return
        except Exception as exc:  # a bug must fail this request, not the worker
            logger.exception("could not start request %s", request.request_id)
            if self.engine.abort_request(request.request_id, "error") is None:  # else the engine reports its end
                self._count_unstarted("error", request.params.n)
            self.running.end(run, WireError(message=f"the worker could not start the request: {type(exc).__name__}",
                                            code="internal_error"), started=False)
            return
        self.running.add(run)

    def _count_unstarted(self, reason: str, n: int) -> None:
        """A request this worker took and ended before the engine had it (the engine counts
        the rest): its n completions count under `reason` in request_success_total."""
        if self.metrics is not None:
            self.metrics.count_finished(reason, n)

    def _resume_state(self, run: Running, n: int, fold: Fold | None) -> list[ResumedCompletion] | None:
        """What the client has of each completion, as its gateway answered (`fold`; None: no
        answer); None, and the entry settled, if nothing is left to do."""
        if fold is None:  # its gateway is gone or far behind: end it visibly, should it read again
            self.running.end(run, WireError(message="the worker that took the request over could not learn what its "
                                                    "client had been sent; retry it", type="server_error",
                                            code="request_lost", status_code=503), started=False)
            self._count_unstarted("error", n)
            return None
        if fold.done:  # its final chunk was written before the old owner stopped
            self.queue.outbox.ack(run.stream, run.entry_id)
            return None
        if not fold.waiting:  # its client went away
            self.queue.outbox.ack(run.stream, run.entry_id)
            self._count_unstarted("abort", n)
            return None
        if all(c.finish_reason is not None for c in fold.completions):
            self.running.end(run, None, started=False)
            return None
        return [ResumedCompletion(c.token_ids, c.num_chars, c.finish_reason) for c in fold.completions]
