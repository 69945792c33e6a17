// float32 y = x·Wᵀ (+ bias) over weights packed at load, for any number of rows: the fused
// decode step's products at every batch size (cpu_decode.cpp) and the eager forward's on CPU
// (kernels/cpu_packed.py).
//
// The layout: W [out, in] is cut into panels of kPanel = 16 output rows, and each panel is
// stored k-major, [panels, in, 16] (the last panel zero-padded). One k of a panel is 16
// contiguous floats: one AVX-512 vector or two AVX2 vectors of 16 outputs. The layout is the
// same on every CPU, so a packed tensor does not depend on the instruction set.
//
// The order: each output y[r, o] is ONE chain of fused multiply-adds over k = 0, 1, ..., in-1,
// starting from 0, then + bias[o]. Every kernel below (AVX-512, AVX2, plain C++) computes
// exactly that chain, with the row's x[r, k] broadcast against the panel's 16 weights, so a
// row's bits do not depend on how many rows share the call, which tile it lands in, which
// kernel runs, or how many threads split the panels. This is the BLAS shape of a product
// (outputs in the vector lanes, no horizontal sums), which the earlier kernels of
// cpu_decode.cpp (k in the vector lanes, one dot product per output, summed by a tree) could
// not take at many rows: per k step a tile of MR rows × NP panels loads NP weight vectors (two
// with AVX2) and MR broadcasts for MR × NP (× 2) FMAs.
//
// Tiles: AVX2 has 16 ymm registers: 6 rows × 1 panel (12 accumulators) from 6 rows; fewer
// rows take more panels so that at least 8 FMA chains hide the FMA latency (1 row × 4
// panels). AVX-512 has 32: 8 rows × 3 panels (24 accumulators), 1 row × 8 panels. Each kernel
// is compiled with a function-level target attribute, so one -march=native build holds the
// ones this compiler knows, and `__builtin_cpu_supports` picks at run time.
//
// Loops: the panels are split across torch's intra-op threads; each thread runs blocks of rows
// (as many as keep the block of x in about 192 KB of L2) against each of its panels, so a
// panel (in × 64 bytes) is read from memory once per row block and stays in L2 for every tile
// of the block. Where the rows are one block (every decode batch), a thread done with its
// share of the tiles takes the others' (cpu_balanced_for.h).
// Only ATen/Parallel.h of torch is included here: torch/extension.h alone costs about a
// minute of compile time per file, and the workers build this at their first start. The torch
// operators and Python bindings over these functions are in cpu_decode.cpp.
#include <ATen/Parallel.h>
#include "cpu_balanced_for.h"
#include "cpu_build_isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PSP_X86 1
#define PSP_AVX2 __attribute__((target("avx2,fma")))
#define PSP_AVX512 __attribute__((target("avx2,fma,avx512f")))
#endif

namespace {

constexpr int64_t kPanel = 16;  // output rows per panel
constexpr int64_t kBlockBytes = 192 << 10;  // the rows of x one block keeps in L2
// Each k step of a tile reads one 64-byte line of each of its panels; the AVX2 tile prefetches
// the line kPrefetchBytes ahead in the same panel, so that a few rows, whose products cannot
// hide the memory latency, still stream the weights at full speed. The AVX-512 tile leaves it
// to the hardware: a panel is a stream of in × 64 bytes (36 KB at 576 inputs), long enough for
// the prefetchers to follow, and the software prefetch only cost time. The model's 120 linears
// and its LM head, 2 threads, AMD EPYC Zen 4, the variants switched in one process (median of
// 10 passes): M = 1 13.83 ms without it against 17.29 with it (38.9 against 31.1 GB/s), M = 4
// 13.94 against 17.00, M = 16 28.24 against 30.68; the thread's next tile into L2 instead:
// 14.97, 15.75, 28.87. (Not measured on an AVX2 CPU, whose tile keeps its prefetch.) Since then
// the tiles of a batch of several tiles of rows do ask for the next tile (NextTile, below: faster
// on an Intel Xeon at 16 and 64 rows; not measured again on that Zen 4); a batch that fits one
// tile of rows, as above, does not.
constexpr int64_t kPrefetchBytes = 4096;

// A decode batch of several tiles of rows (m above the tile's rows, within one block of rows):
// the first tile of rows reads each panel from memory and the later ones from L2, so the first
// one waited on memory for every panel. It now asks for the thread's next tile into L2, one
// 64-byte line for each line it reads itself (as the AVX-512 int8 tiles do, cpu_packed_int8.cpp),
// and the later tiles of rows give those lines time to arrive. In the engine's batch-64 decode
// step, alternated processes on an Intel Xeon (AVX-512, 480 MiB of L3): linear layers 63.35 /
// 66.97 ms against 67.73 / 70.61 (AVX-512 build), 96.96 / 95.97 against 101.41 / 100.78 (the
// x86-64-v3 build: AVX2); batch 16 (AVX2) 37.73 / 37.31 against 40.15 / 40.84. A prefill chunk
// (several blocks of rows) finds a layer's weights in cache after its first block and does not
// ask; nor does a tile of all the rows (batch 1), which keeps the prefetch below.
struct NextTile {
  const float* at = nullptr;
  int64_t lines = 0;  // 64-byte lines (one k step of one panel each)
};

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa detect_isa() {
#ifdef PSP_X86
  __builtin_cpu_init();
  if (pagedserve_isa::kBuildAvx512 && __builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (pagedserve_isa::kBuildAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

Isa forced_isa = Isa::kAvx512;  // set_packed_linear_isa: at most this one (tests compare them)

Isa active_isa() {
  static const Isa best = detect_isa();
  return std::min(best, forced_isa);
}

// c[i, 0:np·16] = the chains of rows i < MR of x against panels 0..np-1 (np ≤ NP at run time
// through the template), written to c with row stride ldc; `next`: the lines to ask for (above).
template <int MR, int NP>
void tile_scalar(const float* x, int64_t ldx, const float* w, int64_t in, int64_t panel_stride, const NextTile&,
                 float* c, int64_t ldc) {
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) {
      float acc[kPanel] = {};
      const float* wp = w + p * panel_stride;
      for (int64_t k = 0; k < in; ++k) {
        const float xv = x[i * ldx + k];
        for (int j = 0; j < kPanel; ++j) acc[j] = std::fma(xv, wp[k * kPanel + j], acc[j]);
      }
      std::memcpy(c + i * ldc + p * kPanel, acc, sizeof(acc));
    }
}

#ifdef PSP_X86
// Asks for line `line` of the thread's next tile into L2, if the tile has that line.
inline __attribute__((always_inline)) void prefetch_next(const NextTile& next, int64_t line) {
  if (line < next.lines) _mm_prefetch(reinterpret_cast<const char*>(next.at + line * kPanel), _MM_HINT_T1);
}

template <int MR, int NP, bool kNext>
PSP_AVX2 void tile_avx2(const float* x, int64_t ldx, const float* w, int64_t in, int64_t panel_stride,
                        const NextTile& next, float* c, int64_t ldc) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[i][p][0] = acc[i][p][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m256 w0[NP], w1[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      if constexpr (kNext)
        prefetch_next(next, k * NP + p);
      else
        _mm_prefetch(reinterpret_cast<const char*>(w + p * panel_stride + k * kPanel) + kPrefetchBytes, _MM_HINT_T0);
      w0[p] = _mm256_loadu_ps(w + p * panel_stride + k * kPanel);
      w1[p] = _mm256_loadu_ps(w + p * panel_stride + k * kPanel + 8);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        acc[i][p][0] = _mm256_fmadd_ps(xv, w0[p], acc[i][p][0]);
        acc[i][p][1] = _mm256_fmadd_ps(xv, w1[p], acc[i][p][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(c + i * ldc + p * kPanel, acc[i][p][0]);
      _mm256_storeu_ps(c + i * ldc + p * kPanel + 8, acc[i][p][1]);
    }
}

template <int MR, int NP, bool kNext>
PSP_AVX512 void tile_avx512(const float* x, int64_t ldx, const float* w, int64_t in, int64_t panel_stride,
                            const NextTile& next, float* c, int64_t ldc) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m512 wv[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      if constexpr (kNext) prefetch_next(next, k * NP + p);
      wv[p] = _mm512_loadu_ps(w + p * panel_stride + k * kPanel);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xv, wv[p], acc[i][p]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(c + i * ldc + p * kPanel, acc[i][p]);
}
#endif

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const NextTile&, float*, int64_t);

// The tile shapes: at most max_rows(isa) rows, and for mr rows at most max_panels(isa, mr)
// panels (accumulators within the registers, and at least 8 FMA chains where the rows allow).
constexpr int max_rows(Isa isa) { return isa == Isa::kAvx512 ? 8 : isa == Isa::kAvx2 ? 6 : 4; }
constexpr int max_panels(Isa isa, int mr) {
  if (isa == Isa::kAvx512) return mr == 1 ? 8 : mr == 2 ? 6 : mr <= 4 ? 4 : 3;  // ≤ 24 zmm accumulators
  if (isa == Isa::kAvx2) return mr == 1 ? 4 : mr == 2 ? 3 : mr == 3 ? 2 : 1;  // 2 ymm a panel: ≤ 12
  return 1;
}

// `next`: the tile asks for the next one (NextTile; a separate instantiation, so the tiles that
// do not ask carry no test for it in their loop).
template <Isa I, int MR, int NP>
TileFn tile_fn(bool next) {
#ifdef PSP_X86
  if constexpr (I == Isa::kAvx512) return next ? &tile_avx512<MR, NP, true> : &tile_avx512<MR, NP, false>;
  if constexpr (I == Isa::kAvx2) return next ? &tile_avx2<MR, NP, true> : &tile_avx2<MR, NP, false>;
#endif
  return &tile_scalar<MR, NP>;
}

// The kernel of mr rows × np panels (within the bounds above), through templates instantiated
// only for the shapes that run.
template <Isa I, int MR, int NP = 1>
TileFn pick_np(int np, bool next) {
  if constexpr (NP < max_panels(I, MR)) {
    if (np != NP) return pick_np<I, MR, NP + 1>(np, next);
  }
  return tile_fn<I, MR, NP>(next);
}

template <Isa I, int MR = 1>
TileFn pick_rows(int mr, int np, bool next) {
  if constexpr (MR < max_rows(I)) {
    if (mr != MR) return pick_rows<I, MR + 1>(mr, np, next);
  }
  return pick_np<I, MR>(np, next);
}

TileFn pick(Isa isa, int mr, int np, bool next) {
  if (isa == Isa::kAvx512) return pick_rows<Isa::kAvx512>(mr, np, next);
  if (isa == Isa::kAvx2) return pick_rows<Isa::kAvx2>(mr, np, next);
  return pick_rows<Isa::kScalar>(mr, np, next);
}

// The tile shape for m rows: (rows per tile, panels per tile).
std::pair<int, int> tile_shape(Isa isa, int64_t m) {
  const int mr = static_cast<int>(std::min<int64_t>(m, max_rows(isa)));
  return {mr, max_panels(isa, mr)};
}

constexpr int kMaxMR = 8, kMaxNP = 8;  // the largest of the bounds above (the output buffer)

}  // namespace

// y[r, o] = x[r, :] · W[o, :] (+ bias[o]) for r < m, o < out, from W packed as [panels, in, 16].
void linear_rows_packed(const float* x, int64_t m, int64_t in, const float* packed, const float* bias, int64_t out,
                        float* y) {
  if (m <= 0) return;
  if (in == 0) {  // empty sums: the bias alone
    for (int64_t r = 0; r < m; ++r)
      for (int64_t o = 0; o < out; ++o) y[r * out + o] = bias ? bias[o] : 0.f;
    return;
  }
  const Isa isa = active_isa();
  const auto shape = tile_shape(isa, m);
  const int tm = shape.first, tp = shape.second;  // plain ints: a lambda may capture them
  const int64_t panels = (out + kPanel - 1) / kPanel;
  const int64_t panel_stride = in * kPanel;
  const int64_t block_rows = std::max<int64_t>(tm, kBlockBytes / (in * 4) / tm * tm);
  const int64_t tiles = (panels + tp - 1) / tp;  // groups of tp panels, split across threads
  // tile t's outputs for rows [r0, r1); next_t: the tile the thread will likely run next (-1:
  // none), asked for by the first tile of rows where the rows are one block of several tiles
  auto run_tile = [&](int64_t t, int64_t r0, int64_t r1, int64_t next_t) {
    float c[kMaxMR * kMaxNP * kPanel];
    const int64_t ldc = tp * kPanel;
    const int64_t p0 = t * tp;
    const int np = static_cast<int>(std::min<int64_t>(tp, panels - p0));
    const int64_t o0 = p0 * kPanel, on = std::min<int64_t>(np * kPanel, out - o0);
    const int64_t next_np = next_t >= 0 ? std::min<int64_t>(tp, panels - next_t * tp) : 0;
    const NextTile next{next_np > 0 ? packed + next_t * tp * panel_stride : nullptr, next_np * in};
    for (int64_t r = r0; r < r1; r += tm) {
      const int mr = static_cast<int>(std::min<int64_t>(tm, r1 - r));
      const bool ask = next.at != nullptr && r == r0 && r1 - r0 > tm && m <= block_rows;
      pick(isa, mr, np, ask)(x + r * in, in, packed + p0 * panel_stride, in, panel_stride, next, c, ldc);
      for (int i = 0; i < mr; ++i) {
        float* yr = y + (r + i) * out + o0;
        const float* cr = c + i * ldc;
        if (bias) {
          for (int64_t j = 0; j < on; ++j) yr[j] = cr[j] + bias[o0 + j];
        } else {
          std::memcpy(yr, cr, on * sizeof(float));
        }
      }
    }
  };
  pagedserve_balanced::for_tiles(tiles, m, block_rows, run_tile);
}

// W [out, in] (row-major) → dst [ceil(out / 16), in, 16], zero-padded (dst holds that many floats).
void pack_linear_rows(const float* src, int64_t out, int64_t in, float* dst) {
  const int64_t panels = (out + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::memset(dst + p * in * kPanel, 0, in * kPanel * sizeof(float));
      for (int64_t j = 0; j < kPanel && p * kPanel + j < out; ++j)
        for (int64_t k = 0; k < in; ++k) dst[(p * in + k) * kPanel + j] = src[(p * kPanel + j) * in + k];
    }
  });
}

// The kernel in use: avx512, avx2 or scalar.
const char* packed_linear_isa() {
  switch (active_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// At most this kernel (tests compare them); false for an unknown name.
bool set_packed_linear_isa(const std::string& name) {
  if (name != "avx512" && name != "avx2" && name != "scalar") return false;
  forced_isa = name == "avx512" ? Isa::kAvx512 : name == "avx2" ? Isa::kAvx2 : Isa::kScalar;
  return true;
}
