"""The routing contract: which worker a gateway sends a request to.

The gateway gathers, for each live worker, how much of the prompt it already holds in its
KV cache (from the prefix cache service's index, through a `PrefixLookup`) and its load
(from its heartbeat), and asks a router plugin to choose:

    PrefixLookup.cached_blocks(block hashes) -> {worker id: leading blocks held}
    RouterPlugin.route(RoutingInput, [WorkerCandidate]) -> RouteDecision

A router sees only these types. It never blocks, never does I/O and never fails a request:
when it has nothing to go on it answers the shared queue (`worker_id=None`), which every
worker reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pagedserve.common.contracts.version import API_VERSION


@dataclass(frozen=True, slots=True)
class WorkerCandidate:
    """One live worker, as a router weighs it."""

    worker_id: str
    cached_tokens: int  # leading prompt tokens the index says this worker holds (0: none or unknown)
    num_running: int  # requests its engine runs (not the waiting ones), as of its last heartbeat
    num_waiting: int  # requests its engine has taken but not started, as of its last heartbeat
    queued_tokens: int  # prompt tokens routed to this worker and not yet taken by any worker
    max_num_seqs: int  # how many requests its engine runs at once
    queued_requests: int = 0  # requests routed to this worker and not yet taken (as far as the gateway knows)


@dataclass(frozen=True, slots=True)
class RoutingInput:
    """The request being routed."""

    prompt_tokens: int  # its prompt length in tokens
    tenant: str | None  # whose request it is (None: no tenant)


#: why a request went where it went: `cache` (chosen for its cached prefix), `load` (chosen
#: for its load alone), `shared` (the shared queue: any worker takes it)
RouteReason = Literal["cache", "load", "shared"]


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker_id: str | None  # the worker whose stream gets the request; None: the shared queue
    reason: RouteReason


class RouterPlugin(ABC):
    """A routing policy, registered under the `pagedserve.routers` entry-point group and built
    as `factory(config)` with the gateway's `ServeConfig` (`ServeConfig` is importable from
    `pagedserve.common.contracts`)."""

    API_VERSION = API_VERSION

    @abstractmethod
    def route(self, request: RoutingInput, workers: Sequence[WorkerCandidate]) -> RouteDecision:
        """Choose among `workers` (live ones only; may be empty)."""


class PrefixLookup(Protocol):
    """The gateway's view of the cluster-wide index of cached blocks."""

    async def cached_blocks(self, block_hashes: Sequence[bytes]) -> Mapping[str, int]:
        """For each live worker holding the first block, how many leading blocks of
        `block_hashes` (a prompt's chained hashes, in order) it holds. Raises on failure; the
        caller then routes by load alone."""
        ...
