// Work items split across torch's intra-op threads in equal contiguous shares, as
// at::parallel_for splits them, where a thread that finishes its own share takes the unclaimed
// items at the back of the other shares, one at a time.
//
// Why: a static split waits for its slowest thread. On a shared cloud CPU one of two cores is
// often held up for a while (another tenant, an interrupt), and a few of a layer's tiles then
// decide the step; the decode batches also give threads unequal work (sequences of different
// context lengths). Taking from the back keeps each thread on its own share's order as long as
// it has items left, so the share's next item (which a kernel may prefetch) is usually its own.
//
// Which thread computes an item never changes what the item computes: the kernels that use
// this stay batch-invariant and give the same bits with any number of threads, balanced or not
// (`set_balanced_threads(false)`: the static split, for tests and benchmarks to compare).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace pagedserve_balanced {

// One share's unclaimed items [front, back), both in one word so that a claim at either end is
// one compare-and-swap (items < 2^32).
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};
};

inline uint64_t pack(uint64_t front, uint64_t back) { return (back << 32) | front; }

// Whether balanced_for takes from other shares (false: each thread runs its own share only).
inline std::atomic<bool> enabled{true};

// The share's next item from its front (its owner) or back (another thread); false when empty.
inline bool claim(Share& share, bool from_front, int64_t& item) {
  uint64_t cur = share.range.load(std::memory_order_relaxed);
  while (true) {
    const uint64_t front = cur & 0xffffffffu, back = cur >> 32;
    if (front >= back) return false;
    const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
    if (share.range.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
      item = static_cast<int64_t>(from_front ? front : back - 1);
      return true;
    }
  }
}

// Runs work(item, next) for every item of [0, n) exactly once, on up to torch's number of
// intra-op threads. next: the item the thread will likely run after this one (its share's next,
// which a kernel may prefetch), or -1 (the share's last, or an item taken from another share).
template <class Work>
void balanced_for(int64_t n, const Work& work) {
  if (n <= 0) return;
  const int64_t shares = std::min<int64_t>(n, std::max(1, at::get_num_threads()));
  if (shares == 1 || n >= (int64_t{1} << 32)) {
    for (int64_t i = 0; i < n; ++i) work(i, i + 1 < n ? i + 1 : int64_t{-1});
    return;
  }
  // the shares on the stack for the usual thread counts: no allocation a call on the decode path
  constexpr int64_t kLocalShares = 16;
  Share local[kLocalShares];
  std::unique_ptr<Share[]> heap(shares > kLocalShares ? new Share[shares] : nullptr);
  Share* share = heap ? heap.get() : local;
  const int64_t per = (n + shares - 1) / shares;
  auto share_end = [&](int64_t s) { return std::min(n, (s + 1) * per); };
  for (int64_t s = 0; s < shares; ++s)
    share[s].range.store(pack(static_cast<uint64_t>(std::min(n, s * per)), static_cast<uint64_t>(share_end(s))),
                         std::memory_order_relaxed);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t own = begin; own < end; ++own) {
      int64_t item;
      const int64_t own_end = share_end(own);
      while (claim(share[own], true, item)) work(item, item + 1 < own_end ? item + 1 : int64_t{-1});
      if (!enabled.load(std::memory_order_relaxed)) continue;
      for (int64_t k = 1; k < shares; ++k) {  // then the others' backs, nearest share first
        const int64_t other = (own + k) % shares;
        while (claim(share[other], false, item)) work(item, int64_t{-1});
      }
    }
  });
}

// The loops of the packed products (cpu_packed_gemm.cpp, cpu_packed_int8.cpp): run_tile(t, r0,
// r1, next_t) for every tile t of weight panels and every block of rows [r0, r1) of `block_rows`.
// Rows of one block (a decode batch): the tiles balanced (balanced_for). More (prefill): each
// thread its equal share of the tiles, block by block of rows, so a tile's panels are read once
// per block; next_t is then the share's next tile (-1 at its last).
template <class RunTile>
void for_tiles(int64_t tiles, int64_t m, int64_t block_rows, const RunTile& run_tile) {
  if (m <= block_rows) {
    balanced_for(tiles, [&](int64_t t, int64_t next_t) { run_tile(t, int64_t{0}, m, next_t); });
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += block_rows)
      for (int64_t t = begin; t < end; ++t) run_tile(t, r0, std::min(m, r0 + block_rows), t + 1 < end ? t + 1 : -1);
  });
}

}  // namespace pagedserve_balanced
