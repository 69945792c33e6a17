"""The built-in routers: `least-loaded` and `cache-aware` (the default).

A worker's load is the share of its sequence slots taken or promised: the requests its
engine runs or holds waiting, plus the requests routed to it and not yet taken, over its
`max_num_seqs`. Workers of different sizes compare fairly that way. Ties go to fewer queued
prompt tokens, then to the smaller worker id, so the same inputs always give the same answer.

`cache-aware` sends a request to the worker that holds the longest prefix of its prompt,
unless that worker's load exceeds the least-loaded worker's by more than
`router_load_margin`: a prefix saves the prefill of its tokens once, a hot worker delays
every request behind it. Among workers within the margin it takes the longest prefix, then
the lower load. With nothing cached anywhere (or nothing within the margin) it is
`least-loaded`, and says so (reason `load`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.common.contracts import (
    RouteDecision,
    RouterPlugin,
    RoutingInput,
    ServeConfig,
    WorkerCandidate,
)

#: no live worker: the shared queue, which every worker that comes up reads
_SHARED = RouteDecision(worker_id=None, reason="shared")


def load(worker: WorkerCandidate) -> float:
    """The share of the worker's sequence slots its running, waiting and queued requests take."""
    return (worker.num_running + worker.num_waiting + worker.queued_requests) / max(1, worker.max_num_seqs)


def _by_load(worker: WorkerCandidate) -> tuple[float, int, str]:
    return load(worker), worker.queued_tokens, worker.worker_id


class LeastLoadedRouter(RouterPlugin):
    """The worker with the lowest load (see the module docstring); the prompt plays no part."""

    def __init__(self, config: ServeConfig | None = None):
        pass

    def route(self, request: RoutingInput, workers: Sequence[WorkerCandidate]) -> RouteDecision:
        if not workers:
            return _SHARED
        return RouteDecision(worker_id=min(workers, key=_by_load).worker_id, reason="load")


class CacheAwareRouter(RouterPlugin):
    """The worker holding the longest prefix of the prompt, within `load_margin` of the least
    load (see the module docstring)."""

    def __init__(self, config: ServeConfig | None = None, load_margin: float | None = None):
        if load_margin is None:
            load_margin = config.router_load_margin if config is not None else ServeConfig().router_load_margin
        self.load_margin = load_margin

    def route(self, request: RoutingInput, workers: Sequence[WorkerCandidate]) -> RouteDecision:
        if not workers:
            return _SHARED
        least = min(workers, key=_by_load)
        limit = load(least) + self.load_margin
        holders = [w for w in workers if w.cached_tokens > 0 and load(w) <= limit]
        if not holders:
            return RouteDecision(worker_id=least.worker_id, reason="load")
        best = min(holders, key=lambda w: (-w.cached_tokens, *_by_load(w)))
        return RouteDecision(worker_id=best.worker_id, reason="cache")
