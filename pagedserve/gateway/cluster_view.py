"""`ClusterView`: builds the answer of `GET /v1/cluster` (cluster_status.py) from what the
gateway already knows, and serves it.

- The workers: their heartbeat infos (`QueueClient.routing_view`, the read routing does),
  each one's running sums (`WorkerInfo.activity`) turned into rates between two samples at
  least `_MIN_INTERVAL` apart. A worker whose heartbeat stopped is kept, as not alive, for
  `_GONE_KEPT` seconds, so the page shows which one went away.
- The queue: its counters in Redis (`QueueClient.queued_totals`).
- The gateway: its own Prometheus counters (`GatewayMetrics.registry`), read as they stand.
- The prefix cache service's `/health`, when --prefix-cache-url names one.

A background task (`run`, started by create_app) samples every `_SAMPLE_EVERY` seconds and
keeps `_HISTORY` points for the charts; an answer samples too, so its counts are current.
Nothing here is on a request's path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

import httpx
from litestar import Request, get
from redis.exceptions import RedisError

from pagedserve.common.errors import ServiceUnavailableError
from pagedserve.common.queue_protocol import WorkerInfo
from pagedserve.common.worker_activity import WorkerActivity
from pagedserve.gateway.cluster_status import (
    ClusterStatus,
    GatewayCounts,
    HistoryPoint,
    PrefixCacheStatus,
    QueueStatus,
    WorkerStatus,
)
from pagedserve.gateway.routes import require_api_key
from pagedserve.gateway.state import GatewayState

logger = logging.getLogger(__name__)

_SAMPLE_EVERY = 2.0  # seconds between the background samples (one history point each)
_MIN_INTERVAL = 1.0  # a rate needs two samples at least this far apart
_HISTORY = 180  # points kept: 6 minutes at one per 2 s
_GONE_KEPT = 300.0  # seconds a worker whose heartbeat stopped stays listed (not alive)


@dataclass(slots=True)
class _Seen:
    """One worker as the view last saw it, and its rate then."""

    info: WorkerInfo
    seen_at: float  # monotonic, of the latest heartbeat read
    sampled_at: float  # monotonic, of the sample its rate started from
    sampled: WorkerActivity  # its sums at that sample
    charted: WorkerActivity  # its sums at the latest chart point
    tokens_per_second: float = 0.0


class ClusterView:
    def __init__(self, state: GatewayState):
        self.state = state
        self.workers: dict[str, _Seen] = {}
        self.history: deque[HistoryPoint] = deque(maxlen=_HISTORY)
        self.queued: dict[str, tuple[int, int]] = {}  # worker → (requests, tokens) routed to it, not taken
        self.prefix_cache: PrefixCacheStatus | None = None
        self._live: set[str] = set()  # the workers whose heartbeat the last sample read
        self._http: httpx.AsyncClient | None = None
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """Sample every _SAMPLE_EVERY seconds until cancelled (one history point each)."""
        try:
            while True:
                try:
                    await self.sample(history=True)
                    await self._sample_prefix_cache()
                except Exception as exc:  # noqa: BLE001 - Redis away: keep the last view
                    logger.debug("cluster view: %s", exc)
                await asyncio.sleep(_SAMPLE_EVERY)
        finally:
            if self._http is not None:
                await self._http.aclose()

    async def sample(self, history: bool = False) -> None:
        """Read the live workers and update each one's rate; with `history`, add a chart point."""
        async with self._lock:
            infos, self.queued = await self.state.queue.routing_view()
            now = time.monotonic()
            for info in infos:
                seen = self.workers.get(info.worker_id)
                if seen is None:
                    self.workers[info.worker_id] = _Seen(info, now, now, info.activity, info.activity)
                    continue
                if now - seen.sampled_at >= _MIN_INTERVAL:
                    gained = info.activity.generated_tokens - seen.sampled.generated_tokens
                    seen.tokens_per_second = gained / (now - seen.sampled_at)
                    seen.sampled_at, seen.sampled = now, info.activity
                seen.info, seen.seen_at = info, now
            for worker_id in [w for w, s in self.workers.items() if now - s.seen_at > _GONE_KEPT]:
                del self.workers[worker_id]
            self._live = {i.worker_id for i in infos}
            if history:
                await self._chart_point(infos)

    async def _chart_point(self, infos: list[WorkerInfo]) -> None:
        """One history point: the live workers' tokens/s, and the mean TTFT of the first
        tokens since the previous point (each worker's sums against those it had then)."""
        first_tokens, ttft = 0, 0.0
        for info in infos:
            seen = self.workers[info.worker_id]
            first_tokens += info.activity.first_tokens - seen.charted.first_tokens
            ttft += info.activity.ttft_seconds - seen.charted.ttft_seconds
            seen.charted = info.activity
        depth, _ = await self.state.queue.queued_totals()
        self.history.append(HistoryPoint(
            time=time.time(), tokens_per_second=round(sum(self.workers[i.worker_id].tokens_per_second for i in infos), 3),
            ttft_seconds=round(ttft / first_tokens, 4) if first_tokens else None, queue_depth=depth,
            running=sum(i.num_running for i in infos)))

    async def _sample_prefix_cache(self) -> None:
        url = self.state.config.prefix_cache_url
        if url is None:
            return
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=url, timeout=0.5)
        try:
            health = (await self._http.get("/health")).json()
            self.prefix_cache = PrefixCacheStatus(reachable=True, workers=int(health["workers"]),
                                                  blocks=int(health["blocks"]))
        except Exception:  # noqa: BLE001 - the service down is what the page shows
            self.prefix_cache = PrefixCacheStatus(reachable=False, workers=0, blocks=0)

    async def status(self) -> ClusterStatus:
        """The answer: a fresh sample of the workers and the queue, and the counters as they stand."""
        await self.sample()
        depth, tokens = await self.state.queue.queued_totals()
        config, now = self.state.config, time.monotonic()
        workers = sorted((self._worker(s, now) for s in self.workers.values()),
                         key=lambda w: (not w.alive, w.host, w.worker_id))
        return ClusterStatus(
            time=time.time(), model=self.state.model_names[0], workers_alive=sum(w.alive for w in workers),
            workers=workers,
            queue=QueueStatus(depth=depth, tokens=tokens, max_requests=config.max_queued_requests,
                              max_tokens=config.max_queued_tokens),
            gateway=gateway_counts(self.state), prefix_cache=self.prefix_cache if config.prefix_cache_url else None,
            history=list(self.history))

    def _worker(self, seen: _Seen, now: float) -> WorkerStatus:
        info, sums = seen.info, seen.info.activity
        alive = info.worker_id in self._live
        return WorkerStatus(
            worker_id=info.worker_id, host=info.host, pid=info.pid, alive=alive, num_running=info.num_running,
            num_waiting=info.num_waiting, max_num_seqs=info.max_num_seqs,
            queued_for_it=self.queued.get(info.worker_id, (0, 0))[0],
            kv_cache_usage=round(1 - info.num_free_blocks / info.num_blocks, 4) if info.num_blocks else 0.0,
            num_blocks=info.num_blocks,
            prefix_hit_rate=round(sums.prefix_hits / sums.prefix_queries, 4) if sums.prefix_queries else None,
            tokens_per_second=round(seen.tokens_per_second, 3) if alive else 0.0,
            generated_tokens=sums.generated_tokens, finished_requests=sums.finished, restarts=sums.restarts,
            uptime_seconds=round(time.time() - sums.started_at, 1) if sums.started_at else 0.0,
            taken_over=info.num_taken_over, stolen=info.num_stolen, cancelled=info.num_cancelled)


def gateway_counts(state: GatewayState) -> GatewayCounts:
    """This gateway's counters as they stand, from its Prometheus registry."""
    requests: dict[str, dict[str, int]] = {}
    rejected: dict[tuple[str, str], int] = {}
    routed: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for family in state.metrics.registry.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels, value = sample.labels, int(sample.value)
            if family.name == "pagedserve:http_requests":
                requests.setdefault(labels["route"], {})[labels["status_code"]] = value
            elif family.name == "pagedserve:requests_rejected":
                rejected[(labels["status_code"], labels["reason"])] = value
            elif family.name == "pagedserve:requests_routed":
                routed[labels["reason"]] = value
            elif family.name == "pagedserve:prefix_lookup_fallbacks":
                fallbacks[labels["reason"]] = value
    by_reason: dict[str, int] = {}
    for (_, reason), value in rejected.items():
        by_reason[reason] = by_reason.get(reason, 0) + value
    return GatewayCounts(
        requests=requests, rejected_429=sum(v for (s, _), v in rejected.items() if s == "429"),
        rejected_503=sum(v for (s, _), v in rejected.items() if s == "503"), rejections=by_reason, routed=routed,
        lookup_fallbacks=fallbacks)


@get("/v1/cluster", summary="The cluster as the gateway sees it: workers, queue, rejections, recent rates",
     guards=[require_api_key])
async def cluster_status(request: Request) -> ClusterStatus:
    view: ClusterView = request.app.state.cluster_view
    try:
        return await view.status()
    except RedisError as exc:
        raise ServiceUnavailableError(f"the queue is unreachable: {exc}") from None
