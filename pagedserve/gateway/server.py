"""Run the gateway under uvicorn, draining on SIGTERM/SIGINT, with limits on connections and
on slow clients (`http_timeouts`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path

import uvicorn

from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.model_store import resolve_model
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.auth import parse_api_keys, parse_tenant_limits
from pagedserve.gateway.http_timeouts import with_request_timeouts
from pagedserve.gateway.tokenizer import PromptTokenizer


def build_gateway(config: ServeConfig, engine: EngineConfig, redis_url: str):
    """The Litestar app for this model: its tokenizer, names and context length."""
    model_dir = Path(resolve_model(engine.model))
    model_config = json.loads((model_dir / "config.json").read_text())
    max_len = model_config.get("max_position_embeddings") or 2048
    if engine.max_model_len:
        max_len = min(max_len, engine.max_model_len)
    names = tuple(dict.fromkeys(n for n in (config.served_model_name, engine.model) if n))
    keys = parse_api_keys(config.api_keys_file, os.environ.get("PAGEDSERVE_API_KEYS"))
    eos = model_config.get("eos_token_id")
    eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return create_app(config, redis_url, PromptTokenizer(model_dir), names, max_len, keys,
                      vocab_size=model_config.get("vocab_size"), max_n=engine.max_n,
                      tenant_limits=parse_tenant_limits(config.api_keys_file), engine=engine, eos_token_ids=eos_ids)


def uvicorn_config(app, config: ServeConfig) -> uvicorn.Config:
    """uvicorn for the gateway: at most `max_connections` connections (a request on one
    beyond gets an OpenAI-shaped 503), idle keep-alive connections closed after
    `keep_alive_timeout`, and a request's headers and body bounded in time."""
    metrics = app.state.gateway.metrics  # the answers the protocol writes itself count too
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          timeout_graceful_shutdown=int(config.drain_timeout) + 5, access_log=False,
                          timeout_keep_alive=config.keep_alive_timeout,
                          http=with_request_timeouts(config.header_timeout, config.body_timeout, config.max_connections,
                                                     on_answer=partial(metrics.count_answer, None)))


class _DrainingServer(uvicorn.Server):
    """uvicorn stops accepting on a signal; the app also learns it, to end streams in time,
    and so does `on_signal` (the launcher, to drain its workers at the same time)."""

    def __init__(self, config: uvicorn.Config, app, on_signal: Callable[[int], None] | None = None):
        super().__init__(config)
        self._app = app
        self._on_signal = on_signal

    def handle_exit(self, sig, frame) -> None:
        self._app.state.gateway.begin_drain()
        if self._on_signal is not None:
            self._on_signal(sig)
        super().handle_exit(sig, frame)


def run_gateway(config: ServeConfig, engine: EngineConfig, redis_url: str,
                on_signal: Callable[[int], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT; `on_signal(signum)` is called in the signal handler for each."""
    app = build_gateway(config, engine, redis_url)
    uv_config = uvicorn_config(app, config)
    # uvicorn re-raises the signal that stopped it once it is done: make SIGTERM an exit the
    # caller's cleanup (workers, Redis) still runs after, like Ctrl-C.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with contextlib.suppress(KeyboardInterrupt):
        _DrainingServer(uv_config, app, on_signal).run()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)
