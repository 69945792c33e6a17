"""`PrefixIndex`: which workers hold which cached blocks, built from their event batches.

It maps each block hash to the workers whose hash map holds it, and answers, for a
prompt's chained block hashes, how many leading blocks each worker holds. It never trusts
what it cannot vouch for. For each worker it keeps the epoch and the last sequence number
it applied:

- the next batch of the same epoch (seq = last + 1) is applied;
- a batch it has already seen (seq <= last) is ignored;
- a gap (seq > last + 1: a batch was lost) or a new epoch (the worker restarted)
  drops every entry of that worker, and nothing of it is applied until a snapshot comes
  (`apply` answers `NEEDS_SNAPSHOT` so the caller can ask the worker for one); the first
  batch of an epoch (seq 0) needs none, since a new pool starts empty;
- `remove_worker` (its heartbeat stopped) drops its entries.

Pure Python, no I/O: the service around it does the reading and the asking.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedserve.prefix_cache.events import BlockRemoved, BlockStored, KVEventBatch


class Applied(enum.Enum):
    APPLIED = "applied"
    IGNORED = "ignored"  # already seen, or the worker is waiting for a snapshot
    NEEDS_SNAPSHOT = "needs_snapshot"  # the worker's entries were dropped: ask it for a snapshot


@dataclass(slots=True)
class _Worker:
    epoch: str
    seq: int  # the last sequence number applied
    synced: bool  # False: entries dropped, waiting for a snapshot
    hashes: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class IndexStats:
    """Counters since start."""

    batches_applied: int = 0
    batches_ignored: int = 0  # duplicates, out of order, or while waiting for a snapshot
    gaps: int = 0  # a lost batch or a new epoch made a worker's entries untrustworthy
    snapshots: int = 0
    workers_removed: int = 0
    last_lag: float = 0.0  # seconds between the latest applied batch's sending and its applying


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}  # block hash → workers holding it
        self._workers: dict[str, _Worker] = {}
        self.stats = IndexStats()

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes indexed."""
        return len(self._holders)

    def workers(self) -> dict[str, int]:
        """Every known worker and how many blocks it holds (0 while waiting for a snapshot)."""
        return {w: len(state.hashes) for w, state in self._workers.items()}

    def needs_snapshot(self) -> list[str]:
        """Workers whose entries were dropped and who have not sent a snapshot since."""
        return [w for w, state in self._workers.items() if not state.synced]

    def apply(self, batch: KVEventBatch, now: float | None = None) -> Applied:
        state = self._workers.get(batch.worker_id)
        if state is None or state.epoch != batch.epoch:  # a new worker, or a restarted one
            self._drop(batch.worker_id)
            if not (batch.snapshot or batch.seq == 0):
                self._workers[batch.worker_id] = _Worker(batch.epoch, batch.seq, synced=False)
                self.stats.gaps += state is not None
                return Applied.NEEDS_SNAPSHOT
            state = self._workers[batch.worker_id] = _Worker(batch.epoch, batch.seq - 1, synced=True)
        if batch.snapshot:
            if state.synced and batch.seq <= state.seq:
                return self._ignored()
            self._drop(batch.worker_id)
            state = self._workers[batch.worker_id] = _Worker(batch.epoch, batch.seq, synced=True)
            self.stats.snapshots += 1
            self._store(batch.worker_id, state, batch)
            return self._applied(batch, now)
        if not state.synced or batch.seq <= state.seq:
            return self._ignored()
        if batch.seq > state.seq + 1:  # a batch went missing: nothing of this worker can be trusted
            self._drop(batch.worker_id)
            self._workers[batch.worker_id] = _Worker(batch.epoch, batch.seq, synced=False)
            self.stats.gaps += 1
            return Applied.NEEDS_SNAPSHOT
        state.seq = batch.seq
        self._store(batch.worker_id, state, batch)
        return self._applied(batch, now)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (declared dead): its blocks are no longer anywhere."""
        if worker_id in self._workers:
            self._drop(worker_id)
            self.stats.workers_removed += 1

    def lookup(self, block_hashes: Sequence[bytes]) -> Mapping[str, int]:
        """For each worker holding the first block, how many leading blocks of the chain it holds."""
        if not block_hashes:
            return {}
        holders_of = self._holders.get
        matching = set(holders_of(block_hashes[0], ()))
        counts: dict[str, int] = {}
        none: frozenset[str] = frozenset()
        for i in range(1, len(block_hashes)):
            if not matching:
                break
            holders = holders_of(block_hashes[i], none)
            if matching <= holders:  # the common case: every worker still matching holds it too
                continue
            for worker in matching - holders:
                counts[worker] = i
            matching &= holders
        for worker in matching:
            counts[worker] = len(block_hashes)
        return counts

    def _store(self, worker_id: str, state: _Worker, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.block_hash not in state.hashes:
                    state.hashes.add(event.block_hash)
                    self._holders.setdefault(event.block_hash, set()).add(worker_id)
            elif isinstance(event, BlockRemoved) and event.block_hash in state.hashes:
                state.hashes.discard(event.block_hash)
                holders = self._holders[event.block_hash]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[event.block_hash]

    def _drop(self, worker_id: str) -> None:
        state = self._workers.pop(worker_id, None)
        if state is None:
            return
        for block_hash in state.hashes:
            holders = self._holders[block_hash]
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]

    def _applied(self, batch: KVEventBatch, now: float | None) -> Applied:
        self.stats.batches_applied += 1
        if now is not None:
            self.stats.last_lag = max(now - batch.sent_at, 0.0)
        return Applied.APPLIED

    def _ignored(self) -> Applied:
        self.stats.batches_ignored += 1
        return Applied.IGNORED
