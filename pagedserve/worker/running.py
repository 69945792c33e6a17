"""`RunningRequests`: the queue entries the engine works on, by request id, and every way one
of them ends:
- the engine finished it: its last deltas go out marked done, then the ack (`forward`);
- it ends here, with an error (past its deadline, a failed start, a shutdown) or with
  nothing left to send: a final chunk, then the ack (`end`, `expire_deadlines`);
- its client went away: aborted, acknowledged, its chunks held back dropped (`cancel`);
- another worker took its entry over (this one stalled): dropped without a word, the other
  worker reports it (`drop_lost`);
- this worker stops (a drain ran out of time) while others take requests: handed back,
  dropped without a word or an ack, so that its entry goes idle and another worker takes it
  over and resumes it from what the client has been sent (`hand_back`).
Each change hands the heartbeat the entries it keeps fresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from pagedserve.common.outputs import RequestDelta
from pagedserve.common.queue_protocol import Chunk, WireError
from pagedserve.common.serve_config import ServeConfig
from pagedserve.engine.engine import Engine
from pagedserve.worker.heartbeat import Heartbeat, OwnedEntry
from pagedserve.worker.outbox import Outbox
from pagedserve.worker.request_tracing import NoRequestTraces

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Running:
    """A queue entry the engine is working on."""

    stream: str  # the stream of its entry (a tenant stream or a routed one)
    entry_id: str  # in that stream
    request_id: str
    attempt: int  # delivery count: 1 unless another worker died with it
    deadline: float  # unix seconds
    reply_to: str  # the reply stream of its gateway (QueuedRequest.reply_to)


def timeout_error(config: ServeConfig) -> WireError:
    return WireError(message=f"the request did not finish within the {config.request_timeout:g} s request timeout",
                     type="timeout_error", code="request_timeout", status_code=504)


class RunningRequests(Mapping[str, Running]):
    def __init__(self, engine: Engine, outbox: Outbox, heartbeat: Heartbeat, traces: NoRequestTraces,
                 config: ServeConfig):
        self.engine = engine
        self.outbox = outbox
        self.heartbeat = heartbeat
        self.traces = traces
        self.config = config
        self._runs: dict[str, Running] = {}  # by request id
        self.num_cancelled = 0
        self.num_taken_over = 0
        self.num_handed_back = 0  # left to other workers when a drain ran out of time

    def __getitem__(self, request_id: str) -> Running:
        return self._runs[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._runs

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, run: Running) -> None:
        """The engine has the request now."""
        self._runs[run.request_id] = run
        self.num_taken_over += run.attempt > 1
        self._owned_changed()

    def forward(self, outputs: list[RequestDelta]) -> None:
        """Each step's deltas go out as they are; a finished request is settled."""
        for out in outputs:
            run = self._runs.get(out.request_id)
            if run is None:
                continue
            deltas = out.deltas
            if out.finished:
                error = None if out.error is None else WireError(message=out.error, code="engine_error")
                self.outbox.finish(run.request_id, run.reply_to,
                                   Chunk(attempt=run.attempt, deltas=deltas, done=True, error=error,
                                         num_cached_tokens=out.num_cached_tokens),
                                   run.stream, run.entry_id)
                self._runs.pop(run.request_id, None)
                self._owned_changed()
            elif deltas:
                self.outbox.send(run.request_id, run.reply_to, Chunk(attempt=run.attempt, deltas=deltas))

    def end(self, run: Running, error: WireError | None, started: bool = True) -> None:
        """Final outcome outside a normal finish: an error (or nothing left), then the ack."""
        self.traces.error(run.request_id, error, started)
        if started:
            self._forget(run)
        self.outbox.finish(run.request_id, run.reply_to, Chunk(attempt=run.attempt, done=True, error=error),
                           run.stream, run.entry_id)

    def cancel(self, request_ids: Iterable[str]) -> None:
        """These requests' clients went away."""
        for request_id in request_ids:
            run = self._runs.get(request_id)
            if run is not None:
                logger.info("request %s cancelled by its client", request_id)
                self.num_cancelled += 1
                self._forget(run)
                self.outbox.drop(request_id)
                self.outbox.ack(run.stream, run.entry_id)

    def drop_lost(self, lost: set[tuple[str, str]]) -> None:
        """These entries (stream, entry id) are in another worker's hands now."""
        for run in [r for r in self._runs.values() if (r.stream, r.entry_id) in lost]:
            logger.warning("request %s was taken over by another worker; dropping it here", run.request_id)
            self._forget(run, record=False)  # the worker that took it over counts it

    def hand_back(self, run: Running) -> None:
        """Leave this request to another worker: no final chunk, no ack (see the module's doc)."""
        logger.warning("request %s handed back to the queue: this worker stops before it finished", run.request_id)
        self.num_handed_back += 1
        self._forget(run, record=False)  # the worker that takes it over counts it

    def expire_deadlines(self) -> None:
        now = time.time()
        for run in [r for r in self._runs.values() if r.deadline < now]:
            self.end(run, timeout_error(self.config))

    def _forget(self, run: Running, record: bool = True) -> None:
        self.engine.abort_request(run.request_id, record=record)
        self._runs.pop(run.request_id, None)
        self._owned_changed()

    def _owned_changed(self) -> None:
        self.heartbeat.set_owned(OwnedEntry(r.stream, r.entry_id, r.request_id) for r in self._runs.values())
