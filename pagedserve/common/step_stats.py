"""What one engine step did and how each request ended: the records the engine hands to the
worker's metrics and traces (`pagedserve.engine.stats_collector.StepStatsCollector` makes them).

They sit in common so that the telemetry layer, below the worker, reads the same types.
Times are `time.monotonic()` seconds of the worker, like `RequestMetrics`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class FinishedRequestStats:
    """One caller request that ended on this worker."""

    request_id: str
    finish_reasons: tuple[str, ...]  # one per completion: "stop", "length", "abort" or "error"
    num_prompt_tokens: int
    num_output_tokens: int  # over all completions, tokens generated before a resume included
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_preemptions: int  # the most times one of its sequences was preempted (recomputed) here
    arrival_time: float  # added to the engine
    first_token_time: float | None  # its first token was sampled here (None: none was)
    finished_time: float
    error: str | None = None  # why it failed, when the engine could not serve it

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time


@dataclass(slots=True, frozen=True)
class StepStats:
    """One engine step: what it computed and the state it left."""

    started: float  # when scheduling began
    ended: float  # when the step's outputs were made
    request_ids: tuple[str, ...]  # the caller requests it computed for, each once, in scheduling order
    num_batched_tokens: int  # tokens computed (prefill chunks and decodes)
    num_prompt_tokens: int  # prompt lengths of the requests whose first token came this step (as vLLM counts)
    num_generated_tokens: int  # tokens sampled
    num_preempted: int  # sequences preempted by this step's scheduling
    num_running: int  # sequences admitted and unfinished, after the step
    num_waiting: int  # sequences not yet admitted, after the step
    kv_cache_usage: float  # share of the KV blocks in use, after the step (0..1)
    prefix_cache_queries: int  # blocks looked up in the prefix cache during the step
    prefix_cache_hits: int  # of those, blocks found (in the pool, or loaded from the KV tier)
    inter_token_latencies: tuple[float, ...]  # per request that had a token before: seconds since its last one
    prefix_cache_tier_hits: int = 0  # of the hits, blocks loaded from the shared KV tier for them
    num_verifications: int = 0  # speculative decoding: sequences that verified drafts this step
    num_draft_tokens: int = 0  # draft tokens the step verified
    num_accepted_tokens: int = 0  # of those, accepted (each one a token gained over plain decoding)
    # structured output (engine/grammar_manager.py), since the previous step
    num_structured_requests: int = 0  # structured requests admitted
    grammar_compile_times: tuple[float, ...] = ()  # seconds each grammar compiled in (off the step loop)
    grammar_cache_hits: int = 0  # specs found compiled (or known invalid) in the cache
    grammar_cache_misses: int = 0  # specs compiled
    num_forced_tokens: int = 0  # tokens a grammar forced (taken without a sample)
    num_jump_forward_tokens: int = 0  # of those, appended beyond one per step (decode steps saved)

    @property
    def duration(self) -> float:
        return self.ended - self.started
