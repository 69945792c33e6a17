"""The Litestar app: `create_app` assembles the gateway for one model, and `GatewayState` is
what its routes share (the queue client, the tokenizer, the limits, the drain deadline).

Where the rest lives: the routes in `routes`, request checks in `validation` and (on the raw
body) `json_limits`, the serve path (admission, merged outputs, SSE, disconnects) in
`streaming`, OpenAI-shaped errors and the exception handlers in `errors`, the HTTP server's
own limits (connections, slow clients) in `server` and `http_timeouts`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from litestar import Litestar
from litestar.datastructures import State
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from prometheus_client import CollectorRegistry

from pagedserve.common.config import ServeConfig
from pagedserve.common.contracts import PrefixLookup, RouterPlugin
from pagedserve.common.errors import PagedServeError
from pagedserve.common.sampling_params import MAX_N
from pagedserve.gateway.auth import TenantLimits
from pagedserve.gateway.errors import (
    http_error_handler,
    internal_error_handler,
    paged_error_handler,
    validation_error_handler,
)
from pagedserve.gateway.http_metrics import count_answers, metrics_endpoint
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.routes import ROUTE_HANDLERS
from pagedserve.gateway.routing import RequestRouting, build_router, prefix_lookup_from_config
from pagedserve.gateway.tokenizer import PromptTokenizer
from pagedserve.gateway.tracing import server_span_middleware
from pagedserve.telemetry.metrics import GatewayMetrics
from pagedserve.telemetry.tracing import Tracing

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class GatewayState:
    """What the routes share; one per app."""

    config: ServeConfig
    queue: QueueClient
    tokenizer: PromptTokenizer
    model_names: tuple[str, ...]  # names clients may ask for; the first is announced
    max_model_len: int  # tightened to the smallest a live worker announces
    vocab_size: int  # token ids a prompt may hold
    api_keys: dict[str, str]  # key → tenant; empty: no auth
    tenant_limits: dict[str, TenantLimits]  # tenant → its own limits (others: the config's)
    max_n: int = MAX_N  # largest n the workers take (EngineConfig.max_n)
    drain_deadline: float | None = None  # monotonic; set on SIGTERM
    background: set[asyncio.Task] = field(default_factory=set)
    # at most `tokenizer_threads` CPU-heavy steps at once; made at first use, in the app's loop
    cpu_limiter: anyio.CapacityLimiter | None = None
    tracing: Tracing = field(default_factory=Tracing.disabled)  # the process's traces (off unless OTEL_* say)
    # the app's Prometheus metrics, on a registry of its own (GET /metrics)
    metrics: GatewayMetrics = field(default_factory=lambda: GatewayMetrics(CollectorRegistry()))
    routing: RequestRouting = field(init=False)  # which worker's stream each prompt goes to (set by create_app)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a CPU-heavy step (tokenizing, rendering a chat template, scanning a body) in a
        thread, so the event loop keeps serving other requests meanwhile."""
        if self.cpu_limiter is None:
            self.cpu_limiter = anyio.CapacityLimiter(self.config.tokenizer_threads)
        return await anyio.to_thread.run_sync(partial(fn, *args), limiter=self.cpu_limiter)

    def begin_drain(self) -> None:
        if self.drain_deadline is None:
            logger.info("gateway draining: no new requests, %g s for running ones", self.config.drain_timeout)
            self.drain_deadline = time.monotonic() + self.config.drain_timeout

    def spawn(self, coro) -> None:
        """Fire and forget, kept referenced until done (cancellations from finally blocks)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def _watch_workers(state: GatewayState) -> None:
    """Keep the context length at the smallest a live worker announces, the queue's
    counters reconciled with its streams, and the queue-depth and live-worker gauges current
    (so that a scrape of /metrics never waits on Redis)."""
    configured = state.max_model_len
    while True:
        try:
            queued, _tokens = await state.queue.reconcile()
            workers = await state.queue.live_workers()
            state.max_model_len = min([configured, *(w.max_model_len for w in workers)])
            state.metrics.set_queue(queued, len(workers))
        except Exception as exc:  # noqa: BLE001 - Redis away: keep the last value
            logger.debug("worker watch: %s", exc)
        await asyncio.sleep(2.0)


def create_app(config: ServeConfig, redis_url: str, tokenizer: PromptTokenizer, model_names: tuple[str, ...],
               max_model_len: int, api_keys: dict[str, str], vocab_size: int | None = None,
               tenant_limits: dict[str, TenantLimits] | None = None, max_n: int = MAX_N,
               tracing: Tracing | None = None, router: RouterPlugin | None = None,
               prefix_lookup: PrefixLookup | None = None) -> Litestar:
    """The gateway for one model; `vocab_size` defaults to the tokenizer's, `tracing` to what
    the OTEL_* variables say, `router` to --router's plugin, `prefix_lookup` to the prefix
    cache service's client for --prefix-cache-url (none: routing by load)."""
    tracing = tracing if tracing is not None else Tracing.from_env("pagedserve-gateway")
    vocab_size = vocab_size or tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    state = GatewayState(config, QueueClient(redis_url, config), tokenizer, model_names, max_model_len, vocab_size,
                         api_keys, tenant_limits or {}, max_n, tracing=tracing)
    state.routing = RequestRouting(
        config, state.queue, router if router is not None else build_router(config),
        prefix_lookup if prefix_lookup is not None else prefix_lookup_from_config(config),
        state.metrics, offload=state.run_blocking)

    async def startup(app: Litestar) -> None:
        state.spawn(_watch_workers(state))

    async def shutdown(app: Litestar) -> None:
        for task in list(state.background):
            task.cancel()
        await state.routing.close()
        await state.queue.close()
        await anyio.to_thread.run_sync(state.tracing.shutdown)  # the last spans leave (bounded)

    return Litestar(
        route_handlers=[*ROUTE_HANDLERS, metrics_endpoint],
        middleware=[server_span_middleware(tracing)] if tracing.enabled else [],
        before_send=[count_answers(state.metrics)],
        state=State({"gateway": state}),
        on_startup=[startup],
        on_shutdown=[shutdown],
        exception_handlers={
            PagedServeError: paged_error_handler,
            ValidationException: validation_error_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        request_max_body_size=config.max_body_bytes,
        openapi_config=OpenAPIConfig(title="pagedserve", version="0.1.0", path="/docs"),
        debug=bool(os.environ.get("PAGEDSERVE_DEBUG")),
        logging_config=None,  # the process configures logging once (cli.py)
    )
