"""What the engine did, for the worker's metrics and traces: made once, read by both.

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
from pagedserve.prefix_cache.block_pool import PrefixCacheStats


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
    prefix_cache_hits: int  # of those, blocks found
    inter_token_latencies: tuple[float, ...]  # per request that had a token before: seconds since its last one

    @property
    def duration(self) -> float:
        return self.ended - self.started


@dataclass
class StepStatsCollector:
    """Turns a step's scheduler output and deltas into `StepStats`, and ended requests into
    `FinishedRequestStats`. It keeps only what a step alone does not say: each running
    request's last token time and the prefix cache counters at the previous step."""

    prefix_stats: PrefixCacheStats  # the block pool's counters (read, never written)
    # whether ended requests are kept for `pop_finished`: only a reader that pops them (the
    # worker service) turns it on, so that in-process use (LLM.generate) keeps nothing
    keep_finished: bool = False
    _last_token: dict[str, float] = field(default_factory=dict)  # request id → its last token's time
    _queries: int = 0  # prefix_stats at the previous step
    _hits: int = 0
    _finished: list[FinishedRequestStats] = field(default_factory=list)

    def step(self, started: float, scheduled: SchedulerOutput, deltas: list[RequestDelta], num_running: int,
             num_waiting: int, kv_cache_usage: float) -> StepStats:
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
            new_tokens = sum(len(d.token_ids) for d in delta.deltas)
            if not new_tokens:
                continue
            num_generated += new_tokens
            last = self._last_token.get(delta.request_id)
            if last is None:
                num_prompt += prompt_lengths.get(delta.request_id, 0)
            else:
                latencies.append(now - last)
            self._last_token[delta.request_id] = now
        for delta in deltas:
            if delta.finished:
                self.finished(delta)
        queries, hits = self.prefix_stats.num_queries, self.prefix_stats.num_hits
        stats = StepStats(
            started=started, ended=now, request_ids=tuple(request_ids), num_batched_tokens=scheduled.num_batched_tokens,
            num_prompt_tokens=num_prompt, num_generated_tokens=num_generated, num_preempted=len(scheduled.preempted),
            num_running=num_running, num_waiting=num_waiting, kv_cache_usage=kv_cache_usage,
            prefix_cache_queries=queries - self._queries, prefix_cache_hits=hits - self._hits,
            inter_token_latencies=tuple(latencies),
        )
        self._queries, self._hits = queries, hits
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
