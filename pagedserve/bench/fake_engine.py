"""`ClockEngine`: an engine with no model, for measuring what the queue costs Redis. It holds
up to `max_num_seqs` requests and steps on a clock: every `step_ms` each request gets
`tokens_per_step` new tokens, until its `max_tokens`. A `WorkerService` runs it as it runs
the real `Engine` (the same loop, outbox, heartbeat and acks), so `bench redis-load` and
the hot-path tests see exactly the Redis traffic of a real worker with that many streams.

The tokens are a function of the request and the position (`expected_token`), so a reader
can check that what reached it is token-exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.outputs import CompletionDelta, RequestDelta
from pagedserve.common.sampling_params import SamplingParams


def expected_token(prompt_token_ids: list[int], position: int) -> int:
    """The token a ClockEngine makes at `position` of a request with this prompt."""
    return (prompt_token_ids[0] * 7919 + position) % 50_000


@dataclass(slots=True)
class _ClockRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    generated: int = 0  # tokens made so far


@dataclass(slots=True)
class ClockConfig:
    """The parts of EngineConfig a worker reads."""

    model: str = "clock"
    max_num_seqs: int = 256
    quantization: str | None = None  # the heartbeat announces it
    block_size: int = 16


@dataclass(slots=True)
class ClockKVManager:
    """The parts of the KV cache manager a worker's heartbeat announces (no cache here)."""

    num_free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 16
    model_id: str = ""
    kv_dtype: str = ""


@dataclass(slots=True)
class ClockScheduler:
    num_running: int = 0
    num_waiting: int = 0  # always 0: a request runs from the step after it was added


@dataclass(slots=True)
class ClockStats:
    keep_finished: bool = False


@dataclass
class ClockEngine:
    """Steps every `step_ms` (the first step at once), `tokens_per_step` tokens per request."""

    max_num_seqs: int = 256
    step_ms: float = 40.0
    tokens_per_step: int = 1
    max_model_len: int = 1 << 20
    config: ClockConfig = field(init=False)
    kv_manager: ClockKVManager = field(default_factory=ClockKVManager)
    scheduler: ClockScheduler = field(default_factory=ClockScheduler)
    stats: ClockStats = field(default_factory=ClockStats)
    kv_tier: None = None
    last_step: None = None
    num_steps: int = 0  # steps made that touched a request
    num_tokens: int = 0  # tokens made
    num_finished: int = 0  # requests that reached max_tokens
    _requests: dict[str, _ClockRequest] = field(default_factory=dict)
    _next_step: float = 0.0  # time.monotonic() of the next step

    def __post_init__(self) -> None:
        self.config = ClockConfig(max_num_seqs=self.max_num_seqs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, resume: Any = None, tenant: str | None = None) -> None:
        request = _ClockRequest(request_id, prompt_token_ids, params.max_tokens or 16)
        if resume is not None:  # taken over: go on after what the client has (one completion)
            request.generated = len(resume[0].token_ids)
        self._requests[request_id] = request
        self.scheduler.num_running = len(self._requests)

    def abort_request(self, request_id: str, finish_reason: str = "abort", record: bool = True) -> RequestDelta | None:
        request = self._requests.pop(request_id, None)
        self.scheduler.num_running = len(self._requests)
        return None if request is None else RequestDelta(request_id=request_id, deltas=[], finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestDelta]:
        """Wait for the clock, then make every request's next tokens."""
        now = time.monotonic()
        if now < self._next_step:
            time.sleep(self._next_step - now)
            now = self._next_step
        self._next_step = max(now, self._next_step) + self.step_ms / 1000
        outputs = []
        for request in list(self._requests.values()):
            start = request.generated
            n = min(self.tokens_per_step, request.max_tokens - start)
            request.generated += n
            done = request.generated >= request.max_tokens
            tokens = [expected_token(request.prompt_token_ids, start + i) for i in range(n)]
            delta = CompletionDelta(index=0, start=start, token_ids=tokens, text="x" * n,
                                    finish_reason="length" if done else None)
            outputs.append(RequestDelta(request_id=request.request_id, deltas=[delta], finished=done))
            self.num_tokens += n
            if done:
                self.num_finished += 1
                del self._requests[request.request_id]
        self.scheduler.num_running = len(self._requests)
        self.num_steps += bool(outputs)
        return outputs

    def pop_finished(self) -> list:
        return []

    def kv_cache_usage(self) -> float:
        return 0.0

    def close(self) -> None:
        """Nothing to free."""
