"""`WorkerActivity`: what a worker has done since it started, as running sums that its
heartbeat carries (`WorkerInfo.activity`). The gateway's cluster view turns two heartbeats
into rates (tokens per second, prefix-cache hit rate, mean time to first token) without
scraping each worker's metrics port. Sums only ever grow within one worker process."""

from __future__ import annotations

import msgspec

#: the environment variable through which `pagedserve serve` tells a worker how many times
#: its place was restarted before it (absent: 0)
RESTARTS_ENV = "PAGEDSERVE_WORKER_RESTARTS"


class WorkerActivity(msgspec.Struct, kw_only=True):
    """Running sums since the worker process started (all 0 from a worker that predates them)."""

    started_at: float = 0.0  # wall-clock time (time.time()) the process started; 0: not announced
    restarts: int = 0  # earlier processes of this worker's place that `pagedserve serve` restarted
    generated_tokens: int = 0  # tokens sampled
    prompt_tokens: int = 0  # prompt tokens of the requests whose first token came
    prefix_queries: int = 0  # prefix-cache lookups, in tokens (full blocks × block size)
    prefix_hits: int = 0  # of those, tokens found cached
    first_tokens: int = 0  # requests that got their first token here
    ttft_seconds: float = 0.0  # the sum of those requests' times to first token
    finished: int = 0  # requests that ended here, whatever the reason
