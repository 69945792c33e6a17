"""The built-in `fcfs` scheduler: token budget, chunked prefill, preemption by recompute.

Each step first serves running requests (decodes and unfinished prefill chunks), oldest
admission first, then admits waiting requests in arrival order while budget, sequence slots
and blocks last. When blocks run out, a running request is preempted: its blocks are freed
and it goes back to the front of the waiting queue, to be recomputed (mostly from the prefix
cache). The victim is the request that costs least to redo (fewest computed tokens); the
oldest running request is never chosen, so it always progresses and nothing starves.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

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


class FCFSScheduler(SchedulerPlugin):
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager):
        self.max_num_batched_tokens = config.token_budget()  # the engine has set it for its device
        self.max_num_seqs = config.max_num_seqs
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, int] = {}  # request → tokens this step, in order
        preempted: list[Request] = []

        drafts: dict[Request, list[int]] = {}  # speculative decoding: drafts verified this step
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            if not request.grammar_ready:  # its grammar compiles: everything but the chunk that samples
                num_new = min(num_new, request.num_tokens - request.num_computed_tokens - 1)
                if num_new == 0:
                    continue
            # A decoding request's drafts ride along as lookahead tokens, within the budget.
            spec = request.spec_token_ids[: budget - 1] if num_new == 1 else []
            while not self.kv.allocate_slots(request, num_new + len(spec)):
                if spec:
                    spec = []  # no blocks for the lookahead: decode one token, preempt nobody
                    continue
                victim = self._pick_victim(request)
                budget += scheduled.pop(victim, 0)
                drafts.pop(victim, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request] = num_new + len(spec)
                budget -= num_new + len(spec)
                if spec:
                    drafts[request] = spec

        # Admit waiting requests only when nothing was preempted: blocks are short.
        if self.waiting and not preempted:
            admitted = []
            # Prompt blocks some request computes this step: a waiting request whose next
            # block is among them waits one step and then takes it from the prefix cache,
            # instead of computing the same prefix again beside it.
            in_flight = self._blocks_in_flight(scheduled)
            for request in self.waiting:
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                parent = request.fork_from
                if parent is not None and not self._fork_ready(request, parent):
                    continue  # a later sibling waits for its parent's prompt
                hit = self.kv.get_computed_blocks(request)
                hashes = self.kv.block_hashes(request)
                if hit.num_blocks < len(hashes) and hashes[hit.num_blocks] in in_flight:
                    continue
                num_new = request.num_tokens - hit.num_tokens
                if not request.grammar_ready:  # its grammar compiles: not the chunk that samples
                    num_new -= 1
                    if num_new <= 0:
                        continue
                if num_new > budget:
                    if not self.enable_chunked_prefill:
                        break
                    num_new = budget
                if not self.kv.allocate_slots(request, num_new, hit):
                    break  # first come, first served: nobody jumps a request short of blocks
                request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
                request.fork_from = None
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                admitted.append(request)
                scheduled[request] = num_new
                budget -= num_new
                in_flight.update(hashes[hit.num_blocks : (hit.num_tokens + num_new) // self.kv.block_size])
            for request in admitted:
                self.waiting.remove(request)

        out = [ScheduledRequest(r, n, self.kv.block_ids(r), drafts.get(r, [])) for r, n in scheduled.items()]
        return SchedulerOutput(out, self.max_num_batched_tokens - budget, preempted)

    def _blocks_in_flight(self, scheduled: dict[Request, int]) -> set[bytes]:
        """Hashes of the full prompt blocks the running requests compute this step."""
        if not self.kv.enable_caching:
            return set()
        bs = self.kv.block_size
        in_flight: set[bytes] = set()
        for request, num_new in scheduled.items():
            start = request.num_computed_tokens // bs
            in_flight.update(self.kv.block_hashes(request)[start : (request.num_computed_tokens + num_new) // bs])
        return in_flight

    def _fork_ready(self, request: Request, parent: Request) -> bool:
        """Whether a sibling may start: its parent computed the prompt blocks it will share."""
        if parent.status == RequestStatus.RUNNING:
            return parent.num_computed_tokens >= request.num_prompt_tokens - 1
        if parent.status == RequestStatus.WAITING:
            return False
        request.fork_from = None  # parent preempted or finished: compute on our own
        return True

    def _pick_victim(self, requester: Request) -> Request:
        """The running request cheapest to recompute, never the oldest."""
        oldest = min(self.running, key=lambda r: r.arrival_time)
        candidates = [r for r in self.running if r is not oldest]
        assert candidates, "the oldest request alone does not fit the KV pool (max_model_len is capped to fit)"
        return min(candidates, key=lambda r: (r.num_computed_tokens, -r.arrival_time))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED  # first: the KV manager keeps its hashes
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[SequenceUpdate]:
        """Count the computed tokens, append the new tokens, and end finished sequences."""
        updates = []
        for i, entry in enumerate(scheduler_output.scheduled):
            request = entry.request
            if request.status != RequestStatus.RUNNING:
                continue
            tokens = runner_output.sampled_token_ids[i]
            # rejected drafts had their K/V computed, but it is not the sequence's: not counted
            request.num_computed_tokens += entry.num_new_tokens - runner_output.num_rejected(i, len(entry.spec_token_ids))
            logprobs = runner_output.logprobs[i] if runner_output.logprobs is not None else None
            status = None
            for j, token in enumerate(tokens):
                request.token_ids.append(token)
                status = request.stop_status(token)
                updates.append(SequenceUpdate(request, token, logprobs[j] if logprobs else None, status is not None))
                if status is not None:
                    break  # the tokens after a stop are dropped
            if tokens and request.first_token_time is None:
                request.first_token_time = time.monotonic()
            # only tokens before the last one appended have K/V (fewer when a stop cut the list)
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - (1 if tokens else 0))
            self.kv.cache_full_blocks(request)
            if status is not None:
                self._finish(request, status)
        return updates

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> list[Request]:
        """End requests now (abort, stop string); unknown or finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished, f"{status!r} is not a final status"
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
