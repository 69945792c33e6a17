"""Prometheus metrics of the workers and the gateway, under vLLM's names with the `pagedserve:`
prefix (docs/metrics.md lists them).

Each process makes one `CollectorRegistry` and passes it here: nothing goes into
prometheus_client's global registry, so two apps (or tests) in one process never share
counters. No label takes a value per request: `model_name` is one value per process,
`finished_reason` one of `FINISHED_REASONS`, and the gateway's labels are route templates,
status codes and error codes from fixed sets (anything else becomes "other").

This module reads what the other layers hand out (the engine's `StepStats` and
`FinishedRequestStats`, from common) and never changes it.
"""

from __future__ import annotations

import json
import logging
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from pagedserve.common.step_stats import FinishedRequestStats, StepStats

logger = logging.getLogger(__name__)

PREFIX = "pagedserve:"

#: how a completion ended (FinishedRequestStats.finish_reasons); each is exported from the start, at 0
FINISHED_REASONS = ("stop", "length", "abort", "error")

#: vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours unchanged
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
GRAMMAR_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)

#: the gateway's error codes of its 429s and 503s (the `reason` label); any other code is "other"
REJECTION_REASONS = frozenset({
    "queue_full", "tenant_requests_limit", "tenant_tokens_limit",  # 429: the queue's and the tenant's bounds
    "service_unavailable",  # 503: no live worker, Redis unreachable or out of memory
    "request_lost", "shutting_down", "worker_shutdown",  # 503: during a request
    "too_many_connections",  # 503: beyond --max-connections (http_timeouts)
})
#: why a prompt went where it went (contracts.routing.RouteReason); each exported from the start, at 0
ROUTE_REASONS = ("cache", "load", "shared")
#: why a prefix cache lookup gave no answer
LOOKUP_FALLBACK_CAUSES = ("timeout", "error")
#: the `route` of a request that matched no route (unknown paths, protocol-level answers)
OTHER = "other"
#: routes whose 503 is a probe's answer, not a refused request: never in requests_rejected_total
PROBE_ROUTES = frozenset({"/health", "/ready", "/metrics"})


class WorkerMetrics:
    """One worker's engine metrics. The service calls `observe_step` and `observe_finished`
    after each pass (`WorkerService._observe`), `set_state` on passes without a step, and
    `observe_queue_time` when it takes a request from the queue."""

    def __init__(self, registry: CollectorRegistry, model_name: str, block_size: int, proposer: str | None = None):
        self.block_size = block_size  # prefix-cache lookups are counted in blocks; exported in tokens, like vLLM
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=registry, buckets=buckets).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences admitted by the scheduler and unfinished.")
        self.waiting = gauge("num_requests_waiting", "Sequences in the engine waiting to be admitted.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: the share of blocks in use (1 means 100 percent).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prefix cache queries, in tokens (full blocks looked up × block size).")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens (blocks found × block size).")
        self.prefix_tier_hits = counter("prefix_cache_tier_hits",
                                        "Of the prefix cache hits, tokens whose blocks were loaded from the shared "
                                        "KV tier for the request (the rest came from this worker's own pool).")
        tier_blocks = Counter(PREFIX + "kv_tier_blocks", "KV tier blocks, by what happened: saved (evicted blocks "
                              "sent), loaded (into this pool), dropped (the writer was behind), skipped (sent "
                              "recently), stored (new to the tier).", [*labels, "event"], registry=registry)
        self.tier_blocks = {event: tier_blocks.labels(model_name, event)
                            for event in ("saved", "loaded", "dropped", "skipped", "stored")}
        tier_bytes = Counter(PREFIX + "kv_tier_bytes", "K/V bytes moved between this worker and the KV tier.",
                             [*labels, "direction"], registry=registry)
        self.tier_bytes = {d: tier_bytes.labels(model_name, d) for d in ("out", "in")}
        self.tier_errors = counter("kv_tier_errors", "KV tier requests that failed (each a miss or a block not "
                                   "stored; nothing else fails).")
        self._tier_seen: dict[str, int] = {}
        self.preemptions = counter("num_preemptions", "Sequences preempted (to be recomputed) by the scheduler.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests whose first token came.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter(PREFIX + "request_success", "Completions that ended, by finish reason.",
                          [*labels, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram("time_to_first_token_seconds",
                              "Seconds from a request's arrival in the engine to its first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Seconds between a request's consecutive tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Seconds from a request's arrival in the engine to its end.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Seconds from admission by the gateway until a worker took the request.",
                                    REQUEST_LATENCY_BUCKETS)
        # speculative decoding, by proposer (vLLM's names); none without a proposer
        self.spec: tuple[Counter, Counter, Counter] | None = None
        if proposer is not None:
            def spec_counter(name: str, doc: str) -> Counter:
                return Counter(PREFIX + name, doc, [*labels, "proposer"], registry=registry).labels(model_name, proposer)

            self.spec = (
                spec_counter("spec_decode_num_drafts", "Sequence steps that verified draft tokens."),
                spec_counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
                spec_counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (each one a token gained over "
                             "plain decoding). Mean accepted length: accepted tokens / drafts."),
            )
        self.structured_requests = counter("structured_output_requests", "Requests whose output a grammar constrains.")
        self.grammar_compile = histogram("structured_output_compile_seconds", "Seconds a grammar took to compile "
                                         "(in the engine's thread pool, off the step loop).", GRAMMAR_COMPILE_BUCKETS)
        self.grammar_cache_hits = counter("structured_output_cache_hits", "Specs found compiled (or known invalid) "
                                          "in the engine's grammar cache.")
        self.grammar_cache_misses = counter("structured_output_cache_misses", "Specs the engine compiled.")
        self.jump_forward_tokens = counter("structured_output_jump_forward_tokens", "Tokens a grammar forced that "
                                           "were appended beyond one per step (each a decode step saved).")
        self.steals = counter("requests_stolen", "Requests this worker took from another worker's routed stream "
                              "(that worker busy past steal_after, or dead).")

    def set_state(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """The engine's state now (after a step, or on a pass without one)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_cache_usage)

    def observe_step(self, step: StepStats) -> None:
        self.set_state(step.num_running, step.num_waiting, step.kv_cache_usage)
        if step.prefix_cache_queries:
            self.prefix_queries.inc(step.prefix_cache_queries * self.block_size)
        if step.prefix_cache_hits:
            self.prefix_hits.inc(step.prefix_cache_hits * self.block_size)
        if step.prefix_cache_tier_hits:
            self.prefix_tier_hits.inc(step.prefix_cache_tier_hits * self.block_size)
        if step.num_preempted:
            self.preemptions.inc(step.num_preempted)
        if step.num_prompt_tokens:
            self.prompt_tokens.inc(step.num_prompt_tokens)
        if step.num_generated_tokens:
            self.generation_tokens.inc(step.num_generated_tokens)
        if self.spec is not None and step.num_verifications:
            for counter, value in zip(self.spec, (step.num_verifications, step.num_draft_tokens,
                                                  step.num_accepted_tokens)):
                counter.inc(value)
        for latency in step.inter_token_latencies:
            self.itl.observe(latency)
        for seconds in step.grammar_compile_times:
            self.grammar_compile.observe(seconds)
        for metric, value in ((self.structured_requests, step.num_structured_requests),
                              (self.grammar_cache_hits, step.grammar_cache_hits),
                              (self.grammar_cache_misses, step.grammar_cache_misses),
                              (self.jump_forward_tokens, step.num_jump_forward_tokens)):
            metric.inc(value)  # structured output (0 without)

    def observe_finished(self, finished: FinishedRequestStats) -> None:
        """A request that ended in the engine: one success count per completion (as vLLM
        counts each of n samples), one TTFT and one e2e latency per request."""
        for reason in finished.finish_reasons:
            self.count_finished(reason)
        if (ttft := finished.time_to_first_token) is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(finished.e2e_latency)

    def count_finished(self, reason: str, count: int = 1) -> None:
        """Completions that ended with `reason` (one of FINISHED_REASONS; anything else counts as error)."""
        self.success.get(reason, self.success["error"]).inc(count)

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(max(0.0, seconds))  # clocks of two machines may disagree a little

    def count_steals(self, count: int) -> None:
        self.steals.inc(count)

    def observe_kv_tier(self, totals: dict[str, int]) -> None:
        """The KV tier's running totals (`KVTier.totals()`); each counter grows by the change."""
        for name, value in totals.items():
            change = value - self._tier_seen.get(name, 0)
            if change <= 0:
                continue
            self._tier_seen[name] = value
            if name.startswith("blocks_"):
                self.tier_blocks[name.removeprefix("blocks_")].inc(change)
            elif name.startswith("bytes_"):
                self.tier_bytes[name.removeprefix("bytes_")].inc(change)
            elif name == "errors":
                self.tier_errors.inc(change)


class GatewayMetrics:
    """The gateway's metrics: every answer by route and status, the 429s and 503s by reason,
    and the queue's depth and live workers (set by the gateway's periodic watcher, so a scrape
    never waits on Redis)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests admitted and not yet taken by a worker "
                                 "(as of the gateway's last look, every 2 s).", registry=registry)
        self.workers_alive = Gauge(PREFIX + "workers_alive", "Workers whose heartbeat is current "
                                   "(as of the gateway's last look, every 2 s).", registry=registry)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests answered 429 or 503, by the error code.",
                                ["status_code", "reason"], registry=registry)
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests answered, by route template and status.",
                                     ["route", "status_code"], registry=registry)
        routed = Counter(PREFIX + "requests_routed", "Prompts admitted, by why they went where they went: cache "
                         "(a worker's cached prefix), load (load alone), shared (the shared queue).",
                         ["reason"], registry=registry)
        self.routed = {reason: routed.labels(reason) for reason in ROUTE_REASONS}
        lookups = Counter(PREFIX + "prefix_lookup_fallbacks", "Prefix cache lookups that failed or timed out "
                          "(the prompt was routed by load), by reason.", ["reason"], registry=registry)
        self.lookup_fallbacks = {cause: lookups.labels(cause) for cause in LOOKUP_FALLBACK_CAUSES}

    def set_queue(self, queue_depth: int, workers_alive: int) -> None:
        self.queue_depth.set(queue_depth)
        self.workers_alive.set(workers_alive)

    def count_routed(self, reason: str) -> None:
        """One prompt admitted, routed for `reason` (one of ROUTE_REASONS)."""
        self.routed[reason].inc()

    def count_lookup_fallback(self, cause: str) -> None:
        """A prefix cache lookup that did not answer in time (`timeout`) or failed (`error`)."""
        self.lookup_fallbacks[cause].inc()

    def count_answer(self, route: str | None, status_code: int, reason: str | None = None) -> None:
        """One answered request. `route`: its template (None: it matched none); `reason`: the
        error code of a 429 or 503 (outside REJECTION_REASONS: "other")."""
        route = route or OTHER
        self.http_requests.labels(route, str(status_code)).inc()
        if status_code in (429, 503) and route not in PROBE_ROUTES:
            self.rejected.labels(str(status_code), reason if reason in REJECTION_REASONS else OTHER).inc()


def error_code_of(body: bytes) -> str | None:
    """The `error.code` of an OpenAI-shaped error body, or None."""
    try:
        error = json.loads(body).get("error")
        code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, str) else None


# -- exposition -----------------------------------------------------------------------------------
#: the content type of what `exposition` answers: Prometheus' text format 0.0.4
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format 0.0.4, whatever format the scraper asks for.

    prometheus-client's own servers negotiate, and answer a Prometheus server (which asks
    for OpenMetrics first) with `pagedserve_...` sample names: its OpenMetrics writer
    replaces the colon. The names must be the same for every reader, so both the gateway's
    /metrics and the workers' port answer this format only."""
    return generate_latest(registry)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer | None:
    """Serve the registry at http://host:port/metrics from a thread; None (logged) when the
    port cannot be bound: the worker serves requests without metrics rather than not at all."""
    def app(environ, start_response):
        if environ.get("PATH_INFO") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the metrics are at /metrics\n"]
        body = exposition(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    try:
        server = make_server(host, port, app, _Server, handler_class=_QuietHandler)
    except OSError as exc:
        logger.error("worker metrics: cannot listen on %s:%d (%s); serving without a metrics endpoint",
                     host, port, exc)
        return None
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    logger.info("worker metrics at http://%s:%d/metrics", host, server.server_address[1])
    return server
