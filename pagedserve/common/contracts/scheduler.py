"""The scheduler's contract: what it decides each step, and the KV cache it decides with.

A scheduler plugin is built by `factory(config: EngineConfig, kv_cache_manager: KVCacheManager)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve.common.contracts.request import Request, RequestStatus
from pagedserve.common.contracts.version import API_VERSION

if TYPE_CHECKING:
    from pagedserve.common.contracts.runner import RunnerOutput, SequenceUpdate


@dataclass(slots=True)
class ScheduledRequest:
    """One sequence's share of a step."""

    request: Request
    num_new_tokens: int  # tokens computed for it this step (1 for a decode; 1 + drafts when verifying)
    block_ids: list[int]  # its block table, in position order (the KV manager's list: read only)
    #: draft tokens verified this step (speculative decoding): the last len() of the
    #: num_new_tokens, computed after the request's own token_ids; [] otherwise
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: handed to the model runner, then back to `update`."""

    scheduled: list[ScheduledRequest]  # in scheduling order
    num_batched_tokens: int  # sum of num_new_tokens
    preempted: list[Request] = field(default_factory=list)  # preempted during this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """Cached KV blocks a new sequence can start from (found by `get_computed_blocks`)."""

    num_blocks: int  # full blocks found, from the start of the prompt
    num_tokens: int  # the tokens they hold: num_blocks * block_size
    blocks: Sequence[Any] = ()  # the KV manager's own block handles: pass back, never read


class KVCacheManager(Protocol):
    """The paged KV cache as a scheduler sees it. Blocks are kept per `request_id`; the
    manager reads a request's tokens and progress and never writes to the request."""

    block_size: int  # tokens per block
    enable_caching: bool  # whether full blocks are shared by hash across requests

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take now (free, or cached and unreferenced)."""
        ...

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of a new (or preempted) request, at least one prompt
        token short of the whole prompt, so the step that completes it yields logits."""
        ...

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Take `hit`'s blocks (admission) and enough fresh blocks for `num_new_tokens`
        more tokens after `request.num_computed_tokens` (+ the hit's tokens). False, and no
        change, when too few blocks are free."""
        ...

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that `request.num_computed_tokens` has filled, for reuse."""
        ...

    def free(self, request: Request) -> None:
        """Give the request's blocks back (cached ones stay findable until evicted). Set the
        status first: a PREEMPTED sequence keeps its block hashes for its return, any other
        sequence is forgotten."""
        ...

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (the manager's live list: do not modify)."""
        ...

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks known so far, prompt and output (for de-duplication)."""
        ...


class SchedulerPlugin(ABC):
    """Decides, each engine step, which sequences compute how many tokens."""

    API_VERSION = API_VERSION

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new sequence."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose this step's sequences and token counts, within the budget and the blocks."""

    @abstractmethod
    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[SequenceUpdate]:
        """Apply a step's results: count computed tokens (less the rejected drafts,
        `RunnerOutput.num_rejected`), append the new tokens in order, and end a sequence at
        the first token that stops it (EOS, stop token, length), dropping the rest. One
        update per token appended."""

    @abstractmethod
    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> list[Request]:
        """End these sequences now (abort, stop string) and free their blocks; unknown ids
        are ignored. Returns the sequences it ended."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any sequence is waiting or running."""

    @property
    def num_waiting(self) -> int:
        """Sequences not yet admitted; a worker takes no new requests while any wait."""
        return 0

    @property
    def num_running(self) -> int:
        """Sequences admitted and not finished (the worker's `num_requests_running` metric).
        A plugin that does not say reports 0."""
        return 0
