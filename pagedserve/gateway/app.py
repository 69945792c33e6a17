"""The Litestar app: `create_app` assembles the gateway for one model around one
`GatewayState` (state.py: what its routes share).

Where the rest lives: the routes in `routes`, request checks in `validation` and (on the raw
body) `json_limits`, the serve path (admission, merged outputs, SSE, disconnects) in
`streaming`, OpenAI-shaped errors and the exception handlers in `errors`, the HTTP server's
own limits (connections, slow clients) in `server` and `http_timeouts`.
"""

from __future__ import annotations

import asyncio
import logging
import os

import anyio
from litestar import Litestar
from litestar.datastructures import State
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig

from pagedserve.common.contracts import PrefixLookup, RouterPlugin
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import PagedServeError
from pagedserve.common.http_errors import (
    http_error_handler,
    internal_error_handler,
    paged_error_handler,
)
from pagedserve.common.sampling_params import MAX_N
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.auth import TenantLimits
from pagedserve.gateway.cluster_view import ClusterView, cluster_status
from pagedserve.gateway.console import CONSOLE_HANDLERS
from pagedserve.gateway.error_handlers import validation_error_handler
from pagedserve.gateway.grammar_check import GrammarChecker
from pagedserve.gateway.http_metrics import count_answers, metrics_endpoint
from pagedserve.gateway.http_tracing import server_span_middleware
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.request_routing import (
    RequestRouting,
    build_router,
    prefix_lookup_from_config,
)
from pagedserve.gateway.routes import ROUTE_HANDLERS
from pagedserve.gateway.state import GatewayState
from pagedserve.gateway.tokenizer import PromptTokenizer
from pagedserve.plugins import load_plugin
from pagedserve.telemetry.tracing import Tracing

logger = logging.getLogger(__name__)


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


def grammar_checker(tokenizer: PromptTokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                    engine: EngineConfig | None) -> GrammarChecker:
    """The checker of output constraints, with the engine's backend (built at its first use)
    and limits."""
    limits = engine or EngineConfig()

    def build():
        return load_plugin("structured_output", limits.structured_output_backend)(
            tokenizer.model_dir, vocab_size, eos_token_ids, 1)

    return GrammarChecker(build, limits.max_structured_output_chars, limits.structured_output_compile_timeout)


def create_app(config: ServeConfig, redis_url: str, tokenizer: PromptTokenizer, model_names: tuple[str, ...],
               max_model_len: int, api_keys: dict[str, str], vocab_size: int | None = None,
               tenant_limits: dict[str, TenantLimits] | None = None, max_n: int = MAX_N,
               tracing: Tracing | None = None, router: RouterPlugin | None = None,
               prefix_lookup: PrefixLookup | None = None, engine: EngineConfig | None = None,
               eos_token_ids: frozenset[int] = frozenset()) -> Litestar:
    """The gateway for one model; `vocab_size` defaults to the tokenizer's, `tracing` to what
    the OTEL_* variables say, `router` to --router's plugin, `prefix_lookup` to the prefix
    cache service's client for --prefix-cache-url (none: routing by load). `engine` gives the
    grammar backend and the structured-output limits (default: EngineConfig's defaults)."""
    tracing = tracing if tracing is not None else Tracing.from_env("pagedserve-gateway")
    vocab_size = vocab_size or tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    state = GatewayState(config, QueueClient(redis_url, config), tokenizer, model_names, max_model_len, vocab_size,
                         api_keys, tenant_limits or {}, max_n, tracing=tracing)
    state.grammar = grammar_checker(tokenizer, vocab_size, eos_token_ids, engine)
    state.tool_parser = load_plugin("tool_parsers", config.tool_call_parser)()
    state.routing = RequestRouting(
        config, state.queue, router if router is not None else build_router(config),
        prefix_lookup if prefix_lookup is not None else prefix_lookup_from_config(config),
        state.metrics, offload=state.run_blocking)

    cluster_view = ClusterView(state)  # GET /v1/cluster, and the console's cluster view

    async def startup(app: Litestar) -> None:
        state.spawn(_watch_workers(state))
        state.spawn(cluster_view.run())

    async def shutdown(app: Litestar) -> None:
        for task in list(state.background):
            task.cancel()
        state.grammar.close()
        await state.routing.close()
        await state.queue.close()
        await anyio.to_thread.run_sync(state.tracing.shutdown)  # the last spans leave (bounded)

    return Litestar(
        route_handlers=[*ROUTE_HANDLERS, metrics_endpoint, cluster_status,
                        *(CONSOLE_HANDLERS if config.console else [])],
        middleware=[server_span_middleware(tracing)] if tracing.enabled else [],
        before_send=[count_answers(state.metrics)],
        state=State({"gateway": state, "cluster_view": cluster_view}),
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
