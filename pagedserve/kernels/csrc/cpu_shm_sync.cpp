// The two synchronisation primitives of the shared-memory all-reduce between tensor-parallel
// ranks on one host (engine/shm_all_reduce.py moves the data with torch ops around them).
//
// The region's header holds, per rank, two counters on their own cache lines:
//   counter 0 ("arrived"):  the last round whose data this rank has written into its slot
//   counter 1 ("departed"): the last round whose slots this rank has finished reading
// `shm_mark` stores a counter with release order, after the rank's copy into its slot (or its
// reads of the others'); `shm_wait` loads every rank's counter with acquire order until all
// reach a round, so the data written before a mark is visible after the wait.
//
// Both release the GIL: rank 0 waits while the worker's other threads (the queue consumer,
// the heartbeat) keep running.
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <ctime>
#include <sched.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDSERVE_PAUSE() _mm_pause()
#else
#define PAGEDSERVE_PAUSE() ((void)0)
#endif

namespace {

constexpr int64_t kCounterStride = 64;  // bytes: each counter on its own cache line
constexpr int64_t kRankStride = 2 * kCounterStride;

int64_t* counter(const torch::Tensor& region, int64_t rank, int64_t which) {
  auto* base = static_cast<uint8_t*>(region.data_ptr());
  return reinterpret_cast<int64_t*>(base + rank * kRankStride + which * kCounterStride);
}

void check_region(const torch::Tensor& region, int64_t ranks, int64_t which) {
  TORCH_CHECK(region.device().is_cpu() && region.scalar_type() == torch::kUInt8 && region.is_contiguous(),
              "the shared-memory region must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(which == 0 || which == 1, "counter must be 0 (arrived) or 1 (departed)");
  TORCH_CHECK(ranks > 0 && region.numel() >= ranks * kRankStride, "the region is smaller than its header");
}

}  // namespace

// Publish `round` as this rank's counter `which` (release: every write before it is seen first).
void shm_mark(torch::Tensor region, int64_t rank, int64_t which, int64_t round) {
  check_region(region, rank + 1, which);
  __atomic_store_n(counter(region, rank, which), round, __ATOMIC_RELEASE);
}

// Wait until counter `which` of every rank in [0, ranks) is at least `round`; true when they
// are, false after `wait_s` seconds (the caller checks its ranks' health and calls again).
// It spins with a pause for `spin_us` microseconds, then sleeps 20 µs at a time, so ranks
// that outnumber the cores do not starve the ones they wait for.
bool shm_wait(torch::Tensor region, int64_t ranks, int64_t which, int64_t round, double wait_s, double spin_us) {
  check_region(region, ranks, which);
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto spin_until = start + std::chrono::duration<double, std::micro>(spin_us);
  const auto give_up = start + std::chrono::duration<double>(wait_s);
  int64_t next = 0;  // the first rank not yet seen at `round`
  for (uint64_t i = 0;; ++i) {
    while (next < ranks && __atomic_load_n(counter(region, next, which), __ATOMIC_ACQUIRE) >= round) ++next;
    if (next == ranks) return true;
    if ((i & 63) != 63) {
      PAGEDSERVE_PAUSE();
      continue;
    }
    const auto now = clock::now();
    if (now >= give_up) return false;
    if (now >= spin_until) {
      const timespec nap{0, 20000};
      nanosleep(&nap, nullptr);
    } else {
      sched_yield();
    }
  }
}

void bind_cpu_shm_sync(pybind11::module& m) {
  m.def("shm_mark", &shm_mark, "store a rank's round counter (release)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("shm_wait", &shm_wait, "wait until every rank's counter reaches a round (acquire); false on timeout",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
