// int8 × int8 products for the int8 weights' few-row linear layers (x86: AVX2, AVX-VNNI,
// AVX-512 VNNI), chosen at run time from the CPU's flags.
//
// The int8 weights (plugins/int8_quantization.py's Int8Linear: int8 rows [out, in], one float32
// scale per row) are used as they are, with no repacked copy. The activation rows are
// quantized on the fly, as llama.cpp's Q8_0 activations: one float32 scale d per block of 32
// values (d = max|x| / 127, q = round(x / d), |q·d - x| <= d/2, |q| <= 127), so a product is a
// sum of int8 × int8 products per block, summed exactly in int32, converted to float and
// scaled by the block's d into a float accumulator (one FMA per block and lane vector).
// Every weight value -128..127 is exact in each kernel (quantize_per_channel writes -127..127).
//
// Three kernels, each compiled with a function-level target attribute so that one build (made
// -march=native, but on any x86 CPU) holds all three and runs only what the CPU has
// (`__builtin_cpu_supports`, which also checks that the OS saves the registers):
//  - `avx512vnni` (AVX-512 F+BW+VNNI): `vpdpbusd` on 512 bits, 64 products per instruction
//    into 16 int32 lanes (four adjacent products per lane: lanes 0-7 one block, 8-15 the
//    next). It multiplies unsigned by signed bytes: the weights go in as w + 128 (one xor per
//    64 weights, shared by every activation row), and -128·Σq of the same four activations,
//    computed once per call when the activations are quantized, starts each int32 lane, so
//    the int32 sum is exactly Σ q·w. Per 64 weights and activation row: one `vpdpbusd`, one
//    conversion, one FMA.
//  - `avxvnni` (AVX-VNNI, VEX-encoded, for CPUs with it and no AVX-512): the same on 256 bits
//    (`_mm256_dpbusd_avx_epi32`, one block of 32 per instruction).
//  - `avx2` (AVX2 + FMA, no VNNI): llama.cpp's sign trick. `vpmaddubsw` multiplies unsigned by
//    signed bytes and adds adjacent pairs into int16 with saturation: it gets |w| (unsigned:
//    |-128| = 128 fits) and sign(q, w) (q negated where w < 0, 0 where w = 0: exact, |q| <= 127),
//    so each int16 is two products of at most 128·127, 32512 < 32767: never saturated. Then
//    `vpmaddwd` by ones into int32 (four products a lane). Per 32 weights and activation row:
//    sign, maddubs, madd, conversion, FMA (five instructions), against eight conversions and
//    four FMAs for the float path of cpu_decode.cpp.
// The scratch is the quantized activations (m·in bytes, and their scales and offsets).
//
// Elsewhere (no AVX2 + FMA, or not x86) `int8_kernels()` is ["float"] and cpu_decode.cpp keeps
// its float path (the weights widened to float32), which is also the A/B switch's other side.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_build_isa.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define PAGEDSERVE_INT8_X86 1
#include <immintrin.h>  // declares every intrinsic; each is usable in a function with its target
#define PS_AVX2 __attribute__((target("avx2,fma")))
#define PS_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#define PS_AVX512VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
#define PS_INLINE inline __attribute__((always_inline))
#endif

// Which kernel the int8 linear layers run; the order is the preference order, best last.
enum Int8Kernel : int { kFloat = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };

namespace {

const char* const kNames[] = {"float", "avx2", "avxvnni", "avx512vnni"};

bool cpu_has(Int8Kernel k) {
#ifdef PAGEDSERVE_INT8_X86
  __builtin_cpu_init();
  switch (k) {
    case kFloat: return true;
    case kAvx2: return pagedserve_isa::kBuildAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvxVnni: return pagedserve_isa::kBuildAvxVnni && cpu_has(kAvx2) && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return pagedserve_isa::kBuildAvx512Vnni && cpu_has(kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return k == kFloat;
#endif
}

Int8Kernel best_kernel() {
  for (int k = kAvx512Vnni; k > kFloat; --k)
    if (cpu_has(static_cast<Int8Kernel>(k))) return static_cast<Int8Kernel>(k);
  return kFloat;
}

// the best kernel of this CPU by default; `set_int8_kernel("float")` selects the float path (an
// A/B switch for benchmarks/int8_ab.py and int8_linear.py, process-wide)
std::atomic<int> g_kernel{best_kernel()};

#ifdef PAGEDSERVE_INT8_X86

constexpr int64_t kBlock = 32;  // activation values per scale
// Software prefetch distance, in weight rows. The weights stream from L3 or memory (the model is
// far larger than L2), and the hardware prefetcher alone left the AVX-512 kernel at about
// 10 GB/s: with the rows 8-32 ahead prefetched, the 120 linear layers of the default model
// (M = 1, one thread, each weight read once per pass) took 7.0-8.5 ms instead of 10.8-11.0 ms.
constexpr int64_t kPrefetchRows = 16;

// The sum of the lanes, always in the same order: -ffast-math may reassociate the plain
// vector adds of _mm512_reduce_add_ps (GCC writes them as `+` of vector types) differently in
// the tiles of different shapes, and a row's result must not depend on how many rows or
// weight rows share its tile (a sequence's greedy tokens must not depend on its batch). The
// empty asm statements pin each partial sum.
template <class T>
PS_INLINE T pinned(T v) {
  asm("" : "+x"(v));
  return v;
}

PS_AVX2 PS_INLINE float sum_lanes(__m256 h) {
  const __m128 q = pinned(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  const __m128 p = pinned(_mm_add_ps(q, _mm_movehl_ps(q, q)));
  return _mm_cvtss_f32(pinned(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1))));
}

// ---- AVX2 and AVX-VNNI: 256 bits, one block of 32 activation values per vector ----

// Row r of x [m, in] into xq[r * kp ...] (kp = in rounded up to 32; the padding is 0) and the
// scale of each block into db[r * kp / 32 ...]; with `nc`, also -128·(the 4 values of q of each
// int32 lane) into nc[r * kp / 4 ...] (for `vpdpbusd`, whose weights go in as w + 128).
PS_AVX2 void quantize_rows_avx2(const float* x, int64_t m, int64_t in, int64_t kp, int8_t* xq, float* db,
                                int32_t* nc) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * in;
    int8_t* qr = xq + r * kp;
    for (int64_t k0 = 0; k0 < kp; k0 += kBlock) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) {
        const int64_t n = std::clamp<int64_t>(in - k0 - 8 * i, 0, 8);
        v[i] = n == 8 ? _mm256_loadu_ps(xr + k0 + 8 * i)
                      : _mm256_maskload_ps(xr + k0 + 8 * i, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
      }
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));  // max is exact in any order
      db[r * (kp / kBlock) + k0 / kBlock] = amax / 127.f;
      const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // round to nearest (the default MXCSR mode); |x·127/amax| <= 127 (up to float rounding)
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id));
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id));
      const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id));
      const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id));
      // packs work within 128-bit halves: the permutation puts the 32 values back in order
      const __m256i q = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + k0), q);
      if (nc) {
        const __m256i sum4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(nc + r * (kp / 4) + k0 / 4),
                            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum4, 7)));
      }
    }
  }
}

// One block of 32 values for MR activation rows against NW weight rows: wb + j·ws are the
// weight rows' 32 bytes, xb + r·xs the rows' quantized values, d[r·ds] their block scales.
template <int NW, int MR>
PS_AVX2 PS_INLINE void block_avx2(const int8_t* wb, int64_t ws, const int8_t* xb, int64_t xs, const float* d,
                                  int64_t ds, __m256 (&acc)[MR][NW]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i aw[NW];
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j) aw[j] = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * ws)));
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + r * xs));
    const __m256 dv = _mm256_broadcast_ss(d + r * ds);
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * ws));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xv, wv)), ones);
      acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dv, acc[r][j]);
    }
  }
}

// The same block with AVX-VNNI: the weights as w + 128, nc[r·ns] the lanes' -128·Σq.
template <int NW, int MR>
PS_AVXVNNI PS_INLINE void block_avxvnni(const int8_t* wb, int64_t ws, const int8_t* xb, int64_t xs, const float* d,
                                        int64_t ds, const int32_t* nc, int64_t ns, __m256 (&acc)[MR][NW]) {
  const __m256i c128 = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i wu[NW];
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j)
    wu[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * ws)), c128);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + r * xs));
    const __m256 dv = _mm256_broadcast_ss(d + r * ds);
    const __m256i cv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nc + r * ns));
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j)
      acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(cv, wu[j], xv)), dv, acc[r][j]);
  }
}

// s[r][j] = Σ_k (q[r, k]·d[r, block(k)])·w[j·in + k] for MR quantized activation rows against NW
// weight rows. Each (r, j) has two lane vectors, the even blocks' and the odd blocks' (two FMA
// chains, so that one row's FMA latency does not bound it), added at the end; every lane vector
// gets the same FMAs in the same order whatever NW and MR (the int32 block sums are exact), and
// is summed by the pinned tree: a row's result is bitwise the same in any tile. The last
// partial block of the weights is copied, zero-padded (the activations' padding is 0 too, and
// the copy never reads past the weights). The weights kPrefetchBytes ahead are prefetched into
// L2 once per 64 bytes, as the float path does: one weight row at a time (NW = 1) read as one
// sequential stream; at M = 1 four interleaved rows with the AVX-512 kernel's prefetch of the
// rows 16 ahead took 19.1 ms for the model's 120 linears, against 16.0 for the float path.
// PS_TILE_256(name, target, block call) defines the AVX2 and the AVX-VNNI tile: the same loop,
// each compiled for its own target only.
constexpr int64_t kPrefetchBytes = 4096;
#define PS_TILE_256(NAME, TARGET, BLOCK)                                                                        \
  template <int NW, int MR>                                                                                     \
  TARGET PS_INLINE void NAME(const int8_t* w, int64_t in, int64_t kp, const int8_t* xq, const float* db,         \
                             const int32_t* nc, float(*s)[4]) {                                                 \
    __m256 even[MR][NW], odd[MR][NW];                                                                           \
    for (int r = 0; r < MR; ++r)                                                                                \
      for (int j = 0; j < NW; ++j) even[r][j] = odd[r][j] = _mm256_setzero_ps();                                \
    const int64_t ds = kp / kBlock, ns = kp / 4, full = in / kBlock * kBlock;                                   \
    (void)nc, (void)ns;                                                                                         \
    int64_t k = 0;                                                                                              \
    for (; k + 2 * kBlock <= full; k += 2 * kBlock) {                                                           \
      for (int j = 0; j < NW; ++j)                                                                              \
        _mm_prefetch(reinterpret_cast<const char*>(w + j * in + k) + kPrefetchBytes, _MM_HINT_T1);              \
      BLOCK(w + k, in, k, even);                                                                                \
      BLOCK(w + k + kBlock, in, k + kBlock, odd);                                                               \
    }                                                                                                           \
    if (k < full) {                                                                                             \
      BLOCK(w + k, in, k, even);                                                                                \
      k += kBlock;                                                                                              \
    }                                                                                                           \
    if (full < in) {                                                                                            \
      alignas(32) int8_t tail[NW][kBlock] = {};                                                                 \
      for (int j = 0; j < NW; ++j) std::memcpy(tail[j], w + j * in + full, in - full);                          \
      if ((full / kBlock) % 2 == 0)                                                                             \
        BLOCK(tail[0], kBlock, full, even);                                                                     \
      else                                                                                                      \
        BLOCK(tail[0], kBlock, full, odd);                                                                      \
    }                                                                                                           \
    for (int r = 0; r < MR; ++r)                                                                                \
      for (int j = 0; j < NW; ++j) s[r][j] = sum_lanes(pinned(_mm256_add_ps(even[r][j], odd[r][j])));           \
  }

#define PS_BLOCK_AVX2(WB, WS, K, ACC) block_avx2<NW, MR>(WB, WS, xq + (K), kp, db + (K) / kBlock, ds, ACC)
#define PS_BLOCK_AVXVNNI(WB, WS, K, ACC) \
  block_avxvnni<NW, MR>(WB, WS, xq + (K), kp, db + (K) / kBlock, ds, nc + (K) / 4, ns, ACC)
PS_TILE_256(tile_avx2, PS_AVX2, PS_BLOCK_AVX2)
PS_TILE_256(tile_avxvnni, PS_AVXVNNI, PS_BLOCK_AVXVNNI)
#undef PS_TILE_256
#undef PS_BLOCK_AVX2
#undef PS_BLOCK_AVXVNNI

// ---- AVX-512 VNNI: 512 bits, two blocks per vector ----

// Row r of x [m, in] into xq[r * kp ...] (kp = in rounded up to 64; the padding is 0), the
// scale of each 4-value lane into dl[r * kp / 4 ...] (each block's d eight times, 0 in the
// padding), and -128·(the lane's 4 values of q) into nc[r * kp / 4 ...].
PS_AVX512VNNI void quantize_rows_512(const float* x, int64_t m, int64_t in, int64_t kp, int8_t* xq, float* dl,
                                     int32_t* nc) {
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * in;
    int8_t* qr = xq + r * kp;
    float* dr = dl + r * (kp / 4);
    for (int64_t k0 = 0; k0 < kp; k0 += kBlock) {
      const int64_t n = std::clamp<int64_t>(in - k0, 0, kBlock);
      const __mmask16 lo = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      const __mmask16 hi = n >= 32 ? 0xFFFF : (n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0);
      const __m512 v0 = _mm512_maskz_loadu_ps(lo, xr + k0);
      const __m512 v1 = _mm512_maskz_loadu_ps(hi, xr + k0 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.f;
      const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // round to nearest (the default MXCSR mode); |x·127/amax| <= 127 (up to float rounding)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k0),
                       _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k0 + 16),
                       _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id))));
      _mm256_storeu_ps(dr + k0 / 4, _mm256_set1_ps(d));
    }
    for (int64_t k = 0; k < kp; k += 64) {
      const __m512i q = _mm512_loadu_si512(qr + k);
      _mm512_storeu_si512(nc + r * (kp / 4) + k / 4, _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, q)));
    }
  }
}

PS_AVX512VNNI PS_INLINE float sum_lanes_512(__m512 v) {
  const __m256 h = pinned(_mm256_add_ps(_mm512_castps512_ps256(v),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  return sum_lanes(h);
}

// 64 weights (masked) for MR activation rows against NW weight rows at k.
template <int NW, int MR>
PS_AVX512VNNI PS_INLINE void step_512(const int8_t* w, int64_t in, int64_t kp, const int8_t* xq, const float* dl,
                                      const int32_t* nc, int64_t k, __mmask64 mask, __m512 (&acc)[MR][NW]) {
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i wu[NW];
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j) {
    // the rows kPrefetchRows ahead (a prefetch beyond the weights is harmless: it never faults)
    _mm_prefetch(reinterpret_cast<const char*>(w + (j + kPrefetchRows) * in + k), _MM_HINT_T0);
    wu[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + j * in + k), c128);
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m512i xv = _mm512_loadu_si512(xq + r * kp + k);
    const __m512 dv = _mm512_loadu_ps(dl + r * (kp / 4) + k / 4);
    const __m512i cv = _mm512_loadu_si512(nc + r * (kp / 4) + k / 4);
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j)
      acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, wu[j], xv)), dv, acc[r][j]);
  }
}

// As tile_avx2, 64 weights a step (the last one masked), the weights as w + 128.
template <int NW, int MR>
PS_AVX512VNNI PS_INLINE void tile_512(const int8_t* w, int64_t in, int64_t kp, const int8_t* xq, const float* dl,
                                      const int32_t* nc, float (*s)[4]) {
  __m512 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t full = in / 64 * 64;
  for (int64_t k = 0; k < full; k += 64) step_512<NW, MR>(w, in, kp, xq, dl, nc, k, ~__mmask64{0}, acc);
  if (full < in) step_512<NW, MR>(w, in, kp, xq, dl, nc, full, (__mmask64{1} << (in - full)) - 1, acc);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) s[r][j] = sum_lanes_512(acc[r][j]);
}

// ---- the output rows of one thread ----

// The tiles of one kernel at weight rows w (`left` of them before the end of the block) for mr
// activation rows: s[r][j] for the NW weight rows it did, NW returned.
using Tiles = int (*)(int mr, int64_t left, const int8_t* w, int64_t in, int64_t kp, const int8_t* xr,
                      const float* dr, const int32_t* cr, float (*s)[4]);

// the tile of NW weight rows × mr activation rows (mr = 1..4, MR fixed at compile time so the
// accumulators stay in registers); PS_TILE_ROWS defines it for each kernel's tile
#define PS_TILE_ROWS(NAME, TARGET, TILE)                                                                        \
  template <int NW, int MR = 1>                                                                                 \
  TARGET PS_INLINE void NAME(int mr, const int8_t* w, int64_t in, int64_t kp, const int8_t* xr, const float* dr, \
                             const int32_t* cr, float(*s)[4]) {                                                 \
    if constexpr (MR < 4) {                                                                                     \
      if (mr != MR) return NAME<NW, MR + 1>(mr, w, in, kp, xr, dr, cr, s);                                      \
    }                                                                                                           \
    TILE<NW, MR>(w, in, kp, xr, dr, cr, s);                                                                     \
  }
PS_TILE_ROWS(tile_rows_avx2, PS_AVX2, tile_avx2)
PS_TILE_ROWS(tile_rows_avxvnni, PS_AVXVNNI, tile_avxvnni)
PS_TILE_ROWS(tile_rows_512, PS_AVX512VNNI, tile_512)
#undef PS_TILE_ROWS

// 256 bits (16 ymm registers): one weight row × up to 4 activation rows (8 accumulators).
PS_AVX2 int tiles_avx2(int mr, int64_t, const int8_t* w, int64_t in, int64_t kp, const int8_t* xr, const float* dr,
                       const int32_t* cr, float (*s)[4]) {
  return tile_rows_avx2<1>(mr, w, in, kp, xr, dr, cr, s), 1;
}

PS_AVXVNNI int tiles_avxvnni(int mr, int64_t, const int8_t* w, int64_t in, int64_t kp, const int8_t* xr,
                             const float* dr, const int32_t* cr, float (*s)[4]) {
  return tile_rows_avxvnni<1>(mr, w, in, kp, xr, dr, cr, s), 1;
}

// 512 bits (32 zmm registers): 4 weight rows × up to 4 activation rows.
PS_AVX512VNNI int tiles_512(int mr, int64_t left, const int8_t* w, int64_t in, int64_t kp, const int8_t* xr,
                            const float* dr, const int32_t* cr, float (*s)[4]) {
  if (left >= 4) return tile_rows_512<4>(mr, w, in, kp, xr, dr, cr, s), 4;
  return tile_rows_512<1>(mr, w, in, kp, xr, dr, cr, s), 1;
}

// The quantized activation rows of one call (`d`: per block for the 256-bit kernels, per lane
// for AVX-512; `nc`: the lanes' offsets, null for AVX2), with their strides per row.
struct Quantized {
  const int8_t* xq;
  const float* d;
  const int32_t* nc;
  int64_t kp, d_stride, nc_stride;
};

// Rows [begin, end) of y: blocks of 64 weight rows (in L2), every group of 4 activation rows
// applied to the block, a tile of weight rows at a time, while it is in cache.
void run_rows(Tiles tiles, const Quantized& q, int64_t m, int64_t in, const int8_t* w, const float* scale,
              const float* bias, int64_t out, float* y, int64_t begin, int64_t end) {
  constexpr int64_t kRows = 4, kOutBlock = 64;
  float s[4][4];
  for (int64_t ob = begin; ob < end; ob += kOutBlock) {
    const int64_t oe = std::min(end, ob + kOutBlock);
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int mr = static_cast<int>(std::min(kRows, m - r0));
      const int8_t* xr = q.xq + r0 * q.kp;
      const float* dr = q.d + r0 * q.d_stride;
      const int32_t* cr = q.nc ? q.nc + r0 * q.nc_stride : nullptr;
      for (int64_t o = ob; o < oe;) {
        const int nw = tiles(mr, oe - o, w + o * in, in, q.kp, xr, dr, cr, s);
        for (int j = 0; j < nw; ++j) {
          const float b = bias ? bias[o + j] : 0.f;
          for (int r = 0; r < mr; ++r) y[(r0 + r) * out + o + j] = std::fma(s[r][j], scale[o + j], b);
        }
        o += nw;
      }
    }
  }
}

#endif  // PAGEDSERVE_INT8_X86

}  // namespace

// The names of the kernels this CPU can run, best first ("float" always last).
std::vector<std::string> int8_kernels() {
  std::vector<std::string> names;
  for (int k = kAvx512Vnni; k >= kFloat; --k)
    if (cpu_has(static_cast<Int8Kernel>(k))) names.emplace_back(kNames[k]);
  return names;
}

std::string int8_kernel() { return kNames[g_kernel.load(std::memory_order_relaxed)]; }

// Whether the int8 linear layers run an int8 × int8 kernel now (else the float path).
bool int8_int8_enabled() { return g_kernel.load(std::memory_order_relaxed) != kFloat; }

// Up to how many rows the int8 linear beats dequantizing for float32 F.linear, for the kernel
// selected now (`torch.ops.pagedserve.int8_kernel_max_rows`).
int64_t int8_kernel_max_rows() {
  switch (g_kernel.load(std::memory_order_relaxed)) {
    // one thread, the default model's four shapes: 11.0 ms against 14.9 for float32 at M = 128
    case kAvx512Vnni: return 128;
    // AVX2 + FMA (AMD EPYC, no AVX-512), one thread, passes over the model's 120 linears
    // (benchmarks/int8_linear.py --model-pass): below dequantize + F.linear up to 48 rows in
    // every run (M = 32: 159 against 240 ms), level with it at 64 (1.11x in one run, 0.72x in
    // another); docs/performance-history.md, "The AVX2 int8 × int8 kernel". AVX-VNNI (not
    // measured: no such CPU here) does three instructions per block where AVX2 does five.
    case kAvxVnni:
    case kAvx2: return 48;
    default: return 16;  // the float path
  }
}

// Selects the kernel of every later int8 linear of the process by name ("float": the weights
// widened to float32); returns the previous name.
std::string set_int8_kernel(const std::string& name) {
  for (int k = kFloat; k <= kAvx512Vnni; ++k) {
    if (name == kNames[k]) {
      TORCH_CHECK(cpu_has(static_cast<Int8Kernel>(k)), "set_int8_kernel: this CPU cannot run the '", name,
                  "' kernel; it can run: ", c10::Join(", ", int8_kernels()));
      return kNames[g_kernel.exchange(k)];
    }
  }
  TORCH_CHECK(false, "set_int8_kernel: unknown kernel '", name, "'; choices: float, avx2, avxvnni, avx512vnni");
}

// y[r, o] = (x[r, :] · w[o, :]) · scale[o] (+ bias[o]) for r < m, with x quantized per block of
// 32 as above; w int8 [out, in], row-major; by the kernel selected now (not "float": the caller,
// linear_rows_int8 of cpu_decode.cpp, runs the float path itself). As linear_rows_int8: output
// rows split across torch's intra-op threads, each taking blocks of 64 weight rows and applying
// every group of 4 activation rows to the block while it is in cache.
void linear_rows_int8_int8(const float* x, int64_t m, int64_t in, const int8_t* w, const float* scale,
                           const float* bias, int64_t out, float* y) {
#ifdef PAGEDSERVE_INT8_X86
  const int kernel = g_kernel.load(std::memory_order_relaxed);
  TORCH_CHECK(kernel != kFloat, "linear_rows_int8_int8: the float path is selected");
  const bool wide = kernel == kAvx512Vnni;
  const int64_t kp = (in + (wide ? 63 : 31)) / (wide ? 64 : 32) * (wide ? 64 : 32);
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> d_buf;
  thread_local std::vector<int32_t> nc_buf;
  const int64_t d_stride = wide ? kp / 4 : kp / kBlock;
  xq_buf.resize(std::max<int64_t>(1, m * kp));
  d_buf.resize(std::max<int64_t>(1, m * d_stride));
  nc_buf.resize(kernel == kAvx2 ? 1 : std::max<int64_t>(1, m * kp / 4));
  int32_t* nc = kernel == kAvx2 ? nullptr : nc_buf.data();
  if (wide)
    quantize_rows_512(x, m, in, kp, xq_buf.data(), d_buf.data(), nc);
  else
    quantize_rows_avx2(x, m, in, kp, xq_buf.data(), d_buf.data(), nc);
  const Quantized q{xq_buf.data(), d_buf.data(), nc, kp, d_stride, kp / 4};
  const Tiles tiles = kernel == kAvx512Vnni ? tiles_512 : kernel == kAvxVnni ? tiles_avxvnni : tiles_avx2;
  at::parallel_for(0, out, 32, [&](int64_t begin, int64_t end) {
    run_rows(tiles, q, m, in, w, scale, bias, out, y, begin, end);
  });
#else
  (void)x, (void)m, (void)in, (void)w, (void)scale, (void)bias, (void)out, (void)y;
  TORCH_CHECK(false, "linear_rows_int8_int8: no int8 × int8 kernel on this architecture");
#endif
}

void bind_cpu_int8_gemv(pybind11::module& m) {
  m.def("int8_kernels", &int8_kernels,
        "the int8 linear kernels this CPU can run, best first: avx512vnni, avxvnni, avx2 (int8 × int8), float");
  m.def("int8_kernel", &int8_kernel, "the kernel the int8 linear layers run now");
  m.def("set_int8_kernel", &set_int8_kernel,
        "run this kernel (a name of int8_kernels()) for every later int8 linear; returns the previous name");
}
