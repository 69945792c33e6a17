"""`WorkerTotals`: the running sums a worker's heartbeat announces (WorkerInfo.activity),
exact after a few passes, and the restart count `serve` hands a restarted worker."""

from __future__ import annotations

from pagedserve.common.queue_protocol import WorkerInfo, decode_worker_info, encode
from pagedserve.common.step_stats import FinishedRequestStats, StepStats
from pagedserve.common.worker_activity import RESTARTS_ENV
from pagedserve.worker.totals import WorkerTotals, restarts_from_env


def _step(generated: int, prompt: int, queries: int, hits: int) -> StepStats:
    return StepStats(started=0.0, ended=0.1, request_ids=("r",), num_batched_tokens=generated + prompt,
                     num_prompt_tokens=prompt, num_generated_tokens=generated, num_preempted=0, num_running=1,
                     num_waiting=0, kv_cache_usage=0.5, prefix_cache_queries=queries, prefix_cache_hits=hits,
                     inter_token_latencies=())


def _finished(first_token_time: float | None) -> FinishedRequestStats:
    return FinishedRequestStats(request_id="r", finish_reasons=("stop",), num_prompt_tokens=3, num_output_tokens=2,
                                num_cached_tokens=0, num_preemptions=0, arrival_time=10.0,
                                first_token_time=first_token_time, finished_time=12.0)


def test_sums_are_exact_and_travel_in_the_heartbeat(monkeypatch):
    monkeypatch.setenv(RESTARTS_ENV, "3")
    totals = WorkerTotals(block_size=16)
    totals.observe(_step(generated=4, prompt=20, queries=2, hits=1), [])
    totals.observe(None, [_finished(10.25), _finished(None)])  # a pass without a step; one never got a token
    totals.observe(_step(generated=6, prompt=0, queries=3, hits=3), [_finished(10.5)])
    sums = totals.snapshot()
    assert (sums.generated_tokens, sums.prompt_tokens, sums.prefix_queries, sums.prefix_hits) == (10, 20, 80, 64)
    assert (sums.finished, sums.first_tokens, sums.ttft_seconds, sums.restarts) == (3, 2, 0.75, 3)
    assert sums.started_at > 0
    info = WorkerInfo(worker_id="w", model="m", max_model_len=8, pid=1, host="h", max_num_seqs=2, activity=sums)
    assert decode_worker_info(encode(info)).activity == sums
    totals.observe(_step(generated=1, prompt=0, queries=0, hits=0), [])
    assert sums.generated_tokens == 10  # a snapshot does not move with the sums


def test_restarts_default_to_zero(monkeypatch):
    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    assert restarts_from_env() == 0
    monkeypatch.setenv(RESTARTS_ENV, "not a number")
    assert restarts_from_env() == 0
