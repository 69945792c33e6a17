"""`GatewayState`: what the gateway's routes share, one per app (the queue client, the
tokenizer, the limits, the drain deadline, the routing). `app.create_app` builds it; the
routes, the validation, the streaming and the HTTP metrics read it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from prometheus_client import CollectorRegistry

from pagedserve.common.contracts import ToolParser
from pagedserve.common.sampling_params import MAX_N
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.auth import TenantLimits
from pagedserve.gateway.grammar_check import GrammarChecker
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.request_routing import RequestRouting
from pagedserve.gateway.tokenizer import PromptTokenizer
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
    grammar: GrammarChecker = field(init=False)  # compiles output constraints before queueing (set by create_app)
    tool_parser: ToolParser = field(init=False)  # --tool-call-parser (set by create_app)
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
