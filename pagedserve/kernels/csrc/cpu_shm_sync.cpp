// The synchronisation of the shared-memory all-reduce between tensor-parallel ranks on one
// host (engine/shm_all_reduce.py moves the data with torch ops around these two calls).
//
// The region's header holds one cache line per rank:
//   [0] the last round whose data this rank has written into its slot ("arrived")
//   [1], [2] the tag (element count and dtype) of the tensor it wrote, for slot set 0 and 1
// `shm_arrive` stores the tag, then the round with release order, after the rank's copy into
// its slot; `shm_wait` loads every rank's round with acquire order until all reach a round,
// so the data written before an arrival is visible after the wait, and checks that every
// rank wrote a tensor of the same tag (a rank that all-reduced something else is an error,
// not a wrong sum).
//
// The wait releases the GIL: rank 0 waits while the worker's other threads keep running.
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <ctime>
#include <sched.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDSERVE_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PAGEDSERVE_PAUSE() __asm__ __volatile__("yield")
#else
#define PAGEDSERVE_PAUSE() ((void)0)
#endif

namespace {

constexpr int64_t kLineBytes = 64;  // one rank's line: its round and two tags

int64_t* rank_line(const torch::Tensor& region, int64_t rank) {
  return reinterpret_cast<int64_t*>(static_cast<uint8_t*>(region.data_ptr()) + rank * kLineBytes);
}

void check_region(const torch::Tensor& region, int64_t ranks) {
  TORCH_CHECK(region.device().is_cpu() && region.scalar_type() == torch::kUInt8 && region.is_contiguous(),
              "the shared-memory region must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(ranks > 0 && region.numel() >= ranks * kLineBytes, "the region is smaller than its header");
}

}  // namespace

// This rank wrote a tensor tagged `tag` into its slot of round `round`'s set: publish it
// (release: the copy is seen before the round).
void shm_arrive(torch::Tensor region, int64_t rank, int64_t round, int64_t tag) {
  check_region(region, rank + 1);
  int64_t* line = rank_line(region, rank);
  __atomic_store_n(line + 1 + (round & 1), tag, __ATOMIC_RELAXED);
  __atomic_store_n(line, round, __ATOMIC_RELEASE);
}

// Wait until every rank in [0, ranks) has arrived at `round`. Returns 1 when they have, 0
// after `wait_s` seconds (the caller checks its ranks' health and calls again), and -1 - r
// when rank r wrote a tensor with another tag. It spins with a pause for `spin_us`
// microseconds, then sleeps 20 µs at a time, so ranks that outnumber the cores do not starve
// the ones they wait for.
int64_t shm_wait(torch::Tensor region, int64_t ranks, int64_t round, int64_t tag, double wait_s, double spin_us) {
  check_region(region, ranks);
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto spin_until = start + std::chrono::duration<double, std::micro>(spin_us);
  const auto give_up = start + std::chrono::duration<double>(wait_s);
  int64_t next = 0;  // the first rank not yet seen at `round`
  for (uint64_t i = 0;; ++i) {
    while (next < ranks) {
      const int64_t* line = rank_line(region, next);
      if (__atomic_load_n(line, __ATOMIC_ACQUIRE) < round) break;
      // a rank runs at most one round ahead, into the other set: this set's tag is this round's
      if (__atomic_load_n(line + 1 + (round & 1), __ATOMIC_RELAXED) != tag) return -1 - next;
      ++next;
    }
    if (next == ranks) return 1;
    if ((i & 63) != 63) {
      PAGEDSERVE_PAUSE();
      continue;
    }
    const auto now = clock::now();
    if (now >= give_up) return 0;
    if (now >= spin_until) {
      const timespec nap{0, 20000};
      nanosleep(&nap, nullptr);
    } else {
      sched_yield();
    }
  }
}

void bind_cpu_shm_sync(pybind11::module& m) {
  m.def("shm_arrive", &shm_arrive, "publish this rank's round and its tensor's tag (release)");
  m.def("shm_wait", &shm_wait, "wait until every rank arrives at a round (acquire): 1, 0 on timeout, -1-r on a tag "
        "mismatch of rank r", pybind11::call_guard<pybind11::gil_scoped_release>());
}
