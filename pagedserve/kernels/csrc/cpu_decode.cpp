// The decode step of a Llama-shaped decoder in one C++ call, for CPU workers (float32).
//
// At batch 1 a decode step reads every weight once and does little else, so two things
// decide its time: how fast the weights stream from memory, and how much host work sits
// between the matrix products. torch's batch-1 `F.linear` reads weights at about 10 GB/s on
// the machines we measured (half of what two cores can stream), and an eager layer makes
// about a hundred aten calls around its four products. `FusedDecoder` takes both away:
//
//  - float32 weights packed at load (kernels/cpu_packed.py, the default): the products of
//    cpu_packed_gemm.cpp at every row count (`linear_any` tells a packed weight by its 3
//    dimensions). Unpacked float32 weights (`--no-pack-cpu-weights`) run the kernels below.
//  - `small_linear`: y = x·Wᵀ for a few rows, one pass over each weight row (contiguous,
//    AVX-512 or AVX2 intrinsics, plain C++ elsewhere), split across torch's intra-op threads
//    by output rows. Each weight vector is applied to up to 6 rows of x in registers, in an
//    order that does not depend on how many rows share the call (`linear_rows_any`).
//  - the element-wise work (residual add, RMSNorm, rotary, SiLU·mul, the KV store) runs as
//    plain loops over the few rows, between the products, in scratch buffers kept from
//    step to step (only the attention kernel's query and output are allocated per layer).
//  - attention is the paged decode kernel of cpu_paged_attention.cpp.
//  - an int8 KV cache (`--kv-cache-dtype int8`): each new K/V row is quantized as it is
//    stored (`quantize_kv_row_int8`: head_dim int8 values, then the row's float32 scale, as
//    kernels/reference_ops.quantize_kv_rows), and the attention kernel reads the rows so.
//  - int8 weights packed at load (kernels/cpu_packed.py's PackedInt8Linear, the default with
//    `--quantization int8`): the int8 × int8 products of cpu_packed_int8.cpp at every row count
//    (a 4-dimensional uint8 weight with its row scales).
//  - unpacked int8 weights: `linear_rows_int8` reads each int8 weight row once.
//    Where the CPU has AVX2 + FMA (or AVX-VNNI, or AVX-512 VNNI) it runs `linear_rows_int8_int8`
//    (cpu_int8_gemv.cpp, chosen at run time: the activations quantized to int8 per block of
//    32, int8 × int8 products). With `set_int8_kernel("float")`, or on other CPUs, it
//    widens 16 (AVX-512) or 8 (AVX2) weights to float in registers, and applies them to up
//    to 6 (AVX-512) or 3 (AVX2) rows of x at a time with float FMAs, in the float32 path's
//    batch-invariant order; the row's scale multiplies the sum. A quarter
//    of the bytes of the float32 row, for the same arithmetic. Plain C++ where neither
//    instruction set is compiled in (the build is -march=native).
//
// It computes exactly what the eager model computes (plugins/models/llama.py with the torch
// ops), up to float rounding order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
bool int8_int8_enabled();
int64_t int8_kernel_max_rows();
void linear_rows_int8_int8(const float* x, int64_t m, int64_t in, const int8_t* w, const float* scale,
                           const float* bias, int64_t out, float* y);
void quantize_kv_row_int8(const float* x, int64_t n, int8_t* row);  // cpu_paged_attention.cpp
// cpu_packed_gemm.cpp: the float32 products over packed weights (its torch operators are below)
void linear_rows_packed(const float* x, int64_t m, int64_t in, const float* packed, const float* bias, int64_t out,
                        float* y);
void pack_linear_rows(const float* src, int64_t out, int64_t in, float* dst);
const char* packed_linear_isa();
bool set_packed_linear_isa(const std::string& name);
constexpr int64_t kPackedPanel = 16;  // output rows per panel, as cpu_packed_gemm.cpp's kPanel
// cpu_packed_int8.cpp: int8 × int8 products over int8 weights packed at load
void linear_rows_packed_int8(const float* x, int64_t m, int64_t in, const uint8_t* packed, const float* scale,
                             const float* bias, int64_t out, float* y);
void pack_int8_rows(const int8_t* src, int64_t out, int64_t in, uint8_t* dst);
int64_t packed_int8_bytes(int64_t out, int64_t in);
void linear_rows_packed_int4(const float* x, int64_t m, int64_t in, int64_t kp, const uint8_t* codes,
                             const uint16_t* scales, const uint8_t* zeros, int64_t groups, const float* bias, int64_t out,
                             float* y);
const char* packed_int8_isa();
bool set_packed_int8_isa(const std::string& name);
void linear_rows_int4(const float* x, int64_t m, int64_t in, const uint8_t* packed, const uint16_t* scales,
                      const uint8_t* zeros, int64_t kp, int64_t group, const float* bias, int64_t out,
                      float* y);  // cpu_int4_gemv.cpp

namespace {

// A float16 tensor's elements as their bits (the int4 scales, packed or not).
inline const uint16_t* half_bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

// The few-row products of the step, float32 or int8 weights: y[r, o] = x[r, :] · w[o, :] for
// the m rows of x. Each weight vector is loaded once and applied to up to kMaxRows rows of x
// in registers, and a row's result is bitwise the same whatever m and whichever rows share
// its group: every row has the same kUnroll accumulators, filled in the same order, the last
// partial vector zero-padded into the same one, and summed by the same fixed tree. A
// sequence's greedy tokens must not depend on its batch (tests/gateway/test_live_server.py
// compares a served completion with an in-process one).
// With one row the weights stream from memory in one sequential pass and the kUnroll
// accumulators hide the FMA latency. A tile of 4 weight rows × the rows of x (each row vector
// loaded once for 4 weight rows) was tried: its four interleaved weight streams read memory
// more slowly at one row (30 against 17 ms for the default model's 120 layers, one thread),
// and it was no faster at 5 rows.
//
// -ffast-math may reassociate plain vector adds (GCC writes _mm512_add_ps as a `+` of vector
// types), in an order that could differ between the kernels of different row counts: the
// final sums go through `pinned`, an empty asm statement that the compiler cannot see
// through, so their order is the one written. The FMAs are builtins, never reassociated.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <class T>
inline T pinned(T v) {
  asm("" : "+v"(v));
  return v;
}
#endif

#if defined(__AVX512F__)
// 32 zmm registers: 6 rows × 4 accumulators, the weight vector and the row loads fit.
constexpr int kLanes = 16, kUnroll = 4, kMaxRows = 6;
using VecF = __m512;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload_part(const float* p, int n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline VecF vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return pinned(_mm512_add_ps(a, b)); }
inline float vsum(VecF v) {
  const __m256 h = pinned(_mm256_add_ps(_mm512_castps512_ps256(v),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  const __m128 q = pinned(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  const __m128 p = pinned(_mm_add_ps(q, _mm_movehl_ps(q, q)));
  return _mm_cvtss_f32(pinned(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1))));
}
#elif defined(__AVX2__) && defined(__FMA__)
// 16 ymm registers: 3 rows × 4 accumulators, the weight vector and the row loads fit.
constexpr int kLanes = 8, kUnroll = 4, kMaxRows = 3;
using VecF = __m256;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload_part(const float* p, int n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}
inline VecF vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return pinned(_mm256_add_ps(a, b)); }
inline float vsum(VecF v) {
  const __m128 q = pinned(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
  const __m128 p = pinned(_mm_add_ps(q, _mm_movehl_ps(q, q)));
  return _mm_cvtss_f32(pinned(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1))));
}
#else
constexpr int kMaxRows = 4;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Software prefetch of the weights 4 KB ahead of the loads, into L2 (the T1 hint), one line per
// 64 bytes. The default model's 120 layers, one thread, alone in a test program (ms, against
// one dot product per row): without it 1 row 17.3 (18.3), 5 rows 30.4 (34.1); 4 KB ahead into
// L1 from 2 rows on 5 rows 31 (36); 4 KB ahead into L2 for every row count 1 row 16.9 (18.9),
// 5 rows 25.8 (34.6), 16 rows 70.2 (114.1); 8 KB into L2: 1 row 21.1 (19.7).
constexpr int64_t kPrefetchBytes = 4096;

inline VecF vload_part(const int8_t* p, int n) {  // n < kLanes int8 weights, zero-padded
  int8_t buf[kLanes] = {};
  std::memcpy(buf, p, n);
  return vload(static_cast<const int8_t*>(buf));
}

// s[r] = Σ_k w[k]·x[r·in + k] for the R rows of x against one weight row (float32 or int8, R
// fixed at compile time so the accumulators stay in registers). Lane l of accumulator u holds
// the products k ≡ u·kLanes + l (mod kUnroll·kLanes); whole vectors of the rest go to
// accumulators 0, 1, ... and its last partial vector, zero-padded, to the next one.
template <int R, class W>
inline void dot_rows(const W* w, const float* x, int64_t in, float* s) {
  static_assert(kUnroll == 4, "the final sum below is written for 4 accumulators");
  VecF acc[R][kUnroll];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < kUnroll; ++u) acc[r][u] = vzero();
  int64_t k = 0;
  for (; k + kLanes * kUnroll <= in; k += kLanes * kUnroll) {
#pragma GCC unroll 4
    for (int l = 0; l < kLanes * kUnroll * static_cast<int>(sizeof(W)) / 64; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) {
      const VecF wv = vload(w + k + kLanes * u);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][u] = vfma(wv, vload(x + r * in + k + kLanes * u), acc[r][u]);
    }
  }
#pragma GCC unroll 4
  for (int u = 0; u < kUnroll && k < in; ++u) {
    const int n = static_cast<int>(std::min<int64_t>(in - k, kLanes));
    if (n == kLanes) {
      const VecF wv = vload(w + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][u] = vfma(wv, vload(x + r * in + k), acc[r][u]);
    } else {
      const VecF wv = vload_part(w + k, n);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][u] = vfma(wv, vload_part(x + r * in + k, n), acc[r][u]);
    }
    k += n;
  }
  for (int r = 0; r < R; ++r) s[r] = vsum(vadd(vadd(acc[r][0], acc[r][1]), vadd(acc[r][2], acc[r][3])));
}
#else
// Plain C++: one row at a time, through the one out-of-line loop (so that no caller's
// vectorization can change its order).
template <class W>
__attribute__((noinline)) float dot_row(const W* w, const float* x, int64_t in) {
  float s = 0.f;
  for (int64_t k = 0; k < in; ++k) s += static_cast<float>(w[k]) * x[k];
  return s;
}

template <int R, class W>
inline void dot_rows(const W* w, const float* x, int64_t in, float* s) {
  for (int r = 0; r < R; ++r) s[r] = dot_row(w, x + r * in, in);
}
#endif

template <class W, int R = 1>
inline void dot_rows_n(int rn, const W* w, const float* x, int64_t in, float* s) {
  if constexpr (R < kMaxRows) {
    if (rn != R) return dot_rows_n<W, R + 1>(rn, w, x, in, s);
  }
  dot_rows<R>(w, x, in, s);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The products of many rows: register tiles of kTileRows rows of x × kTileCols weight rows,
// the same sums as `dot_rows`, bit for bit. dot_rows keeps kUnroll accumulators per row; a
// tile cannot (4 rows × 6 weight rows × 4 would need 96 registers), so it takes one
// accumulator set at a time: pass u fills, for every (row, weight row) pair of the tile,
// exactly the accumulator u of dot_rows (the vectors k ≡ u·kLanes mod kUnroll·kLanes, then
// the tail vector u), in the same order, and the four partial vectors are summed by the same
// tree at the end. A row's result is therefore the same through either kernel and whatever
// rows share its tile: which kernel runs is a choice of speed only.
// Per k step a tile loads kTileRows + kTileCols vectors for kTileRows × kTileCols FMAs (10 for
// 24 with AVX-512, 6 for 9 with AVX2): the FMA units, not the loads, set the pace, where the
// row groups of `linear_rows_any` load a weight vector and a row vector for every FMA. (GCC
// folds the weight loads into the FMAs, once per row, unless `pinned` keeps each in a register.)
#if defined(__AVX512F__)
constexpr int kTileRows = 4, kTileCols = 6;  // 24 accumulators + 6 weight vectors + 1 row vector ≤ 32
#else
constexpr int kTileRows = 3, kTileCols = 3;  // 9 accumulators + 3 weight vectors + 1 row vector ≤ 16
#endif
constexpr bool kHaveTiles = true;

// s[i·kTileCols + j] = Σ_k w[j·in + k]·x[i·in + k] for i < MR, j < NR, in dot_rows' order.
template <int MR, int NR, class W>
inline void dot_tile(const W* w, const float* x, int64_t in, float* s) {
  constexpr int64_t kStep = kLanes * kUnroll;
  const int64_t whole = in / kStep * kStep;  // the full kUnroll-vector steps; the rest is the tail
  VecF part[kUnroll][MR][NR];
#pragma GCC unroll 1
  for (int u = 0; u < kUnroll; ++u) {
    VecF acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
    for (int64_t k = kLanes * u; k < whole; k += kStep) {
      VecF wv[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) wv[j] = pinned(vload(w + j * in + k));  // in a register, loaded once
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const VecF xv = vload(x + i * in + k);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) acc[i][j] = vfma(wv[j], xv, acc[i][j]);
      }
    }
    const int64_t k = whole + kLanes * u;  // the tail vector of accumulator u, if the row reaches it
    if (k < in) {
      const int n = static_cast<int>(std::min<int64_t>(in - k, kLanes));
      for (int j = 0; j < NR; ++j) {
        const VecF wv = n == kLanes ? vload(w + j * in + k) : vload_part(w + j * in + k, n);
        for (int i = 0; i < MR; ++i) {
          const VecF xv = n == kLanes ? vload(x + i * in + k) : vload_part(x + i * in + k, n);
          acc[i][j] = vfma(wv, xv, acc[i][j]);
        }
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) part[u][i][j] = acc[i][j];
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      s[i * kTileCols + j] = vsum(vadd(vadd(part[0][i][j], part[1][i][j]), vadd(part[2][i][j], part[3][i][j])));
}

// dot_tile for mr ≤ kTileRows rows and nr ≤ kTileCols weight rows known only at run time.
template <class W, int MR, int NR = 1>
inline void dot_tile_cols(int nr, const W* w, const float* x, int64_t in, float* s) {
  if constexpr (NR < kTileCols) {
    if (nr != NR) return dot_tile_cols<W, MR, NR + 1>(nr, w, x, in, s);
  }
  dot_tile<MR, NR>(w, x, in, s);
}
template <class W, int MR = 1>
inline void dot_tile_n(int mr, int nr, const W* w, const float* x, int64_t in, float* s) {
  if constexpr (MR < kTileRows) {
    if (mr != MR) return dot_tile_n<W, MR + 1>(mr, nr, w, x, in, s);
  }
  dot_tile_cols<W, MR>(nr, w, x, in, s);
}

// linear_rows_any's result, bit for bit, by register tiles: output rows are split across
// torch's intra-op threads in panels of kTileCols; each thread takes blocks of panels that fit
// in L2 (about 256 KB of weights) and runs every tile of rows of x against each panel of the
// block, so each weight row comes from memory once per call and each row of x once per block.
template <class W>
void linear_rows_tiled(const float* x, int64_t m, int64_t in, const W* w, const float* scale, const float* bias,
                       int64_t out, float* y) {
  const int64_t panels = (out + kTileCols - 1) / kTileCols;
  const int64_t block = std::max<int64_t>(1, (256 << 10) / (kTileCols * in * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    float s[kTileRows * kTileCols];
    for (int64_t pb = begin; pb < end; pb += block) {
      const int64_t pe = std::min(end, pb + block);
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        for (int64_t p = pb; p < pe; ++p) {
          const int64_t o0 = p * kTileCols;
          const int nr = static_cast<int>(std::min<int64_t>(kTileCols, out - o0));
          dot_tile_n<W>(mr, nr, w + o0 * in, x + r0 * in, in, s);
          for (int i = 0; i < mr; ++i) {
            float* yr = y + (r0 + i) * out + o0;
            for (int j = 0; j < nr; ++j) {
              const int64_t o = o0 + j;
              const float b = bias ? bias[o] : 0.f;
              yr[j] = scale ? std::fma(s[i * kTileCols + j], scale[o], b) : s[i * kTileCols + j] + b;
            }
          }
        }
      }
    }
  });
}
#else
constexpr bool kHaveTiles = false;
template <class W>
void linear_rows_tiled(const float*, int64_t, int64_t, const W*, const float*, const float*, int64_t, float*) {}
#endif

// From how many rows of x, and from what depth (`in`), the products run in register tiles
// (`linear_rows_tiled`) rather than in row groups (`linear_rows_any`). Both give the same bits,
// so this is a choice of speed only (set_linear_tile_rows changes it for tests and
// benchmarks). Measured on the AMD EPYC (Zen 4, AVX-512) with benchmarks/linear_tiles.py, one
// thread, weights in cache, 16 and 64 rows: tiles 81-84 GFLOP/s against row groups 48-53 at
// depth 1536 (down_proj), but 50-60 against 61-65 at depth 576 (qkv, o_proj, gate_up), where
// a tile's four passes over 9 steps and its 24 final sums cost more than the loads they save.
int64_t tile_min_rows = 8;
int64_t tile_min_depth = 1024;

// y[r, o] = (x[r, :] · w[o, :]) · scale[o] (+ bias[o]) for r < m, w [out, in] row-major (float32
// with no scale, or int8 with one scale per row). Output rows are split across torch's
// intra-op threads; each thread takes blocks of 64 weight rows (in L2) and applies every group
// of rows of x to each weight row of the block while it is in L1, so each weight row comes
// from memory once per call and each weight vector is loaded once per group. The groups are
// near-equal runs of at most kMaxRows rows; which group a row lands in does not change its result.
template <class W>
void linear_rows_any(const float* x, int64_t m, int64_t in, const W* w, const float* scale, const float* bias,
                     int64_t out, float* y) {
  if (kHaveTiles && m >= tile_min_rows && in >= tile_min_depth) return linear_rows_tiled<W>(x, m, in, w, scale, bias, out, y);
  constexpr int64_t kBlock = 64;
  const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
  at::parallel_for(0, out, 32, [&](int64_t begin, int64_t end) {
    float s[kMaxRows];
    for (int64_t ob = begin; ob < end; ob += kBlock) {
      const int64_t oe = std::min(end, ob + kBlock);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * m / groups, rn = (g + 1) * m / groups - r0;
        const float* xr = x + r0 * in;
        for (int64_t o = ob; o < oe; ++o) {
          dot_rows_n<W>(static_cast<int>(rn), w + o * in, xr, in, s);
          const float b = bias ? bias[o] : 0.f;
          float* yo = y + r0 * out + o;
          if (scale) {
            for (int64_t r = 0; r < rn; ++r) yo[r * out] = std::fma(s[r], scale[o], b);
          } else {
            for (int64_t r = 0; r < rn; ++r) yo[r * out] = s[r] + b;
          }
        }
      }
    }
  });
}

// y[r, o] = x[r, :] · w[o, :] (+ bias[o]) for r < m; w is float32 [out, in], row-major.
void linear_rows(const float* x, int64_t m, int64_t in, const float* w, const float* bias, int64_t out, float* y) {
  linear_rows_any<float>(x, m, in, w, nullptr, bias, out, y);
}

// y[r, o] = (x[r, :] · w[o, :]) · scale[o] (+ bias[o]) for r < m; w is int8 [out, in], row-major:
// an int8 × int8 kernel where the CPU has one and it is selected (cpu_int8_gemv.cpp), else the
// weights widened to float in registers, a quarter of the bytes of the float32 row for the same
// arithmetic.
void linear_rows_int8(const float* x, int64_t m, int64_t in, const int8_t* w, const float* scale, const float* bias,
                      int64_t out, float* y) {
  if (int8_int8_enabled()) return linear_rows_int8_int8(x, m, in, w, scale, bias, out, y);
  linear_rows_any<int8_t>(x, m, in, w, scale, bias, out, y);
}

// The element-wise row functions below are shared by the fused step and the eager forward's
// ops (`cpu_rms_norm`, `cpu_rotary`, `cpu_silu_and_mul`, used by kernels/cpu_ops.py): each is
// compiled once (noinline), so a row's bits are the same whichever path computes it.

// out[r] = weight * x[r] / sqrt(mean(x[r]²) + eps), as kernels/reference_ops.rms_norm_ref.
// The sum of squares and the inverse square root are taken in double, the inverse rounded
// once (-ffast-math would compute a float 1/sqrt with the approximate RSQRT instruction and
// a Newton step). An output is within about 3 ulp of the exact norm (2.8e-7 relative measured,
// tests/kernels/test_cpu_ops.py), torch's within 1: a row may differ from torch's by an ulp.
__attribute__((noinline)) void rms_norm_rows(const float* x, int64_t m, int64_t n, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + static_cast<double>(eps)));
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

// Rotate-half rotary embedding of `heads` heads of one token, from its cos/sin table row:
// x·cos + rotate_half(x)·sin as two rounded products and a rounded sum, as torch computes it
// (transformers and kernels/reference_ops.apply_rotary): no fused multiply-add contracts them.
__attribute__((noinline, optimize("fp-contract=off"))) void rotate(float* x, int64_t heads, int64_t head_dim,
                                                                 const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] + (-b) * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// a[i] = silu(gate[i]) * up[i] for i < n: silu(g) = g / (1 + e^-g), the exponent capped so
// that -ffast-math never meets an infinity. The division is a true one (-mno-recip, in
// cpu_attention.py's flags: no VRCPPS estimate, whose bits differ between CPU models).
__attribute__((noinline)) void silu_mul_row(const float* gate, const float* up, int64_t n, float* a) {
  for (int64_t i = 0; i < n; ++i) a[i] = gate[i] / (1.f + std::exp(std::min(-gate[i], 80.f))) * up[i];
}

using Clock = std::chrono::steady_clock;

// fn(begin, end) over the rows [0, m) of `width` elements of work each: inline while the
// whole is under kParallelWork elements, else split across torch's intra-op threads. A
// parallel region costs microseconds on a quiet machine, but on a shared, oversubscribed one
// each region waits for its slowest thread to get a core: a step at 32 rows took 1.4 s in
// "other" ops with four regions a layer, against 46 ms at 16 rows with none (the AMD EPYC at
// load 12). So only work worth a region gets one (SiLU·mul from about 43 rows of the default
// model, the norms from 114). Each row's work is the same code on any thread, with any rows.
constexpr int64_t kParallelWork = 1 << 16;
template <class F>
inline void for_rows(int64_t m, int64_t width, const F& fn) {
  if (m * width < kParallelWork) return fn(int64_t{0}, m);
  at::parallel_for(0, m, std::max<int64_t>(1, kParallelWork / 4 / width), fn);
}

struct Layer {
  torch::Tensor input_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, post_norm, gate_up, down;
  // defined: that weight is quantized. int8: the weight is int8 [out, in] and the scale float32
  // [out]; int4: the weight is uint8 [out, padded_in / 2] (cpu_int4_gemv.cpp's packing), the
  // scale float16 [out, groups] and the zeros uint8 [out, groups] (undefined: symmetric, 8)
  torch::Tensor qkv_scale, o_proj_scale, gate_up_scale, down_scale;
  torch::Tensor qkv_zeros, o_proj_zeros, gate_up_zeros, down_zeros;
};

// y = x·wᵀ (+ bias) of m rows by torch's BLAS (at::mm_out, oneDNN/MKL on x86), float32 w
// [out, in]. Faster than our own products from a few dozen rows, but not batch-invariant: a
// row's bits depend on how many rows share the call (benchmarks/linear_tiles.py's check), as
// they do in the eager forward that runs the same BLAS at these sizes.
void linear_rows_blas(const float* x, int64_t m, int64_t in, const torch::Tensor& w, const float* bias,
                      int64_t out, float* y) {
  const auto opts = torch::TensorOptions().dtype(at::kFloat);
  auto xt = torch::from_blob(const_cast<float*>(x), {m, in}, opts);
  auto yt = torch::from_blob(y, {m, out}, opts);
  if (bias) {
    at::addmm_out(yt, torch::from_blob(const_cast<float*>(bias), {out}, opts), xt, w.t());
  } else {
    at::mm_out(yt, xt, w.t());
  }
}

// y = x·wᵀ (+ bias) of m rows: float32 w, int8 w with one scale per row, or int4 w (uint8, two
// codes a byte) with a scale (and a zero point, if `zeros` is defined) per group of inputs.
// float32 w packed in panels ([ceil(out / 16), in, 16], 3-D) runs cpu_packed_gemm.cpp at
// every row count, and so does int8 w packed for cpu_packed_int8.cpp (uint8, 4-D); an unpacked
// float32 w from `blas_rows` rows on (0: never) goes to torch's BLAS.
inline void linear_any(const float* x, int64_t m, int64_t in, const torch::Tensor& w, const torch::Tensor& scale,
                       const torch::Tensor& zeros, const float* bias, int64_t out, float* y, int64_t blas_rows = 0) {
  if (w.dim() == 3) {
    linear_rows_packed(x, m, in, w.data_ptr<float>(), bias, out, y);
  } else if (w.dim() == 4 && scale.dim() == 1) {
    linear_rows_packed_int8(x, m, in, w.data_ptr<uint8_t>(), scale.data_ptr<float>(), bias, out, y);
  } else if (w.dim() == 4) {
    linear_rows_packed_int4(x, m, in, w.size(1) * 8, w.data_ptr<uint8_t>(), half_bits(scale),
                            zeros.defined() ? zeros.data_ptr<uint8_t>() : nullptr, scale.size(1), bias, out, y);
  } else if (scale.defined() && w.scalar_type() == at::kByte) {
    const int64_t kp = w.size(1) * 2;
    linear_rows_int4(x, m, in, w.data_ptr<uint8_t>(), half_bits(scale),
                     zeros.defined() ? zeros.data_ptr<uint8_t>() : nullptr, kp, kp / scale.size(1), bias, out, y);
  } else if (scale.defined())
    linear_rows_int8(x, m, in, w.data_ptr<int8_t>(), scale.data_ptr<float>(), bias, out, y);
  else if (blas_rows > 0 && m >= blas_rows)
    linear_rows_blas(x, m, in, w, bias, out, y);
  else
    linear_rows(x, m, in, w.data_ptr<float>(), bias, out, y);
}

// The weight of one projection: float32 [out, in] or packed [ceil(out / 16), in, 16], int8
// [out, in] with float32 scales [out], or int4: uint8 [out, padded_in / 2] with float16 scales
// [out, groups] and optional uint8 zeros alike.
void check_weight(const torch::Tensor& w, const torch::Tensor& scale, const torch::Tensor& zeros, int64_t out,
                  int64_t in, const char* name) {
  if (w.dim() == 3) {
    TORCH_CHECK(!scale.defined() && !zeros.defined() && w.scalar_type() == at::kFloat && w.size(1) == in &&
                    w.size(2) == 16 && w.size(0) == (out + 15) / 16,
                name, ": a packed weight is float32 [ceil(out / 16), in, 16] with no scales");
    return;
  }
  if (w.dim() == 4 && scale.defined() && scale.dim() == 3) {
    const int64_t kp = w.size(1) * 8;
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(0) == (out + 15) / 16 && w.size(2) == 16 && w.size(3) == 4 &&
                    scale.scalar_type() == at::kHalf && scale.size(0) == w.size(0) && scale.size(2) == 16 &&
                    scale.size(1) > 0 && kp % scale.size(1) == 0 && (kp / scale.size(1)) % 32 == 0 && kp >= in &&
                    kp - in < kp / scale.size(1),
                name, ": a packed int4 weight is uint8 [ceil(out / 16), padded_in / 8, 16, 4] with float16 scales "
                      "[ceil(out / 16), groups, 16], groups of a multiple of 32 inputs covering ", in);
    TORCH_CHECK(!zeros.defined() || (zeros.scalar_type() == at::kByte && zeros.sizes() == scale.sizes()),
                name, ": packed int4 zeros must be uint8 shaped as the scales");
    return;
  }
  if (w.dim() == 4) {
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(0) == (out + 15) / 16 && w.size(1) == (in + 31) / 32 * 8 &&
                    w.size(2) == 16 && w.size(3) == 4 && scale.defined() && scale.scalar_type() == at::kFloat &&
                    scale.numel() == out && !zeros.defined(),
                name, ": a packed int8 weight is uint8 [ceil(out / 16), ceil(in / 32) * 8, 16, 4] with float32 "
                      "scales [out]");
    return;
  }
  if (scale.defined() && w.scalar_type() == at::kByte) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == out, name, ": int4 weight of the wrong shape");
    const int64_t kp = w.size(1) * 2;
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == out && scale.size(1) > 0 &&
                    kp % scale.size(1) == 0 && (kp / scale.size(1)) % 32 == 0 && kp >= in && kp - in < kp / scale.size(1),
                name, ": int4 scales must be float16 [out, groups], groups of a multiple of 32 inputs covering ", in);
    TORCH_CHECK(!zeros.defined() || (zeros.scalar_type() == at::kByte && zeros.sizes() == scale.sizes()),
                name, ": int4 zeros must be uint8 shaped as the scales");
    return;
  }
  TORCH_CHECK(!zeros.defined(), name, ": zero points go with int4 weights only");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == out && w.size(1) == in, name, ": weight of the wrong shape");
  if (scale.defined()) {
    TORCH_CHECK(w.scalar_type() == at::kChar, name, ": a weight with scales is int8");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == out, name, ": one float32 scale per row");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, name, ": a weight without scales is float32");
  }
}

}  // namespace

// y = x·wᵀ (+ bias) for a few rows of float32 x [m, in] and w [out, in].
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_linear is float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x [m, in], w [out, in]");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  linear_rows(xc.data_ptr<float>(), xc.size(0), xc.size(1), wc.data_ptr<float>(), b, wc.size(0), y.data_ptr<float>());
  return y;
}

// y = (x·wᵀ)·scale (+ bias) for rows of float32 x [m, in], int8 w [out, in], float32 scale [out].
torch::Tensor small_linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "small_linear_int8: float32 x, int8 w, float32 scale");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && scale.numel() == w.size(0),
              "small_linear_int8: x [m, in], w [out, in], scale [out]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == w.size(0)),
              "small_linear_int8: float32 bias [out]");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto sc = scale.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  linear_rows_int8(xc.data_ptr<float>(), xc.size(0), xc.size(1), wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
                   bc.defined() ? bc.data_ptr<float>() : nullptr, wc.size(0), y.data_ptr<float>());
  return y;
}

// The float32 weight [out, in] of an int8 weight and its per-row scales, in one parallel pass.
torch::Tensor int8_dequantize(torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && scale.scalar_type() == at::kFloat &&
                  scale.numel() == w.size(0), "int8_dequantize: int8 w [out, in], float32 scale [out]");
  auto wc = w.contiguous();
  auto sc = scale.contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  auto y = torch::empty({out, in}, scale.options());
  const int8_t* src = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t k = 0; k < in; ++k) dst[o * in + k] = static_cast<float>(src[o * in + k]) * sp[o];
  });
  return y;
}

class FusedDecoder {
 public:
  // layers: per layer [input_norm, qkv, qkv_bias?, q_norm?, k_norm?, o_proj, post_norm, gate_up, down]
  // (undefined tensors — None from Python — where the model has none), optionally followed by
  // [qkv_scale?, o_proj_scale?, gate_up_scale?, down_scale?]: a projection with a scale has
  // int8 weights (or int4: uint8), and then by [qkv_zeros?, o_proj_zeros?, gate_up_zeros?,
  // down_zeros?], the int4 zero points; cos/sin [positions, head_dim].
  FusedDecoder(torch::Tensor embed, std::vector<std::vector<c10::optional<torch::Tensor>>> layers,
               torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, int64_t intermediate_size = 0)
      : embed_(embed.contiguous()), final_norm_(final_norm.contiguous()), cos_(cos.contiguous()),
        sin_(sin.contiguous()), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        eps_(static_cast<float>(eps)) {
    TORCH_CHECK(embed_.scalar_type() == at::kFloat && cos_.scalar_type() == at::kFloat, "FusedDecoder is float32 only");
    auto get = [](const c10::optional<torch::Tensor>& t) {
      return t.has_value() ? t->contiguous() : torch::Tensor();
    };
    for (auto& l : layers) {
      TORCH_CHECK(l.size() == 9 || l.size() == 13 || l.size() == 17,
                  "a layer has 9 weight slots (13 with the scales, 17 with the int4 zero points)");
      auto slot = [&](size_t i) { return l.size() > i ? get(l[i]) : torch::Tensor(); };
      layers_.push_back({get(l[0]), get(l[1]), get(l[2]), get(l[3]), get(l[4]), get(l[5]), get(l[6]), get(l[7]),
                         get(l[8]), slot(9), slot(10), slot(11), slot(12), slot(13), slot(14), slot(15), slot(16)});
    }
    hidden_size_ = embed_.size(1);
    const auto& first = layers_.at(0);
    // gate_up's rows / 2: given (packed int4 weights are padded to panels of 16 rows and to whole
    // groups of inputs), else from the weights (packed float32: its panels of 16 rows, so
    // down's depth; packed int8: its row scales)
    TORCH_CHECK(intermediate_size > 0 || first.gate_up.dim() != 4 || first.gate_up_scale.dim() == 1,
                "FusedDecoder: packed int4 weights need the intermediate size");
    intermediate_ = intermediate_size > 0        ? intermediate_size
                    : first.gate_up.dim() == 3 ? first.down.size(1)
                    : first.gate_up.dim() == 4 ? first.gate_up_scale.numel() / 2
                                               : first.gate_up.size(0) / 2;
    q_size_ = num_heads_ * head_dim_;
    kv_size_ = num_kv_heads_ * head_dim_;
    for (const auto& L : layers_) {
      check_weight(L.qkv, L.qkv_scale, L.qkv_zeros, q_size_ + 2 * kv_size_, hidden_size_, "qkv");
      check_weight(L.o_proj, L.o_proj_scale, L.o_proj_zeros, hidden_size_, q_size_, "o_proj");
      check_weight(L.gate_up, L.gate_up_scale, L.gate_up_zeros, 2 * intermediate_, hidden_size_, "gate_up");
      check_weight(L.down, L.down_scale, L.down_zeros, hidden_size_, intermediate_, "down");
    }
    scale_ = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  }

  // One decode step: input_ids, positions, slots int64 [m]; block_tables int32 [m, max_blocks];
  // seq_lens int32 [m] (after this token); kv_caches per layer [2, blocks, block_size, kv_heads,
  // width]: float32 rows (width = head_dim) or int8 rows (width = head_dim + 4, the values then
  // the float32 scale). Returns the final hidden states [m, hidden] (normed, before the LM head).
  torch::Tensor forward(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor seq_lens, std::vector<torch::Tensor> kv_caches) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    slots.scalar_type() == at::kLong, "input_ids, positions and slots are int64");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
                "block_tables and seq_lens are int32");
    TORCH_CHECK(input_ids.is_contiguous() && positions.is_contiguous() && slots.is_contiguous(), "contiguous inputs");
    const int64_t m = input_ids.size(0), H = hidden_size_, I = intermediate_;
    TORCH_CHECK(positions.size(0) == m && slots.size(0) == m && seq_lens.size(0) == m && block_tables.size(0) == m,
                "one position, slot, context length and block table per sequence");
    const int64_t qkv_out = q_size_ + 2 * kv_size_;
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    auto opts = embed_.options();
    auto out = torch::empty({m, H}, opts);
    residual_.resize(m * H);
    normed_.resize(m * H);
    qkv_.resize(m * qkv_out);
    mlp_.resize(m * 2 * I);
    act_.resize(m * I);
    float* residual = residual_.data();
    float* normed = normed_.data();
    float* hidden = out.data_ptr<float>();  // the sublayer output, then the final hidden states
    const float* embed = embed_.data_ptr<float>();
    const int64_t table_dim = cos_.size(1);
    auto tick = Clock::now();
    auto lap = [&](int64_t& bucket) {
      if (!profile_) return;
      auto now = Clock::now();
      bucket += std::chrono::duration_cast<std::chrono::nanoseconds>(now - tick).count();
      tick = now;
    };

    for (int64_t r = 0; r < m; ++r) {
      TORCH_CHECK(ids[r] >= 0 && ids[r] < embed_.size(0), "token id out of the vocabulary");
      TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_.size(0), "position beyond the rotary table");
    }
    const bool int8_kv = kv_caches.at(0).scalar_type() == at::kChar;
    const int64_t width = int8_kv ? head_dim_ + 4 : head_dim_;  // elements of one cache row
    const int64_t row_stride = num_kv_heads_ * width;  // elements of one slot (every KV head)
    for (auto& kv : kv_caches)
      TORCH_CHECK(kv.scalar_type() == (int8_kv ? at::kChar : at::kFloat) && kv.is_contiguous() && kv.dim() == 5 &&
                      kv.size(0) == 2 && kv.size(3) == num_kv_heads_ && kv.size(4) == width,
                  "each KV cache is a contiguous [2, blocks, block_size, kv_heads, width]: float32 rows of head_dim, "
                  "or int8 rows of head_dim + 4 (the float32 scale last), every layer alike");
    const int64_t num_blocks = kv_caches[0].size(1), bs = kv_caches[0].size(2);
    TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && block_tables.dim() == 2, "contiguous tables");
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    for (auto& kv : kv_caches) TORCH_CHECK(kv.size(1) == num_blocks && kv.size(2) == bs, "every layer's cache alike");
    for (int64_t r = 0; r < m; ++r) {
      const int64_t s = slots.data_ptr<int64_t>()[r];
      TORCH_CHECK(s == -1 || (s >= 0 && s < num_blocks * bs), "slot beyond the KV cache");
      TORCH_CHECK(lens[r] == pos[r] + 1, "a decode's context ends at its position");
      TORCH_CHECK(lens[r] <= block_tables.size(1) * bs, "context longer than its block table");
      for (int64_t j = 0; j < (lens[r] + bs - 1) / bs; ++j) {
        const int32_t b = tables[r * block_tables.size(1) + j];
        TORCH_CHECK(b >= 0 && b < num_blocks, "block id beyond the KV cache");
      }
    }
    for (int64_t r = 0; r < m; ++r) std::memcpy(residual + r * H, embed + ids[r] * H, H * sizeof(float));
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      // the residual stream: add the previous sublayer's output (none before layer 0), then norm
      for_rows(m, H, [&](int64_t r0, int64_t r1) {
        if (li > 0)
          for (int64_t i = r0 * H; i < r1 * H; ++i) residual[i] += hidden[i];
        rms_norm_rows(residual + r0 * H, r1 - r0, H, L.input_norm.data_ptr<float>(), eps_, normed + r0 * H);
      });
      lap(other_ns_);
      linear_any(normed, m, H, L.qkv, L.qkv_scale, L.qkv_zeros, L.qkv_bias.defined() ? L.qkv_bias.data_ptr<float>() : nullptr,
                 qkv_out, qkv_.data(), blas_rows_);
      lap(linear_ns_);
      auto& kv = kv_caches[li];
      char* k_cache = static_cast<char*>(kv.data_ptr());  // bytes: float32 or int8 rows
      char* v_cache = k_cache + kv.stride(0) * kv.element_size();
      const int64_t slot_bytes = row_stride * kv.element_size();
      // the queries, gathered out of the fused qkv rows, for the attention kernel
      auto q_rows = torch::empty({m, num_heads_, head_dim_}, opts);
      for_rows(m, qkv_out, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          float* q = qkv_.data() + r * qkv_out;
          float* k = q + q_size_;
          const float* v = k + kv_size_;
          if (L.q_norm.defined()) {
            rms_norm_rows(q, num_heads_, head_dim_, L.q_norm.data_ptr<float>(), eps_, q);
            rms_norm_rows(k, num_kv_heads_, head_dim_, L.k_norm.data_ptr<float>(), eps_, k);
          }
          const float* c = cos_.data_ptr<float>() + pos[r] * table_dim;
          const float* s = sin_.data_ptr<float>() + pos[r] * table_dim;
          rotate(q, num_heads_, head_dim_, c, s);
          rotate(k, num_kv_heads_, head_dim_, c, s);
          if (slot[r] >= 0 && int8_kv) {
            int8_t* kr = reinterpret_cast<int8_t*>(k_cache + slot[r] * slot_bytes);
            int8_t* vr = reinterpret_cast<int8_t*>(v_cache + slot[r] * slot_bytes);
            for (int64_t h = 0; h < num_kv_heads_; ++h) {
              quantize_kv_row_int8(k + h * head_dim_, head_dim_, kr + h * width);
              quantize_kv_row_int8(v + h * head_dim_, head_dim_, vr + h * width);
            }
          } else if (slot[r] >= 0) {
            std::memcpy(k_cache + slot[r] * slot_bytes, k, kv_size_ * sizeof(float));
            std::memcpy(v_cache + slot[r] * slot_bytes, v, kv_size_ * sizeof(float));
          }
          std::memcpy(q_rows.data_ptr<float>() + r * q_size_, q, q_size_ * sizeof(float));
        }
      });
      lap(other_ns_);
      auto attn = paged_decode_attention(q_rows, kv[0], kv[1], block_tables, seq_lens, scale_);
      lap(attention_ns_);
      linear_any(attn.data_ptr<float>(), m, q_size_, L.o_proj, L.o_proj_scale, L.o_proj_zeros, nullptr, H, hidden, blas_rows_);
      lap(linear_ns_);
      for_rows(m, H, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0 * H; i < r1 * H; ++i) residual[i] += hidden[i];
        rms_norm_rows(residual + r0 * H, r1 - r0, H, L.post_norm.data_ptr<float>(), eps_, normed + r0 * H);
      });
      lap(other_ns_);
      linear_any(normed, m, H, L.gate_up, L.gate_up_scale, L.gate_up_zeros, nullptr, 2 * I, mlp_.data(), blas_rows_);
      lap(linear_ns_);
      for_rows(m, I, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* gate = mlp_.data() + r * 2 * I;
          const float* up = gate + I;
          silu_mul_row(gate, up, I, act_.data() + r * I);
        }
      });
      lap(other_ns_);
      linear_any(act_.data(), m, I, L.down, L.down_scale, L.down_zeros, nullptr, H, hidden, blas_rows_);
      lap(linear_ns_);
    }
    for (int64_t i = 0; i < m * H; ++i) residual[i] += hidden[i];
    rms_norm_rows(residual, m, H, final_norm_.data_ptr<float>(), eps_, hidden);
    lap(other_ns_);
    return out;
  }

  // What the step spent where since the last call, in nanoseconds: linear, attention, other
  // (counted only while profiling is on: it costs two clock reads per stage).
  std::vector<int64_t> take_profile() {
    std::vector<int64_t> out{linear_ns_, attention_ns_, other_ns_};
    linear_ns_ = attention_ns_ = other_ns_ = 0;
    return out;
  }
  void set_profile(bool on) { profile_ = on; }
  // From how many rows the float32 products of a step call torch's BLAS (0: never); returns the old value.
  int64_t set_blas_rows(int64_t rows) {
    TORCH_CHECK(rows >= 0, "set_blas_rows: a row count, or 0 for never");
    return std::exchange(blas_rows_, rows);
  }

 private:
  torch::Tensor embed_, final_norm_, cos_, sin_;
  std::vector<Layer> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  float eps_;
  int64_t hidden_size_ = 0, intermediate_ = 0, q_size_ = 0, kv_size_ = 0;
  double scale_ = 1.0;
  std::vector<float> residual_, normed_, qkv_, mlp_, act_;  // scratch, grown to the largest batch
  bool profile_ = false;
  int64_t blas_rows_ = 0;  // set_blas_rows
  int64_t linear_ns_ = 0, attention_ns_ = 0, other_ns_ = 0;
};

// The int8 kernels as torch operators, for modules that must not import this package (the
// `int8` quantization plugin looks them up as torch.ops.pagedserve.*, and falls back to torch
// where the extension is not loaded).
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias=None) -> Tensor");
  m.def("int8_dequantize(Tensor w, Tensor scale) -> Tensor");
  // Up to how many rows `int8_linear` beats dequantizing for float32 F.linear, for the kernel
  // selected now (cpu_int8_gemv.cpp: 128 with AVX-512 VNNI, 48 with AVX2 or AVX-VNNI, 16 for
  // the float path).
  m.def("int8_kernel_max_rows() -> int", []() -> int64_t { return int8_kernel_max_rows(); });
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("int8_linear", &small_linear_int8);
  m.impl("int8_dequantize", &int8_dequantize);
}

// The eager forward's element-wise ops (kernels/cpu_ops.py) for float32 rows of any count:
// the fused step's row functions, split across threads by rows like its own loops.

// Rows of the last dimension of x (made contiguous), as [rows, width].
static torch::Tensor float_rows(const torch::Tensor& x, int64_t width, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == width, what,
              ": float32 rows of the weight's width");
  return x.contiguous().view({-1, width});
}

// norm(x), or with a residual (norm(x + residual), x + residual): RMSNorm over the last dimension.
std::vector<torch::Tensor> cpu_rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                        c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous(),
              "cpu_rms_norm: a contiguous float32 weight");
  const int64_t n = weight.size(0);
  auto xr = float_rows(x, n, "cpu_rms_norm");
  const int64_t m = xr.size(0);
  auto out = torch::empty_like(xr);
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (!residual.has_value()) {
    const float* src = xr.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for_rows(m, n, [&](int64_t r0, int64_t r1) { rms_norm_rows(src + r0 * n, r1 - r0, n, w, e, dst + r0 * n); });
    return {out.view(x.sizes())};
  }
  TORCH_CHECK(residual->sizes() == x.sizes(), "cpu_rms_norm: the residual has x's shape");
  auto rr = float_rows(*residual, n, "cpu_rms_norm");
  auto sum = torch::empty_like(xr);
  const float* a = xr.data_ptr<float>();
  const float* b = rr.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for_rows(m, n, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * n; i < r1 * n; ++i) s[i] = b[i] + a[i];  // residual += sublayer output, as the fused step
    rms_norm_rows(s + r0 * n, r1 - r0, n, w, e, dst + r0 * n);
  });
  return {out.view(x.sizes()), sum.view(x.sizes())};
}

// (q, k) [n, heads, head_dim] rotated (rotate-half) by the cos/sin table rows of positions, as new
// contiguous tensors; q and k may be views into the fused qkv rows (any row stride).
std::vector<torch::Tensor> cpu_rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                      torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "cpu_rotary: q [n, heads, head_dim], k [n, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "cpu_rotary: float32 only");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == q.size(2) && cos.is_contiguous() &&
                  sin.is_contiguous(), "cpu_rotary: contiguous cos/sin tables [positions, head_dim]");
  const int64_t m = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == m, "cpu_rotary: one position per row");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) TORCH_CHECK(p[r] >= 0 && p[r] < cos.size(0), "position beyond the rotary table");
  // rows whose heads are contiguous (a view of the fused qkv rows is), else a contiguous copy
  auto rows = [](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous(); };
  auto qs = rows(q), ks = rows(k);
  auto qo = torch::empty({m, hq, d}, q.options()), ko = torch::empty({m, hk, d}, k.options());
  const float* qi = qs.data_ptr<float>();
  const float* ki = ks.data_ptr<float>();
  const int64_t qstride = qs.stride(0), kstride = ks.stride(0);
  float* qd = qo.data_ptr<float>();
  float* kd = ko.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  for_rows(m, (hq + hk) * d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(qd + r * hq * d, qi + r * qstride, hq * d * sizeof(float));
      std::memcpy(kd + r * hk * d, ki + r * kstride, hk * d * sizeof(float));
      rotate(qd + r * hq * d, hq, d, c + p[r] * d, sn + p[r] * d);
      rotate(kd + r * hk * d, hk, d, c + p[r] * d, sn + p[r] * d);
    }
  });
  return {qo, ko};
}

// x [n, 2·d] (gate then up) → silu(gate) · up, [n, d].
torch::Tensor cpu_silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 2 == 0,
              "cpu_silu_and_mul: float32 [n, 2 * d]");
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), d = xc.size(1) / 2;
  auto out = torch::empty({m, d}, x.options());
  const float* src = xc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for_rows(m, d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(src + r * 2 * d, src + r * 2 * d + d, d, dst + r * d);
  });
  return out;
}

void bind_cpu_decode(pybind11::module& m) {
  m.def("small_linear", &small_linear, "y = x·wᵀ (+ bias) for a few float32 rows", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("small_linear_int8", &small_linear_int8, "y = (x·wᵀ)·scale (+ bias) for a few float32 rows, int8 w",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale"), pybind11::arg("bias") = pybind11::none());
  m.def("int8_dequantize", &int8_dequantize, "float32 weight of an int8 weight and its per-row scales");
  m.def("set_linear_tile_rows", [](int64_t rows, int64_t depth) {
    TORCH_CHECK(rows >= 1 && depth >= 1, "set_linear_tile_rows: at least 1 row and a depth of 1");
    const auto before = std::make_pair(tile_min_rows, tile_min_depth);
    tile_min_rows = rows;
    tile_min_depth = depth;
    return before;
  }, "from how many rows and what depth the float products run in register tiles (same bits either way); "
     "returns the old (rows, depth)", pybind11::arg("rows"), pybind11::arg("depth"));
  m.def("cpu_rms_norm", &cpu_rms_norm, "RMSNorm of float32 rows; with a residual: (norm(x + residual), x + residual)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("cpu_rotary", &cpu_rotary, "(q, k) rotated by the cos/sin rows of positions, as new contiguous tensors");
  m.def("cpu_silu_and_mul", &cpu_silu_and_mul, "silu(gate) * up of float32 [n, 2 * d] rows");
  m.def("linear_tiles_compiled", []() { return kHaveTiles; }, "whether this build has the register-tile kernel");
  pybind11::class_<FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<torch::Tensor, std::vector<std::vector<c10::optional<torch::Tensor>>>, torch::Tensor,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, int64_t>(),
           pybind11::arg("embed"), pybind11::arg("layers"), pybind11::arg("final_norm"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("eps"), pybind11::arg("intermediate_size") = 0)
      .def("forward", &FusedDecoder::forward)
      .def("take_profile", &FusedDecoder::take_profile)
      .def("set_profile", &FusedDecoder::set_profile)
      .def("set_blas_rows", &FusedDecoder::set_blas_rows);
}

// The products over packed weights (cpu_packed_gemm.cpp) as torch operators and Python functions.
torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "pack_linear_weight: a float32 [out, in] weight");
  auto wc = w.contiguous();
  const int64_t out = w.size(0), in = w.size(1), panels = (out + kPackedPanel - 1) / kPackedPanel;
  auto packed = torch::empty({panels, in, kPackedPanel}, w.options());
  pack_linear_rows(wc.data_ptr<float>(), out, in, packed.data_ptr<float>());
  return packed;
}

// y = x·Wᵀ (+ bias), x float32 [m, in], W packed by pack_linear_weight, out its row count.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed_linear is float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPackedPanel && packed.is_contiguous() &&
                  out > (packed.size(0) - 1) * kPackedPanel && out <= packed.size(0) * kPackedPanel,
              "packed_linear: W packed as [ceil(out / 16), in, 16]");
  TORCH_CHECK(x.size(-1) == packed.size(1), "packed_linear: x's last dimension is the weight's input size");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == out),
              "packed_linear: float32 bias [out]");
  auto sizes = x.sizes().vec();
  auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  sizes.back() = out;
  auto y = torch::empty({xc.size(0), out}, x.options());
  torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  linear_rows_packed(xc.data_ptr<float>(), xc.size(0), xc.size(1), packed.data_ptr<float>(),
                     bc.defined() ? bc.data_ptr<float>() : nullptr, out, y.data_ptr<float>());
  return y.view(sizes);
}

// The int8 products over packed int8 weights (cpu_packed_int8.cpp), likewise.
torch::Tensor pack_int8_weight(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2, "pack_int8_weight: an int8 [out, in] weight");
  auto wc = w.contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  auto packed = torch::empty({(out + 15) / 16, (in + 31) / 32 * 8, 16, 4}, w.options().dtype(at::kByte));
  TORCH_CHECK(packed.numel() == packed_int8_bytes(out, in), "pack_int8_weight: layout size");
  pack_int8_rows(wc.data_ptr<int8_t>(), out, in, packed.data_ptr<uint8_t>());
  return packed;
}

// y = (x·Wᵀ)·scale (+ bias), x float32 [..., in], W packed by pack_int8_weight, out its row count.
torch::Tensor packed_int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t out,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_int8_linear: float32 x");
  const int64_t in = x.size(-1);
  TORCH_CHECK(packed.is_contiguous() && scale.is_contiguous(), "packed_int8_linear: contiguous weights");
  TORCH_CHECK(scale.dim() == 1, "packed_int8_linear: float32 scales [out]");
  check_weight(packed, scale, torch::Tensor(), out, in, "packed_int8_linear");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == out),
              "packed_int8_linear: float32 bias [out]");
  auto sizes = x.sizes().vec();
  auto xc = x.reshape({-1, in}).contiguous();
  sizes.back() = out;
  auto y = torch::empty({xc.size(0), out}, x.options());
  torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  linear_rows_packed_int8(xc.data_ptr<float>(), xc.size(0), in, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                          bc.defined() ? bc.data_ptr<float>() : nullptr, out, y.data_ptr<float>());
  return y.view(sizes);
}

// y = x·Wᵀ (+ bias), x float32 [..., in], W int4 packed by kernels/cpu_packed.py's pack_int4_weight.
torch::Tensor packed_int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                 const c10::optional<torch::Tensor>& zeros, int64_t out,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_int4_linear: float32 x");
  const int64_t in = x.size(-1);
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && (!zeros.has_value() || zeros->is_contiguous()),
              "packed_int4_linear: contiguous weights");
  TORCH_CHECK(scales.dim() == 3, "packed_int4_linear: scales [ceil(out / 16), groups, 16]");
  const torch::Tensor z = zeros.has_value() ? *zeros : torch::Tensor();
  check_weight(codes, scales, z, out, in, "packed_int4_linear");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == out),
              "packed_int4_linear: float32 bias [out]");
  auto sizes = x.sizes().vec();
  auto xc = x.reshape({-1, in}).contiguous();
  sizes.back() = out;
  auto y = torch::empty({xc.size(0), out}, x.options());
  torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  linear_rows_packed_int4(xc.data_ptr<float>(), xc.size(0), in, codes.size(1) * 8, codes.data_ptr<uint8_t>(),
                          half_bits(scales), z.defined() ? z.data_ptr<uint8_t>() : nullptr, scales.size(1),
                          bc.defined() ? bc.data_ptr<float>() : nullptr, out, y.data_ptr<float>());
  return y.view(sizes);
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("packed_int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int out, Tensor? bias=None) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out, Tensor? bias=None) -> Tensor");
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_int8_linear(Tensor x, Tensor packed, Tensor scale, int out, Tensor? bias=None) -> Tensor");
  m.def("pack_int8_weight(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_int8_linear", &packed_int8_linear);
  m.impl("packed_int4_linear", &packed_int4_linear);
  m.impl("pack_int8_weight", &pack_int8_weight);
}

void bind_cpu_packed_gemm(pybind11::module& m) {
  m.def("packed_linear", &packed_linear, "y = x·Wᵀ (+ bias) over a weight packed by pack_linear_weight",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out"), pybind11::arg("bias") = pybind11::none());
  m.def("pack_linear_weight", &pack_linear_weight, "float32 [out, in] → [ceil(out / 16), in, 16], zero-padded");
  m.def("packed_linear_isa", []() { return std::string(packed_linear_isa()); },
        "the packed product's kernel in use: avx512, avx2 or scalar");
  m.def("set_packed_linear_isa", [](const std::string& name) {
    TORCH_CHECK(set_packed_linear_isa(name),
                "set_packed_linear_isa: avx512, avx2 or scalar (the best this CPU runs is used when asked for more)");
  }, "at most this kernel (tests compare them); every kernel gives the same bits", pybind11::arg("name"));
  m.def("packed_int8_linear", &packed_int8_linear, "y = (x·Wᵀ)·scale (+ bias) over an int8 weight packed by "
        "pack_int8_weight", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scale"), pybind11::arg("out"),
        pybind11::arg("bias") = pybind11::none());
  m.def("packed_int4_linear", &packed_int4_linear, "y = x·Wᵀ (+ bias) over an int4 weight packed by "
        "kernels/cpu_packed.py's pack_int4_weight", pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("zeros"), pybind11::arg("out"), pybind11::arg("bias") = pybind11::none());
  m.def("pack_int8_weight", &pack_int8_weight, "int8 [out, in] → uint8 [ceil(out / 16), ceil(in / 32) * 8, 16, 4]");
  m.def("packed_int8_isa", []() { return std::string(packed_int8_isa()); },
        "the packed int8 product's kernel in use: avx512vnni, avxvnni, avx2 or scalar");
  m.def("set_packed_int8_isa", [](const std::string& name) {
    TORCH_CHECK(set_packed_int8_isa(name),
                "set_packed_int8_isa: avx512vnni, avxvnni, avx2 or scalar (the best this CPU runs at or below it is used)");
  }, "at most this kernel (tests compare them); every kernel gives the same bits", pybind11::arg("name"));
}
