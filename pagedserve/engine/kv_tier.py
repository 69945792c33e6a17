"""`KVTier`: the engine's side of the shared KV tier (prefix_cache/kv_tier_store.py is the store).

Two flows, both kept off the step's critical path except for one memory copy each:

- **Save.** The pool lists the cached blocks `allocate` evicted (`BlockPool.take_evicted`).
  Before the step that overwrites them runs, `save_evicted` copies their K/V out of the
  cache tensors into one host tensor (the only work on the step's path) and hands it to a
  writer thread, which encodes the blocks and puts them into the store. When more bytes
  wait for the writer than `max_pending_bytes`, the newest evictions are dropped (counted).
- **Load.** A new request is held back (`hold`) while a reader thread asks the store for
  the blocks after the ones the pool holds, and decodes them into a host tensor. Before each
  step `ready` takes the finished lookups: it registers the loaded blocks in the pool as
  cached blocks (`KVCacheManager.insert_cached_blocks`), copies their K/V in, and hands the
  requests to the scheduler, which then finds them as ordinary prefix hits. A lookup that
  fails or outlives `timeout` releases its request to compute everything itself.

A loaded block is used only if its layout and hash match (the store checks) and its tokens
are the request's own (`insert_cached_blocks` checks), as for a local hit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pagedserve.common.contracts import Request, RequestStatus
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.prefix_cache.block_pool import EvictedBlock
from pagedserve.prefix_cache.kv_tier_store import KVLayout, KVTierStore, TierBlock

logger = logging.getLogger(__name__)

#: hashes this worker put into the tier recently, not sent again when evicted again
_RECENTLY_SAVED = 65_536


@dataclass(slots=True)
class TierCounters:
    """What the engine's tier did since start (the store's own counters are `store.stats`)."""

    blocks_saved: int = 0  # evicted blocks handed to the writer
    blocks_skipped: int = 0  # evicted blocks not sent: this worker put them into (or loaded them from) the tier recently
    blocks_dropped: int = 0  # evicted blocks not sent: the writer was too far behind
    blocks_loaded: int = 0  # blocks copied into the pool from the tier
    lookups: int = 0  # requests whose prompt was looked up in the tier
    lookups_timed_out: int = 0  # lookups that outlived the timeout (their requests computed everything)
    save_copy_seconds: float = 0.0  # time on the step's path copying evicted blocks out
    load_copy_seconds: float = 0.0  # time on the step's path copying loaded blocks in


@dataclass(slots=True)
class _Held:
    """A new request (with its n > 1 siblings) waiting for its tier lookup."""

    sequences: list[Request]
    first: int  # the first block the lookup asked for (the pool held the ones before)
    future: Future
    deadline: float


@dataclass(slots=True)
class _Loaded:
    """What a lookup found: its blocks' tokens and K/V, [layers, 2, n, block_size, heads, dim]."""

    token_ids: list[tuple[int, ...]] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    kv: torch.Tensor | None = None


class KVTier:
    def __init__(self, store: KVTierStore, kv_manager: KVCacheManager, kv_caches: list[torch.Tensor],
                 timeout: float = 2.0, max_pending_bytes: int = 256 << 20):
        self.store = store
        self.layout: KVLayout = store.layout
        self.kv_manager = kv_manager
        self.kv_caches = kv_caches
        self.timeout = timeout
        self.max_pending_bytes = max_pending_bytes
        self.counters = TierCounters()
        self._held: OrderedDict[str, _Held] = OrderedDict()  # by the first sequence's request id
        self._recently_saved: OrderedDict[bytes, None] = OrderedDict()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-put")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-get")
        kv_manager.pool.record_evictions = True

    # -- save --------------------------------------------------------------------------------
    def save_evicted(self) -> None:
        """Copy the blocks evicted since the last call out of the cache, for the writer."""
        evicted = self.kv_manager.pool.take_evicted()
        if not evicted:
            return
        fresh: list[EvictedBlock] = []
        for block in evicted:
            if block.block_hash in self._recently_saved:
                self._recently_saved.move_to_end(block.block_hash)
                self.counters.blocks_skipped += 1
            else:
                fresh.append(block)
        size = len(fresh) * self.layout.block_bytes
        with self._lock:
            room = self._pending_bytes + size <= self.max_pending_bytes
            if room:
                self._pending_bytes += size
        if not room:
            self.counters.blocks_dropped += len(fresh)
            return
        if not fresh:
            return
        started = time.perf_counter()
        kv = self._gather([b.block_id for b in fresh])
        self.counters.save_copy_seconds += time.perf_counter() - started
        self.counters.blocks_saved += len(fresh)
        for block in fresh:
            self._recently_saved[block.block_hash] = None
        while len(self._recently_saved) > _RECENTLY_SAVED:
            self._recently_saved.popitem(last=False)
        self._writer.submit(self._put, fresh, kv, size)

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of these blocks on the host, [layers, 2, n, block_size, heads, dim]: one
        copy per layer, nothing reordered (the writer thread does that)."""
        first = self.kv_caches[0]
        index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
        out = torch.empty((len(self.kv_caches), 2, len(block_ids), *first.shape[2:]), dtype=first.dtype,
                          device=first.device)
        for layer, cache in enumerate(self.kv_caches):
            torch.index_select(cache, 1, index, out=out[layer])
        return out.cpu()

    def _put(self, blocks: list[EvictedBlock], kv: torch.Tensor, size: int) -> None:
        try:
            per_block = kv.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, layers, 2, ...]: a block's bytes in one run
            raw = per_block.view(torch.uint8).reshape(len(blocks), -1).numpy()
            key = self.layout.key()
            self.store.put([TierBlock(key, b.block_hash, b.token_ids, raw[i].tobytes())
                            for i, b in enumerate(blocks)])
        except Exception:  # the writer must go on whatever one batch does
            logger.exception("KV tier: saving %d block(s) failed", len(blocks))
        finally:
            with self._lock:
                self._pending_bytes -= size

    # -- load --------------------------------------------------------------------------------
    def hold(self, sequences: list[Request]) -> bool:
        """Start a tier lookup for a new request's prompt and keep its sequences until it is
        done; False (nothing held) when the pool already holds every block it could use."""
        first_seq = sequences[0]
        hashes, num_local = self.kv_manager.local_prefix_blocks(first_seq)
        wanted = hashes[num_local:]
        if not wanted:
            return False
        self.counters.lookups += 1
        future = self._reader.submit(self._load, wanted)
        self._held[first_seq.request_id] = _Held(sequences, num_local, future, time.monotonic() + self.timeout)
        return True

    def _load(self, block_hashes: list[bytes]) -> _Loaded:
        found = self.store.get_leading(block_hashes)
        loaded = _Loaded([b.token_ids for b in found], [b.block_hash for b in found])
        if found:
            layout = self.layout
            per_block = torch.empty((len(found), layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                                     layout.row_width), dtype=self.kv_caches[0].dtype)
            raw = per_block.view(torch.uint8).reshape(len(found), -1).numpy()
            for i, block in enumerate(found):
                raw[i] = memoryview(block.data)
            loaded.kv = per_block.permute(1, 2, 0, 3, 4, 5).contiguous()  # [layers, 2, n, ...], as the cache is laid out
        return loaded

    @property
    def num_held(self) -> int:
        return len(self._held)

    def drop(self, request_ids: set[str]) -> None:
        """Forget held requests (aborted before their lookup ended)."""
        for request_id in request_ids:
            held = self._held.pop(request_id, None)
            if held is not None:
                for sequence in held.sequences:  # the manager forgets the hashes `hold` computed
                    sequence.status = RequestStatus.FINISHED_ABORTED
                    self.kv_manager.free(sequence)

    def wait(self, seconds: float) -> None:
        """Block until the oldest lookup is done, at most `seconds` (an idle engine's pause)."""
        if self._held:
            oldest = next(iter(self._held.values()))
            with contextlib.suppress(TimeoutError):
                oldest.future.exception(timeout=seconds)

    def ready(self, admit: Callable[[Request], None]) -> None:
        """Load what the finished lookups found into the pool and `admit` their sequences,
        in arrival order; a lookup past its deadline admits its request without blocks."""
        now = time.monotonic()
        for request_id in list(self._held):
            held = self._held[request_id]
            if not held.future.done():
                if now < held.deadline:
                    continue
                self.counters.lookups_timed_out += 1
            else:
                try:
                    self._insert(held, held.future.result())
                except Exception:  # a bad block or a failed lookup: compute instead
                    logger.exception("KV tier: loading blocks for %s failed; it computes them", request_id)
            del self._held[request_id]
            for sequence in held.sequences:
                admit(sequence)

    def _insert(self, held: _Held, loaded: _Loaded) -> None:
        if loaded.kv is None:
            return
        taken = self.kv_manager.insert_cached_blocks(held.sequences[0], held.first, loaded.token_ids)
        self.save_evicted()  # what the insertion evicted leaves before it is overwritten
        if not taken:
            return
        started = time.perf_counter()
        device = self.kv_caches[0].device
        kv = loaded.kv
        if len(taken) < kv.shape[2]:  # some were in the pool already, or it ran out of free blocks
            kv = kv.index_select(2, torch.tensor([i for i, _ in taken], dtype=torch.long))
        kv = kv.to(device)
        index = torch.tensor([block_id for _, block_id in taken], dtype=torch.long, device=device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, index, kv[layer])
        self.counters.load_copy_seconds += time.perf_counter() - started
        self.counters.blocks_loaded += len(taken)
        for i, _ in taken:  # the tier has them: an eviction need not send them back
            self._recently_saved[loaded.hashes[i]] = None

    def totals(self) -> dict[str, int]:
        """Running totals for the worker's metrics (`WorkerMetrics.observe_kv_tier`)."""
        c, store = self.counters, self.store.stats
        return {"blocks_saved": c.blocks_saved, "blocks_loaded": c.blocks_loaded, "blocks_dropped": c.blocks_dropped,
                "blocks_skipped": c.blocks_skipped, "blocks_stored": store.blocks_put, "bytes_out": store.bytes_put,
                "bytes_in": store.bytes_got, "errors": store.errors}

    def close(self) -> None:
        """Finish the pending puts, then stop the threads."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
