"""ServeConfig: the gateway, the queue and the workers of `pagedserve serve|gateway|worker`
(from flags and `PAGEDSERVE_*` variables through options.py)."""

from __future__ import annotations

import msgspec

from pagedserve.common.errors import InvalidParameterError


class ServeConfig(msgspec.Struct, kw_only=True):
    """The gateway, the queue and the workers: `pagedserve serve|gateway|worker` fill it from
    flags, then `PAGEDSERVE_<FIELD>` environment variables, then these defaults."""

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None  # None: `serve` starts a Redis of its own
    served_model_name: str | None = None  # the name clients ask for; None: the model's
    api_keys_file: str | None = None  # lines "KEY TENANT" (or "KEY"); keys also from PAGEDSERVE_API_KEYS
    max_queued_requests: int = 1024  # admitted but not yet taken by a worker; above: 429
    max_queued_tokens: int = 1_048_576  # their prompt tokens; above: 429
    max_prompt_tokens: int | None = None  # None: the context length
    max_tokens_limit: int | None = None  # largest max_tokens a request may ask (null is capped to it); None: context
    max_prompts_per_request: int = 64  # prompts of one /v1/completions request
    max_choices_per_request: int = 128  # prompts × n of one request
    max_stop_strings: int = 16  # entries of `stop`
    max_stop_string_length: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64  # entries of `stop_token_ids`
    max_body_bytes: int = 8 * 1024 * 1024  # larger bodies get 413
    request_timeout: float = 600.0  # seconds from admission until a request ends with a timeout
    #: publish each worker's cached-block changes to `pagedserve:kv-events` for the prefix
    #: cache service (`pagedserve prefix-cache`), which cache-aware routing asks; off:
    #: nothing is sent. None: on in `serve` with more than one worker, else off
    kv_events: bool | None = None
    kv_events_max_len: int = 10_000  # batches the stream keeps (older ones are trimmed)
    #: with --kv-events, `serve` also runs the prefix cache service on this port (0: a free one)
    prefix_cache_port: int = 8300
    heartbeat_interval: float = 1.0  # seconds between worker heartbeats
    # a worker silent this long is dead; its requests move. A worker beats only while its step
    # loop completes passes, so one engine step must take less than this (a frozen loop stops
    # beating and its requests move, as after a kill)
    worker_timeout: float = 10.0
    max_attempts: int = 3  # deliveries of one request before it fails (its workers kept dying)
    drain_timeout: float = 30.0  # on SIGTERM: seconds running requests get to finish
    #: what a draining worker does with the requests still running at drain_timeout: hand
    #: them back to the queue, where a worker that is not draining resumes each one from what
    #: its client has been sent (a scale-down), or end them with `worker_shutdown` (off, or
    #: when every live worker drains: the whole server stops)
    drain_hand_back: bool = True
    #: admit requests while no worker is live: they wait in the queue (up to request_timeout)
    #: for a worker an autoscaler starts, and /ready needs Redis only. Off: 503 `no_worker`
    queue_without_workers: bool = False
    num_workers: int | None = None  # `serve`: None: one per GPU, or one on CPU
    log_level: str = "info"
    # Per tenant (an API key's tenant; every caller is one tenant without keys). The keys
    # file may set both per tenant; these are the defaults. Above either: 429.
    tenant_max_requests: int = 1024  # prompts admitted and not finished (queued or running)
    tenant_max_queued_tokens: int = 1_048_576  # prompt tokens admitted and not yet taken by a worker
    max_json_depth: int = 32  # nesting of arrays and objects in a request body; deeper: 400 before it is parsed
    max_chat_messages: int = 1024  # entries of a chat request's `messages`
    max_cache_salt_length: int = 256  # characters of a request's `cache_salt`
    max_tools: int = 128  # entries of a chat request's `tools`
    # how a model writes tool calls (`tool_choice: auto`): an entry point in pagedserve.tool_parsers
    tool_call_parser: str = "hermes"
    console: bool = True  # the browser console at the gateway's `/` (--no-console: no page; /v1/cluster stays)
    tokenizer_threads: int = 4  # threads that tokenize and render chat templates, off the event loop
    max_connections: int = 2048  # open HTTP connections and running requests; a request beyond them gets 503
    keep_alive_timeout: int = 5  # seconds an idle keep-alive connection stays open
    header_timeout: float = 10.0  # seconds a client has to send a request's headers (slowloris)
    body_timeout: float = 60.0  # seconds a client has to send a request's body, once its headers arrived
    worker_restart_limit: int = 5  # `serve`: restarts of one worker within worker_restart_window; past it, it stays down
    worker_restart_window: float = 300.0  # `serve`: seconds over which worker_restart_limit counts restarts
    worker_restart_backoff_max: float = 30.0  # `serve`: longest wait before a restart (1 s, doubling per recent restart)
    redis_maxmemory: int = 1 << 30  # bytes the Redis `serve` starts may hold; beyond them writes fail (noeviction), nothing is evicted
    # a worker serves its Prometheus metrics on this port (`serve`: worker i on this port + i); None: no metrics server
    worker_metrics_port: int | None = None
    worker_metrics_host: str = "127.0.0.1"  # the address the workers' metrics servers listen on (0.0.0.0: every interface)
    # Routing (gateway/request_routing.py): which worker's stream a request goes to
    router: str = "cache-aware"  # entry point in pagedserve.routers (cache-aware | least-loaded)
    prefix_cache_url: str | None = None  # the prefix cache service the gateway asks who holds a prompt; None: route by load
    # cache-aware: the worker holding the longest prefix wins unless its load (requests taken
    # or queued for it, per sequence slot) exceeds the least-loaded worker's by more than this
    router_load_margin: float = 0.5
    # seconds a lookup may take; past it, or on an error, route by load. A lookup takes about
    # 2 ms, but 15 of 96 timed out at 0.05 s with the CPU saturated by the workers
    prefix_lookup_timeout: float = 0.2
    routing_info_ttl: float = 0.5  # seconds the gateway reuses the workers' heartbeat infos for routing
    # a request routed to a busy worker that waited this long unread is taken by a worker with room (a steal)
    steal_after: float = 0.5
    # a worker steals only while it runs at most this many requests (0: only when idle). A
    # stolen prompt loses the cached prefix its router chose its worker for, so a worker that
    # is busy itself gains nothing by taking it: on CPU, 2 workers stealing whenever they had
    # free slots undid cache-aware routing (multi-turn hit rate 56% instead of 69%)
    steal_max_running: int = 0
    # a routed request waits this many milliseconds longer before a steal for each prompt
    # token its worker holds cached (the thief would compute them again), about what a token
    # of prefill costs a busy CPU thread (lower it for GPU workers; 0: off). multi-turn on 2
    # CPU workers: 1 ms let 20 of 96 turns be stolen (hit rate 61.2%), 3 ms 3 (66.3%)
    steal_cached_token_ms: float = 3.0
    #: seconds between the gateway's reads of its reply stream (one XREAD for every request it
    #: waits on, gateway/output_reader.py); a token reaches its client up to this much later
    output_poll_interval: float = 0.01
    #: seconds between two writes of a running request's new tokens by its worker (merged into
    #: one chunk; the first and the last go at once): fewer events, burstier streams.
    #: 0: every step (docs/scaling.md#redis-budget)
    output_interval: float = 0.0
    #: entries a gateway's reply stream keeps at most (approximately, XADD MAXLEN ~): a bound on
    #: Redis memory when a gateway stops reading. One that falls this far behind finds entries
    #: gone: every request it waits on then ends with request_lost. A gateway trims what it
    #: has read itself
    reply_stream_max_len: int = 50_000
    #: seconds a worker that takes over requests waits for their gateways to say what their
    #: clients have been sent (at most half of worker_timeout: its step loop waits meanwhile;
    #: a live gateway answers within its poll interval); a request whose gateway does not
    #: answer (gone, or far behind) ends with request_lost
    takeover_fold_timeout: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens", "max_attempts", "max_body_bytes",
                     "max_prompts_per_request", "max_choices_per_request", "max_stop_strings",
                     "max_stop_string_length", "max_stop_token_ids", "tenant_max_requests",
                     "tenant_max_queued_tokens", "max_json_depth", "max_chat_messages",
                     "max_cache_salt_length", "max_tools", "tokenizer_threads", "max_connections", "keep_alive_timeout",
                     "kv_events_max_len", "reply_stream_max_len"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be >= 1")
        for name in ("request_timeout", "heartbeat_interval", "worker_timeout", "drain_timeout", "header_timeout",
                     "body_timeout"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(name, "must be > 0 seconds")
        if not 0 <= self.prefix_cache_port <= 65535:
            raise InvalidParameterError("prefix_cache_port", "must be a port number (0: any free one)")
        if self.worker_timeout <= 2 * self.heartbeat_interval:
            raise InvalidParameterError("worker_timeout", "must be more than two heartbeat intervals")
        if self.worker_restart_limit < 0:
            raise InvalidParameterError("worker_restart_limit", "must be >= 0")
        for name in ("worker_restart_window", "worker_restart_backoff_max"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(name, "must be > 0 seconds")
        if self.redis_maxmemory < 1:
            raise InvalidParameterError("redis_maxmemory", "must be >= 1 byte")
        for name in ("prefix_lookup_timeout", "routing_info_ttl", "output_poll_interval", "takeover_fold_timeout"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(name, "must be > 0 seconds")
        if self.output_interval < 0:
            raise InvalidParameterError("output_interval", "must be >= 0 seconds (0: every step)")
        if self.steal_after < 0:
            raise InvalidParameterError("steal_after", "must be >= 0 seconds")
        if self.steal_cached_token_ms < 0:
            raise InvalidParameterError("steal_cached_token_ms", "must be >= 0 milliseconds")
        if self.steal_max_running < 0:
            raise InvalidParameterError("steal_max_running", "must be >= 0 (0: steal only when idle)")
        if self.router_load_margin < 0:
            raise InvalidParameterError("router_load_margin", "must be >= 0")
        if not self.tool_call_parser:
            raise InvalidParameterError("tool_call_parser", "must name a tool-call parser (hermes)")
        if not self.router:
            raise InvalidParameterError("router", "must name a router (cache-aware, least-loaded)")
        if self.worker_metrics_port is not None and not 1 <= self.worker_metrics_port <= 65535:
            raise InvalidParameterError("worker_metrics_port", "must be a TCP port, 1 to 65535")
        if not self.worker_metrics_host:
            raise InvalidParameterError("worker_metrics_host", "must be an address")
