"""`RequestRouting`: which worker's stream an admitted prompt goes to.

For each prompt: its block hashes (`prefix_cache.block_hash.prompt_block_hashes`, with the
block size, model id and quantized KV dtype the workers announce in their heartbeat), then who holds how many
leading blocks (a `PrefixLookup`, the prefix cache service's index; none: load only), then
a `RouterPlugin` (`--router`) weighs the live workers, and the queue's ADMIT script writes
the prompt into that worker's stream, under every bound it keeps for the shared ones.

Routing must cost little next to admission: the workers' heartbeat infos and their queued
requests are read at most once per `routing_info_ttl` (what this gateway routed since is
added locally, so a burst does not pile onto one worker), a lookup gets
`prefix_lookup_timeout` and is skipped without a block to look up, and hashing a long
prompt runs off the event loop. A lookup that fails or times out routes by load (counted:
`prefix_lookup_fallbacks_total`); a router that raises sends the prompt to the shared queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pagedserve.common.contracts import (
    PrefixLookup,
    RouteDecision,
    RouterPlugin,
    RoutingInput,
    WorkerCandidate,
)
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.queue_protocol import QueuedRequest, WorkerInfo, routed_owner
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.plugins import load_plugin
from pagedserve.prefix_cache.block_hash import prompt_block_hashes
from pagedserve.telemetry.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

#: prompts of more blocks than this are hashed in a worker thread (about 2 µs a block)
_HASH_INLINE_BLOCKS = 256

#: runs a CPU-heavy function off the event loop (GatewayState.run_blocking)
Offload = Callable[..., Awaitable[list[bytes]]]


def build_router(config: ServeConfig) -> RouterPlugin:
    """The router named by `--router`, from the `pagedserve.routers` entry points."""
    return load_plugin("routers", config.router)(config)


def prefix_lookup_from_config(config: ServeConfig) -> PrefixLookup | None:
    """The prefix cache service's client for `--prefix-cache-url` (prefix_cache/index_client.py);
    None without one (routing by load). A URL that is not http(s) is refused at startup."""
    if config.prefix_cache_url is None:
        return None
    if not config.prefix_cache_url.startswith(("http://", "https://")):
        raise InvalidParameterError("prefix_cache_url", "must be the http:// address of `pagedserve prefix-cache`")
    from pagedserve.prefix_cache.index_client import IndexClient

    return IndexClient(config.prefix_cache_url, timeout=config.prefix_lookup_timeout)


@dataclass(slots=True)
class _WorkerView:
    """The live workers as routing last read them, plus what this gateway routed since."""

    infos: list[WorkerInfo] = field(default_factory=list)
    queued: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker → (requests, tokens) queued for it
    read_at: float = float("-inf")  # monotonic

    def add(self, worker_id: str, num_tokens: int) -> None:
        requests, tokens = self.queued.get(worker_id, (0, 0))
        self.queued[worker_id] = (requests + 1, tokens + num_tokens)


class RequestRouting:
    """Routes and admits prompts (`submit`); one per gateway."""

    def __init__(self, config: ServeConfig, queue: QueueClient, router: RouterPlugin, lookup: PrefixLookup | None,
                 metrics: GatewayMetrics, offload: Offload | None = None):
        self.config = config
        self.queue = queue
        self.router = router
        self.lookup = lookup  # None: route by load only
        self.metrics = metrics
        self.offload = offload  # None: hash long prompts inline too
        self._view = _WorkerView()
        self._refresh: asyncio.Task | None = None

    async def close(self) -> None:
        """Close the lookup's connections, if it has any (an `IndexClient` does)."""
        aclose = getattr(self.lookup, "aclose", None)
        if aclose is not None:
            await aclose()

    async def submit(self, request: QueuedRequest, max_requests: int | None = None,
                     max_queued_tokens: int | None = None) -> RouteDecision:
        """Route the prompt and admit it (raising as `QueueClient.submit` does); returns where
        it went (the shared queue when its worker was gone by then)."""
        decision, cached = await self._decide(request)
        stream = await self.queue.submit(request, max_requests, max_queued_tokens, decision.worker_id,
                                         cached.get(decision.worker_id or "", 0))
        if decision.worker_id is not None and routed_owner(stream) != decision.worker_id:
            decision = RouteDecision(worker_id=None, reason="shared")  # it died since the last heartbeat read
        if decision.worker_id is not None:
            self._view.add(decision.worker_id, len(request.prompt_token_ids))
        self.metrics.count_routed(decision.reason)
        return decision

    async def decide(self, request: QueuedRequest) -> RouteDecision:
        """Where the prompt should go, as the router sees the live workers now."""
        return (await self._decide(request))[0]

    async def _decide(self, request: QueuedRequest) -> tuple[RouteDecision, dict[str, int]]:
        """The decision, and the prompt tokens each worker holds cached."""
        infos, queued = await self._workers()
        if not infos:
            return RouteDecision(worker_id=None, reason="shared"), {}
        cached = await self._cached_tokens(request, infos)
        candidates = [
            WorkerCandidate(
                worker_id=w.worker_id, cached_tokens=cached.get(w.worker_id, 0),
                num_running=max(0, w.num_running - w.num_waiting), num_waiting=w.num_waiting,
                queued_tokens=queued.get(w.worker_id, (0, 0))[1], max_num_seqs=w.max_num_seqs,
                queued_requests=queued.get(w.worker_id, (0, 0))[0])
            for w in infos
        ]
        try:
            decision = self.router.route(RoutingInput(prompt_tokens=len(request.prompt_token_ids),
                                                      tenant=request.tenant), candidates)
        except Exception:  # a router bug must not fail the request: any worker may take it
            logger.exception("router %s failed; the request goes to the shared queue", self.config.router)
            return RouteDecision(worker_id=None, reason="shared"), cached
        if decision.worker_id is not None and decision.worker_id not in {c.worker_id for c in candidates}:
            logger.error("router %s chose %r, not a live worker; the request goes to the shared queue",
                         self.config.router, decision.worker_id)
            return RouteDecision(worker_id=None, reason="shared"), cached
        return decision, cached

    async def _cached_tokens(self, request: QueuedRequest, infos: Sequence[WorkerInfo]) -> dict[str, int]:
        """Worker id → leading prompt tokens it holds, as the lookup says (empty: none known).
        Workers that hash differently (another block size, model id or KV dtype) are asked separately."""
        if self.lookup is None:
            return {}
        groups: dict[tuple[int, str, str], set[str]] = {}
        for w in infos:
            if w.block_size > 0 and w.kv_model_id:
                groups.setdefault((w.block_size, w.kv_model_id, w.kv_dtype), set()).add(w.worker_id)
        cached: dict[str, int] = {}
        for (block_size, model_id, kv_dtype), members in groups.items():
            hashes = await self._hashes(request, block_size, model_id, kv_dtype)
            if not hashes:
                continue
            blocks = await self._lookup(hashes)
            cached.update({w: n * block_size for w, n in blocks.items() if w in members and n > 0})
        return cached

    async def _hashes(self, request: QueuedRequest, block_size: int, model_id: str, kv_dtype: str) -> list[bytes]:
        ids = request.prompt_token_ids
        if self.offload is not None and len(ids) // block_size > _HASH_INLINE_BLOCKS:
            return await self.offload(prompt_block_hashes, ids, block_size, model_id, request.cache_salt, kv_dtype)
        return prompt_block_hashes(ids, block_size, model_id, request.cache_salt, kv_dtype)

    async def _lookup(self, hashes: list[bytes]) -> Mapping[str, int]:
        assert self.lookup is not None
        try:
            return await asyncio.wait_for(self.lookup.cached_blocks(hashes), self.config.prefix_lookup_timeout)
        except asyncio.TimeoutError:
            self.metrics.count_lookup_fallback("timeout")
            logger.debug("prefix lookup timed out; routing by load")
        except Exception as exc:  # noqa: BLE001 - the service down must not fail requests
            self.metrics.count_lookup_fallback("error")
            logger.warning("prefix lookup failed (%s: %s); routing by load", type(exc).__name__, exc)
        return {}

    async def _workers(self) -> tuple[list[WorkerInfo], dict[str, tuple[int, int]]]:
        """The live workers and their queued requests and tokens, read again once older than
        routing_info_ttl (one read at a time, however many requests wait for it)."""
        if time.monotonic() - self._view.read_at >= self.config.routing_info_ttl:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.get_running_loop().create_task(self._read_view())
            await asyncio.shield(self._refresh)
        return self._view.infos, self._view.queued

    async def _read_view(self) -> None:
        try:
            infos, queued = await self.queue.routing_view()
        except Exception as exc:  # noqa: BLE001 - Redis away: admission answers for it
            logger.debug("routing: cannot read the workers (%s); keeping the last view", exc)
            self._view.read_at = time.monotonic()  # not again before the ttl: admission fails meanwhile anyway
            return
        self._view = _WorkerView(infos, queued, time.monotonic())
