"""`WorkerTotals`: keeps this worker's `WorkerActivity` (common/worker_activity.py), the
running sums its heartbeat announces. `WorkerService._observe` feeds it once per pass."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import msgspec

from pagedserve.common.step_stats import FinishedRequestStats, StepStats
from pagedserve.common.worker_activity import RESTARTS_ENV, WorkerActivity


def restarts_from_env() -> int:
    """The restarts `serve` counted for this worker's place (0 when not started by `serve`)."""
    value = os.environ.get(RESTARTS_ENV, "0")
    return int(value) if value.isdigit() else 0


class WorkerTotals:
    def __init__(self, block_size: int):
        self.block_size = block_size  # lookups are counted in blocks; announced in tokens, like the metrics
        self.activity = WorkerActivity(started_at=time.time(), restarts=restarts_from_env())

    def observe(self, step: StepStats | None, finished: Iterable[FinishedRequestStats]) -> None:
        """Add one pass: its step (None: it ran none) and the requests that ended in it."""
        sums = self.activity
        if step is not None:
            sums.generated_tokens += step.num_generated_tokens
            sums.prompt_tokens += step.num_prompt_tokens
            sums.prefix_queries += step.prefix_cache_queries * self.block_size
            sums.prefix_hits += step.prefix_cache_hits * self.block_size
        for request in finished:
            sums.finished += 1
            if (ttft := request.time_to_first_token) is not None:
                sums.first_tokens += 1
                sums.ttft_seconds += ttft

    def snapshot(self) -> WorkerActivity:
        """A copy, for the heartbeat thread to encode while the loop adds to the sums."""
        return msgspec.structs.replace(self.activity)
