"""What the engine did, for the worker's metrics and traces: made once, read by both.
The records (`StepStats`, `FinishedRequestStats`) are in `pagedserve/common/step_stats.py`.

After each step the engine's `StepStatsCollector` hands out a `StepStats` (`Engine.last_step`);
every request that ends, by finishing, an abort or a failed step, leaves a
`FinishedRequestStats` (`Engine.pop_finished()`). The readers (Prometheus counters, OTel
spans) only read them: nothing here knows about either.

Times are `time.monotonic()` seconds of the worker, like `RequestMetrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.common.contracts import SchedulerOutput
from pagedserve.common.outputs import RequestDelta
from pagedserve.common.step_stats import FinishedRequestStats, StepStats
from pagedserve.engine.grammar_manager import StructuredOutputCounters
from pagedserve.prefix_cache.block_pool import PrefixCacheStats


@dataclass
class StepStatsCollector:
    """Turns a step's scheduler output and deltas into `StepStats`, and ended requests into
    `FinishedRequestStats`. It keeps only what a step alone does not say: each running
    request's last token time and the prefix cache counters at the previous step."""

    prefix_stats: PrefixCacheStats  # the block pool's counters (read, never written)
    #: the grammar manager's counters (read; their compile times are taken)
    structured: StructuredOutputCounters = field(default_factory=StructuredOutputCounters)
    # whether ended requests are kept for `pop_finished`: only a reader that pops them (the
    # worker service) turns it on, so that in-process use (LLM.generate) keeps nothing
    keep_finished: bool = False
    _last_token: dict[str, float] = field(default_factory=dict)  # request id → its last token's time
    _queries: int = 0  # prefix_stats at the previous step
    _hits: int = 0
    _tier_hits: int = 0
    _structured: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # the structured counters at the previous step
    _finished: list[FinishedRequestStats] = field(default_factory=list)

    def step(self, started: float, scheduled: SchedulerOutput, deltas: list[RequestDelta], num_running: int,
             num_waiting: int, kv_cache_usage: float, verified: tuple[int, int, int] = (0, 0, 0)) -> StepStats:
        """`verified`: speculative decoding's (verifications, draft tokens, accepted tokens)."""
        now = time.monotonic()
        request_ids: dict[str, None] = {}
        prompt_lengths: dict[str, int] = {}
        for entry in scheduled.scheduled:
            parent = entry.request.parent_id or entry.request.request_id
            request_ids[parent] = None
            prompt_lengths[parent] = entry.request.num_prompt_tokens
        num_prompt = num_generated = 0
        latencies = []
        for delta in deltas:
            if new_tokens := sum(len(d.token_ids) for d in delta.deltas):
                num_generated += new_tokens
                last = self._last_token.get(delta.request_id)
                if last is None:
                    num_prompt += prompt_lengths.get(delta.request_id, 0)
                else:
                    latencies.append(now - last)
                self._last_token[delta.request_id] = now
            if delta.finished:
                self.finished(delta)
        so = self.structured
        now_so = (so.num_requests, so.num_cache_hits, so.num_cache_misses, so.num_forced_tokens, so.num_steps_saved)
        so_delta = [a - b for a, b in zip(now_so, self._structured)]
        self._structured = now_so
        compile_times, so.compile_times = tuple(so.compile_times), []
        queries, hits, tier = self.prefix_stats.num_queries, self.prefix_stats.num_hits, self.prefix_stats.num_tier_hits
        stats = StepStats(
            started=started, ended=now, request_ids=tuple(request_ids), num_batched_tokens=scheduled.num_batched_tokens,
            num_prompt_tokens=num_prompt, num_generated_tokens=num_generated, num_preempted=len(scheduled.preempted),
            num_running=num_running, num_waiting=num_waiting, kv_cache_usage=kv_cache_usage,
            prefix_cache_queries=queries - self._queries, prefix_cache_hits=hits - self._hits,
            inter_token_latencies=tuple(latencies), prefix_cache_tier_hits=tier - self._tier_hits,
            num_verifications=verified[0], num_draft_tokens=verified[1], num_accepted_tokens=verified[2],
            num_structured_requests=so_delta[0], grammar_compile_times=compile_times, grammar_cache_hits=so_delta[1],
            grammar_cache_misses=so_delta[2], num_forced_tokens=so_delta[3], num_jump_forward_tokens=so_delta[4],
        )
        self._queries, self._hits, self._tier_hits = queries, hits, tier
        return stats

    def finished(self, delta: RequestDelta) -> None:
        """Record a request's end from its final delta (a step's, an abort's or a failure's)."""
        self._last_token.pop(delta.request_id, None)
        output = delta.output
        if not self.keep_finished or output is None or output.metrics is None:
            return
        metrics = output.metrics
        self._finished.append(FinishedRequestStats(
            request_id=output.request_id,
            finish_reasons=tuple(c.finish_reason or "abort" for c in output.outputs),  # an ended one has a reason
            num_prompt_tokens=len(output.prompt_token_ids),
            num_output_tokens=sum(len(c.token_ids) for c in output.outputs),
            num_cached_tokens=output.num_cached_tokens,
            num_preemptions=metrics.num_preemptions,
            arrival_time=metrics.arrival_time,
            first_token_time=metrics.first_token_time,
            finished_time=metrics.finished_time if metrics.finished_time is not None else time.monotonic(),
            error=output.error,
        ))

    def pop_finished(self) -> list[FinishedRequestStats]:
        finished, self._finished = self._finished, []
        return finished
