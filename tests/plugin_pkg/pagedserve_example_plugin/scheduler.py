"""A scheduler that admits the waiting sequence with the shortest prompt first.

Whole prompts in one step (no chunking) and no preemption: a running sequence that finds no
free block skips the step and waits for blocks to come back. Enough for a demonstration;
the built-in `fcfs` scheduler shows chunked prefill and preemption.
"""

from __future__ import annotations

import time

from pagedserve.common.contracts import (
    EngineConfig,
    KVCacheManager,
    Request,
    RequestStatus,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerPlugin,
    SequenceUpdate,
)


class ShortestPromptFirstScheduler(SchedulerPlugin):
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager):
        self.budget = config.token_budget()  # the engine has resolved it for its device
        self.max_num_seqs = config.max_num_seqs
        self.kv = kv_cache_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        scheduled = []
        for request in self.running:  # every running sequence decodes one token
            if budget and self.kv.allocate_slots(request, 1):
                scheduled.append(ScheduledRequest(request, 1, self.kv.block_ids(request)))
                budget -= 1
        for request in sorted(self.waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_time)):
            if len(self.running) >= self.max_num_seqs:
                break
            hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - hit.num_tokens
            if num_new > budget or not self.kv.allocate_slots(request, num_new, hit):
                continue
            request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, self.kv.block_ids(request)))
            budget -= num_new
        return SchedulerOutput(scheduled, self.budget - budget)

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[SequenceUpdate]:
        updates = []
        for i, entry in enumerate(scheduler_output.scheduled):
            request = entry.request
            if request.status != RequestStatus.RUNNING:
                continue
            # it never schedules drafts (spec_token_ids): at most one new token per entry
            request.num_computed_tokens += entry.num_new_tokens
            self.kv.cache_full_blocks(request)
            tokens = runner_output.sampled_token_ids[i]
            if not tokens:
                continue
            token = tokens[0]
            request.token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            status = request.stop_status(token)
            if status is not None:
                self._finish(request, status)
            logprobs = runner_output.logprobs[i] if runner_output.logprobs is not None else None
            updates.append(SequenceUpdate(request, token, logprobs[0] if logprobs else None, status is not None))
        return updates

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        ids = set(request_ids)
        found = [r for r in self.waiting + self.running if r.request_id in ids]
        for request in found:
            self._finish(request, status)
        return found

    def _finish(self, request: Request, status: RequestStatus) -> None:
        (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
        request.status = status
        self.kv.free(request)
