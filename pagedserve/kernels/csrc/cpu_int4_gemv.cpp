// int4 × int8 products for the int4 weights' few-row linear layers (plugins/int4_quantization.py),
// as llama.cpp's Q4_0 × Q8_0: AVX-512 VNNI, AVX2, or plain C++, chosen at run time.
//
// The weights are used in their load-time layout, with no repacked copy: codes q (0..15) packed
// two per byte [out, padded_in / 2], byte i of each block of 32 inputs holding input i (low
// nibble) and input i + 16 (high nibble); a float16 scale s and a zero point in sixteenths of a
// step z16 (uint8; the layer is symmetric, z = 8, when it has no zeros tensor) per group of
// `group_size` inputs (a multiple of 32), so w = (q - z16 / 16)·s. The activation rows are
// quantized on the fly per block of 32 (d = max|x| / 127, xq = round(x·(127 / max|x|)), as the
// int8 kernels do), so a block's product is an exact int32 sum, converted to float and
// multiplied into a float accumulator: Σ (q - 8)·xq times d·s for a symmetric layer, and
// Σ (16·q - z16)·xq times d·s / 16 (exact) with zero points. A whole zero point (z16 = 16·z) gives
// sixteen times Σ (q - z)·xq and the same float product, so the same bits.
//
// Three kernels, each compiled with a function-level target attribute (one -march=native build
// holds all three; `__builtin_cpu_supports` picks):
//  - `avx512vnni`: 64 inputs (two blocks) a step. The 32 packed bytes unpack (mask, shift, two
//    lane permutes) into 64 codes. Symmetric: q + 120 is unsigned, and `vpdpbusd` starting from
//    -128·Σxq of each lane's four activations (computed once per call) gives Σ (q - 8)·xq per
//    lane. Zero points: `vpdpbusd` of 16·q (0..240) starting from z16·(-Σxq) of the lane (one
//    `vpmaddwd`). Per 64 weights and activation row: dpbusd (and the madd), conversion, the d·s
//    multiply, FMA.
//  - `avx2`: one block a step. Symmetric: `vpmaddubsw` of |q - 8| by xq with q - 8's sign
//    (llama.cpp's sign trick), `vpmaddwd` by ones into int32. Zero points: `vpmaddubsw` of q by
//    xq, `vpmaddwd` by 16s, plus z16·(-Σxq) of the lane (`vpmaddwd`). Conversion, FMA by d·s.
//  - `scalar`: the same sums in plain C++ (16·q - z16 for every layer), for any CPU and as the
//    reference of the SIMD ones.
// Each output (activation row, weight row) has its own accumulator that gets the same operations
// in the same order whatever the number of rows in the call or in its tile, and the lanes are
// summed in a pinned order: a row's result is bitwise independent of the batch. With more than
// a group of 4 activation rows, the SIMD kernels unpack each tile of weight rows once into a
// small buffer and run every group of rows against it (instead of unpacking it per group):
// the same operations on the same values, so the same bits.
//
// Above `int4_kernel_max_rows()` rows the Python side dequantizes the weight for float F.linear
// (the float path for larger M). The fused CPU decode step (cpu_decode.cpp) calls
// `linear_rows_int4` from its projection slots, next to linear_rows_int8, for steps of up to
// that many rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include "cpu_build_isa.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define PAGEDSERVE_INT4_X86 1
#include <immintrin.h>
#define PS4_AVX2 __attribute__((target("avx2,fma")))
#define PS4_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
#define PS4_INLINE inline __attribute__((always_inline))
#endif

namespace {

enum Int4Kernel : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };
const char* const kInt4Names[] = {"scalar", "avx2", "avx512vnni"};

constexpr int64_t kBlock = 32;  // activation values per scale, and inputs per 16 packed bytes
constexpr int64_t kStep = 64;   // the quantized activations are padded to a multiple of this
constexpr uint8_t kSymmetricZero = 8;     // a symmetric group's zero point
constexpr int32_t kSymmetricZero16 = 128;  // the same in sixteenths, as zero points are stored

bool int4_cpu_has(int k) {
#ifdef PAGEDSERVE_INT4_X86
  __builtin_cpu_init();
  switch (k) {
    case kScalar: return true;
    case kAvx2: return pagedserve_isa::kBuildAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512Vnni:
      return pagedserve_isa::kBuildAvx512Vnni && int4_cpu_has(kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return k == kScalar;
#endif
}

int best_int4_kernel() {
  for (int k = kAvx512Vnni; k > kScalar; --k)
    if (int4_cpu_has(k)) return k;
  return kScalar;
}

std::atomic<int> g_int4_kernel{best_int4_kernel()};

// The activations of one call, quantized per block of 32: xq [m, kq] (kq = padded_in rounded up
// to 64, zeros after `in`), d [m, kq / 32] (0 in the padding), and for the SIMD kernels each
// 4-value lane's -Σ of its four xq (nsx [m, kq / 4], for zero points), and for the AVX-512
// kernel each lane's d (dl [m, kq / 4]) and -128·Σ xq (nc [m, kq / 4]).
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> d, dl;
  std::vector<int32_t> nc, nsx;
  int64_t kq = 0;
};

void quantize_rows(const float* x, int64_t m, int64_t in, int64_t kq, bool lanes, QuantizedRows& q) {
  q.kq = kq;
  q.xq.assign(m * kq, 0);
  q.d.assign(m * (kq / kBlock), 0.f);
  if (lanes) {
    q.dl.assign(m * (kq / 4), 0.f);
    q.nc.assign(m * (kq / 4), 0);
    q.nsx.assign(m * (kq / 4), 0);
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * in;
    for (int64_t k0 = 0; k0 < in; k0 += kBlock) {
      const int64_t n = std::min(kBlock, in - k0);
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xr[k0 + i]));
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      q.d[r * (kq / kBlock) + k0 / kBlock] = amax / 127.f;
      int8_t* qr = q.xq.data() + r * kq + k0;
      // round half to even, as the int8 kernels' cvtps and torch.round do; |x·id| <= 127
      for (int64_t i = 0; i < n; ++i) qr[i] = static_cast<int8_t>(std::nearbyint(xr[k0 + i] * id));
      if (lanes) {
        for (int64_t l = 0; l < kBlock / 4; ++l) {
          int32_t s = 0;
          for (int i = 0; i < 4; ++i) s += qr[4 * l + i];
          q.nc[r * (kq / 4) + k0 / 4 + l] = -128 * s;
          q.nsx[r * (kq / 4) + k0 / 4 + l] = -s;
          q.dl[r * (kq / 4) + k0 / 4 + l] = amax / 127.f;
        }
      }
    }
  }
}

// The weights of one call: codes, the group scales and zero points (null: symmetric).
struct Int4Weights {
  const uint8_t* packed;  // [out, kp / 2]
  const uint16_t* scales; // [out, kp / group], float16 (their bits)
  const uint8_t* zeros;   // [out, kp / group] in sixteenths (z16), or null
  int64_t kp, group;
  int64_t groups() const { return kp / group; }
  int32_t zero16(int64_t o, int64_t g) const { return zeros ? zeros[o * groups() + g] : kSymmetricZero16; }
  // the scale widened to float32 (exact; c10 uses vcvtph2ps where the build's CPU has F16C)
  float scale(int64_t o, int64_t g) const { return c10::detail::fp16_ieee_to_fp32_value(scales[o * groups() + g]); }
};

// ---- plain C++ ----

// Every block's exact sum Σ (16·q - z16)·xq, times d·s / 16 (a symmetric layer's z16 is 128:
// sixteen times Σ (q - 8)·xq, the same bits as the symmetric SIMD kernels' float(Σ)·(d·s)).
float dot_scalar(const Int4Weights& w, int64_t o, const QuantizedRows& q, int64_t r) {
  const uint8_t* row = w.packed + o * (w.kp / 2);
  const int8_t* xr = q.xq.data() + r * q.kq;
  const float* dr = q.d.data() + r * (q.kq / kBlock);
  float acc = 0.f;
  for (int64_t b = 0; b < w.kp / kBlock; ++b) {
    const int64_t g = b * kBlock / w.group;
    const int32_t z = w.zero16(o, g);
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) {
      const uint8_t byte = row[b * 16 + i];
      sum += (16 * (byte & 15) - z) * xr[b * kBlock + i] + (16 * (byte >> 4) - z) * xr[b * kBlock + 16 + i];
    }
    acc = std::fma(static_cast<float>(sum), dr[b] * w.scale(o, g) * 0.0625f, acc);
  }
  return acc;
}

#ifdef PAGEDSERVE_INT4_X86

template <class T>
PS4_INLINE T pinned(T v) {
  asm("" : "+x"(v));
  return v;
}

PS4_AVX2 PS4_INLINE float sum_lanes_256(__m256 h) {
  const __m128 q = pinned(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  const __m128 p = pinned(_mm_add_ps(q, _mm_movehl_ps(q, q)));
  return _mm_cvtss_f32(pinned(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1))));
}

// ---- AVX2: a block of 32 a step, NW weight rows × MR activation rows ----
// A block of one weight row for the AVX2 product.
template <bool ZP>
struct Avx2Block {
  __m256i sw;  // symmetric: the signed codes q - 8; with zero points (ZP): the codes q (0..15)
  __m256i aw;  // symmetric: |q - 8|; ZP: the zero point z16 in the low half of each int32 lane
  float sc;    // the group's scale; ZP: divided by 16 (exact)
};

// Block b (32 inputs, group g) of weight row o for the AVX2 product.
template <bool ZP>
PS4_AVX2 PS4_INLINE Avx2Block<ZP> block_codes_avx2(const Int4Weights& w, int64_t o, int64_t b, int64_t g) {
  const __m128i low = _mm_set1_epi8(15);
  const uint8_t* p = w.packed + o * (w.kp / 2) + b * 16;
  _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
  if constexpr (ZP) return {codes, _mm256_set1_epi32(w.zero16(o, g)), w.scale(o, g) * 0.0625f};
  const __m256i signed_codes = _mm256_sub_epi8(codes, _mm256_set1_epi8(static_cast<char>(kSymmetricZero)));
  return {signed_codes, _mm256_abs_epi8(signed_codes), w.scale(o, g)};
}

// One block b of MR activation rows from r0 against NW weight rows, FMA by d·s into each
// (row, weight row)'s float accumulator, the sums exact in int32:
//  - symmetric: `vpmaddubsw` of |q - 8| by xq with q - 8's sign (llama.cpp's sign trick; pairs
//    of at most 8·127·2, never saturated), `vpmaddwd` by ones;
//  - zero points: `vpmaddubsw` of q by xq (pairs of at most 15·127·2), `vpmaddwd` by 16s, plus
//    z16 times the lane's -Σxq (`vpmaddwd` of two int32 lanes whose high halves are 0 and -Σxq's
//    sign: the product of the low halves), so 16·Σ q·xq - z16·Σ xq, with d·s / 16.
// The same operations in the same order for every row: a row's result does not depend on the
// batch, nor on whether its weights were unpacked in registers or read back.
template <int NW, int MR, bool ZP>
PS4_AVX2 PS4_INLINE void block_avx2(const Avx2Block<ZP> (&wb)[NW], const QuantizedRows& q, int64_t r0, int64_t b,
                                    __m256 (&acc)[MR][NW]) {
  const __m256i ones = _mm256_set1_epi16(ZP ? 16 : 1);
  const int64_t dstride = q.kq / kBlock;
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.xq.data() + (r0 + r) * q.kq + b * kBlock));
    const float d = q.d[(r0 + r) * dstride + b];
    [[maybe_unused]] __m256i nsx;
    if constexpr (ZP) nsx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.nsx.data() + (r0 + r) * (q.kq / 4) + b * 8));
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) {
      __m256i p;
      if constexpr (ZP)
        p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(wb[j].sw, xv), ones), _mm256_madd_epi16(wb[j].aw, nsx));
      else
        p = _mm256_madd_epi16(_mm256_maddubs_epi16(wb[j].aw, _mm256_sign_epi8(xv, wb[j].sw)), ones);
      acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * wb[j].sc), acc[r][j]);
    }
  }
}

// NW weight rows from row o, unpacked into memory for tile_avx2_unpacked: block b's row j at
// [b * NW + j].
template <int NW, bool ZP>
PS4_AVX2 PS4_INLINE void unpack_avx2(const Int4Weights& w, int64_t o, Avx2Block<ZP>* out) {
  for (int64_t b = 0; b < w.kp / kBlock; ++b) {
    const int64_t g = b * kBlock / w.group;
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) out[b * NW + j] = block_codes_avx2<ZP>(w, o + j, b, g);
  }
}

// s[r][j] for MR activation rows from r0 against NW weight rows unpacked by unpack_avx2.
template <int NW, int MR, bool ZP>
PS4_AVX2 PS4_INLINE void tile_avx2_unpacked(const Avx2Block<ZP>* blocks, int64_t kp, const QuantizedRows& q,
                                            int64_t r0, float (*s)[4]) {
  __m256 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kp / kBlock; ++b) {
    Avx2Block<ZP> wb[NW];
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) wb[j] = blocks[b * NW + j];
    block_avx2<NW, MR, ZP>(wb, q, r0, b, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) s[r][j] = sum_lanes_256(pinned(acc[r][j]));
}

// s[r][j] for MR activation rows from r0 against NW weight rows from o, each block unpacked in
// registers: for a few activation rows (one group of at most 4), where unpacking into memory
// would cost more than it saves.
template <int NW, int MR, bool ZP>
PS4_AVX2 PS4_INLINE void tile_avx2(const Int4Weights& w, int64_t o, const QuantizedRows& q, int64_t r0, float (*s)[4]) {
  __m256 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.kp / kBlock; ++b) {
    const int64_t g = b * kBlock / w.group;
    Avx2Block<ZP> wb[NW];
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) wb[j] = block_codes_avx2<ZP>(w, o + j, b, g);
    block_avx2<NW, MR, ZP>(wb, q, r0, b, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) s[r][j] = sum_lanes_256(pinned(acc[r][j]));
}

// ---- AVX-512 VNNI: two blocks (64 inputs) a step ----

PS4_AVX512 PS4_INLINE float sum_lanes_512(__m512 v) {
  const __m256 h = pinned(_mm256_add_ps(_mm512_castps512_ps256(v),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  return sum_lanes_256(h);
}

// The 64 inputs from k of weight row o, for the VNNI product (`two`: both blocks are there, else
// only the first, the second's activations being zero; g0, g1: their groups), each block's
// values in the lanes of its half:
//  - symmetric: the codes as unsigned bytes q + 120 (`codes`), the group scales (`scales`);
//  - zero points: the codes times 16 (0..240, `codes`), the group scales / 16 (exact), and the
//    zero points z16 in the low half of each int32 lane (`zeros`).
struct Vnni512Step {
  __m512i codes, zeros;
  __m512 scales;
};

template <bool ZP>
PS4_AVX512 PS4_INLINE Vnni512Step unpack_step_512(const Int4Weights& w, int64_t o, int64_t k, bool two, int64_t g0,
                                                  int64_t g1) {
  const __m256i low = _mm256_set1_epi8(15);
  const uint8_t* p = w.packed + o * (w.kp / 2) + k / 2;
  _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
  const __m256i bytes = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                            : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
  const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                       _mm256_permute2x128_si256(lo, hi, 0x31), 1);
  const __m512 scales = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(w.scale(o, g0)), _mm512_set1_ps(w.scale(o, g1)));
  if constexpr (ZP)  // each byte of q is at most 15: a 16-bit shift moves nothing across bytes
    return {_mm512_slli_epi16(q, 4),
            _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(w.zero16(o, g0)), _mm512_set1_epi32(w.zero16(o, g1))),
            _mm512_mul_ps(scales, _mm512_set1_ps(0.0625f))};
  return {_mm512_add_epi8(q, _mm512_set1_epi8(static_cast<char>(128 - kSymmetricZero))), _mm512_setzero_si512(),
          scales};
}

// One step (64 inputs from k) of MR activation rows from r0 against NW weight rows (as
// unpack_step_512 makes them), each lane's exact sum converted, times d·s, into that (row,
// weight row)'s float accumulator:
//  - symmetric: `vpdpbusd` from -128·Σxq of each lane gives Σ (q - 8)·xq;
//  - zero points: `vpdpbusd` of 16·q by xq from z16 times the lane's -Σxq (`vpmaddwd` of two
//    int32 lanes whose high halves are 0 and -Σxq's sign) gives 16·Σ q·xq - z16·Σ xq.
// The same operations in the same order for every row, whatever MR, and whether the weights
// were unpacked in registers or read back: a row's result is bitwise independent of the batch.
template <int NW, int MR, bool ZP>
PS4_AVX512 PS4_INLINE void step_512(const Vnni512Step (&ws)[NW], const QuantizedRows& q, int64_t r0, int64_t k,
                                    __m512 (&acc)[MR][NW]) {
  const int64_t lstride = q.kq / 4;
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m512i xv = _mm512_loadu_si512(q.xq.data() + (r0 + r) * q.kq + k);
    const __m512 dv = _mm512_loadu_ps(q.dl.data() + (r0 + r) * lstride + k / 4);
    const __m512i cv = _mm512_loadu_si512((ZP ? q.nsx.data() : q.nc.data()) + (r0 + r) * lstride + k / 4);
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) {
      const __m512i start = ZP ? _mm512_madd_epi16(ws[j].zeros, cv) : cv;
      acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, ws[j].codes, xv)),
                                  _mm512_mul_ps(dv, ws[j].scales), acc[r][j]);
    }
  }
}

// NW weight rows from row o, unpacked into memory for tile_512_unpacked: step i's row j at
// [i * NW + j].
template <int NW, bool ZP>
PS4_AVX512 PS4_INLINE void unpack_512(const Int4Weights& w, int64_t o, Vnni512Step* out) {
  for (int64_t k = 0, i = 0; k < w.kp; k += kStep, ++i) {
    const bool two = k + kStep <= w.kp;
    const int64_t g0 = k / w.group, g1 = two ? (k + kBlock) / w.group : g0;
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) out[i * NW + j] = unpack_step_512<ZP>(w, o + j, k, two, g0, g1);
  }
}

// s[r][j] for MR activation rows from r0 against NW weight rows unpacked by unpack_512.
template <int NW, int MR, bool ZP>
PS4_AVX512 PS4_INLINE void tile_512_unpacked(const Vnni512Step* steps, int64_t kp, const QuantizedRows& q,
                                             int64_t r0, float (*s)[4]) {
  __m512 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0, i = 0; k < kp; k += kStep, ++i) {
    Vnni512Step ws[NW];
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) ws[j] = steps[i * NW + j];
    step_512<NW, MR, ZP>(ws, q, r0, k, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) s[r][j] = sum_lanes_512(acc[r][j]);
}

// s[r][j] for MR activation rows from r0 against NW weight rows from o, each step unpacked in
// registers: for a few activation rows (one group of at most 4), where unpacking into memory
// would cost more than it saves.
template <int NW, int MR, bool ZP>
PS4_AVX512 PS4_INLINE void tile_512(const Int4Weights& w, int64_t o, const QuantizedRows& q, int64_t r0, float (*s)[4]) {
  __m512 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < w.kp; k += kStep) {
    const bool two = k + kStep <= w.kp;
    const int64_t g0 = k / w.group, g1 = two ? (k + kBlock) / w.group : g0;
    Vnni512Step ws[NW];
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) ws[j] = unpack_step_512<ZP>(w, o + j, k, two, g0, g1);
    step_512<NW, MR, ZP>(ws, q, r0, k, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) s[r][j] = sum_lanes_512(acc[r][j]);
}

// the tile for mr = 1..4 activation rows (MR fixed at compile time: accumulators in registers)
#define PS4_TILE_ROWS(NAME, TARGET, TILE)                                                                  \
  template <int NW, bool ZP, int MR = 1>                                                                  \
  TARGET void NAME(int mr, const Int4Weights& w, int64_t o, const QuantizedRows& q, int64_t r0,           \
                   float (*s)[4]) {                                                                       \
    if constexpr (MR < 4) {                                                                               \
      if (mr != MR) return NAME<NW, ZP, MR + 1>(mr, w, o, q, r0, s);                                      \
    }                                                                                                     \
    TILE<NW, MR, ZP>(w, o, q, r0, s);                                                                     \
  }
PS4_TILE_ROWS(tile_rows_avx2, PS4_AVX2, tile_avx2)
PS4_TILE_ROWS(tile_rows_512, PS4_AVX512, tile_512)
#undef PS4_TILE_ROWS

#define PS4_TILE_ROWS_UNPACKED(NAME, TARGET, TILE, STEP)                                                   \
  template <int NW, bool ZP, int MR = 1>                                                                  \
  TARGET void NAME(int mr, const STEP<ZP>* steps, int64_t kp, const QuantizedRows& q, int64_t r0,          \
                   float (*s)[4]) {                                                                       \
    if constexpr (MR < 4) {                                                                               \
      if (mr != MR) return NAME<NW, ZP, MR + 1>(mr, steps, kp, q, r0, s);                                 \
    }                                                                                                     \
    TILE<NW, MR, ZP>(steps, kp, q, r0, s);                                                                \
  }
template <bool ZP>
using Vnni512StepOf = Vnni512Step;
PS4_TILE_ROWS_UNPACKED(tile_rows_avx2_unpacked, PS4_AVX2, tile_avx2_unpacked, Avx2Block)
PS4_TILE_ROWS_UNPACKED(tile_rows_512_unpacked, PS4_AVX512, tile_512_unpacked, Vnni512StepOf)
#undef PS4_TILE_ROWS_UNPACKED

// run_rows for the SIMD kernels and more than one group of activation rows: each tile of NW
// (or 1) weight rows is unpacked once into memory (UNPACK) and every group of 4 activation rows
// runs against it, where the register tiles would unpack it again for every group. The same
// operations on the same values: the same bits as run_rows. AVX2 tiles hold 2 weight rows,
// AVX-512 tiles 4.
#define PS4_RUN_UNPACKED(NAME, TARGET, STEP, NW, UNPACK, TILE_ROWS)                                              \
  template <bool ZP>                                                                                            \
  TARGET void NAME(const Int4Weights& w, const QuantizedRows& q, int64_t m, const float* bias, int64_t out,      \
                   float* y, int64_t begin, int64_t end) {                                                      \
    constexpr int64_t kRows = 4;                                                                                \
    std::vector<STEP<ZP>> steps((w.kp + kStep - 1) / kStep * 2 * NW);                                           \
    float s[4][4];                                                                                              \
    for (int64_t o = begin; o < end;) {                                                                         \
      const int nw = end - o >= NW ? NW : 1;                                                                    \
      if (nw == NW) UNPACK<NW, ZP>(w, o, steps.data());                                                         \
      else UNPACK<1, ZP>(w, o, steps.data());                                                                   \
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {                                                               \
        const int mr = static_cast<int>(std::min(kRows, m - r0));                                               \
        if (nw == NW) TILE_ROWS<NW, ZP>(mr, steps.data(), w.kp, q, r0, s);                                      \
        else TILE_ROWS<1, ZP>(mr, steps.data(), w.kp, q, r0, s);                                                \
        for (int j = 0; j < nw; ++j) {                                                                          \
          const float b = bias ? bias[o + j] : 0.f;                                                             \
          for (int r = 0; r < mr; ++r) y[(r0 + r) * out + o + j] = s[r][j] + b;                                 \
        }                                                                                                       \
      }                                                                                                         \
      o += nw;                                                                                                  \
    }                                                                                                           \
  }
PS4_RUN_UNPACKED(run_rows_unpacked_avx2, PS4_AVX2, Avx2Block, 2, unpack_avx2, tile_rows_avx2_unpacked)
PS4_RUN_UNPACKED(run_rows_unpacked_512, PS4_AVX512, Vnni512StepOf, 4, unpack_512, tile_rows_512_unpacked)
#undef PS4_RUN_UNPACKED

// The register tiles of NW weight rows (or 1) for one group of mr activation rows.
template <bool ZP>
PS4_AVX512 int tile_512_any(int64_t left, int mr, const Int4Weights& w, int64_t o, const QuantizedRows& q,
                            int64_t r0, float (*s)[4]) {
  if (left < 4) {
    tile_rows_512<1, ZP>(mr, w, o, q, r0, s);
    return 1;
  }
  tile_rows_512<4, ZP>(mr, w, o, q, r0, s);
  return 4;
}

template <bool ZP>
PS4_AVX2 int tile_avx2_any(int64_t left, int mr, const Int4Weights& w, int64_t o, const QuantizedRows& q,
                           int64_t r0, float (*s)[4]) {
  if (left < 2) {
    tile_rows_avx2<1, ZP>(mr, w, o, q, r0, s);
    return 1;
  }
  tile_rows_avx2<2, ZP>(mr, w, o, q, r0, s);
  return 2;
}

#endif  // PAGEDSERVE_INT4_X86

// Above how many activation rows the VNNI and AVX2 kernels unpack each tile of weight rows once
// into memory (run_rows_unpacked_512, _avx2) rather than once per group of 4 activation rows:
// the same bits either way (set_int4_unpack_rows changes it, for tests and benchmarks).
int64_t unpack_min_rows = 4;

// Output rows [begin, end): blocks of 32 weight rows, each group of 4 activation rows applied to
// the block while it is in cache, a tile of weight rows at a time.
void run_rows(int kernel, const Int4Weights& w, const QuantizedRows& q, int64_t m, const float* bias, int64_t out,
              float* y, int64_t begin, int64_t end) {
  constexpr int64_t kRows = 4, kOutBlock = 32;
  const bool zp = w.zeros != nullptr;
#ifdef PAGEDSERVE_INT4_X86
  if (kernel == kAvx512Vnni && m > unpack_min_rows)
    return zp ? run_rows_unpacked_512<true>(w, q, m, bias, out, y, begin, end)
              : run_rows_unpacked_512<false>(w, q, m, bias, out, y, begin, end);
  if (kernel == kAvx2 && m > unpack_min_rows)
    return zp ? run_rows_unpacked_avx2<true>(w, q, m, bias, out, y, begin, end)
              : run_rows_unpacked_avx2<false>(w, q, m, bias, out, y, begin, end);
#endif
  float s[4][4];
  for (int64_t ob = begin; ob < end; ob += kOutBlock) {
    const int64_t oe = std::min(end, ob + kOutBlock);
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int mr = static_cast<int>(std::min(kRows, m - r0));
      for (int64_t o = ob; o < oe;) {
        int nw = 1;
#ifdef PAGEDSERVE_INT4_X86
        if (kernel == kAvx512Vnni) {
          nw = zp ? tile_512_any<true>(oe - o, mr, w, o, q, r0, s) : tile_512_any<false>(oe - o, mr, w, o, q, r0, s);
        } else if (kernel == kAvx2) {
          nw = zp ? tile_avx2_any<true>(oe - o, mr, w, o, q, r0, s) : tile_avx2_any<false>(oe - o, mr, w, o, q, r0, s);
        } else
#endif
        {
          for (int r = 0; r < mr; ++r) s[r][0] = dot_scalar(w, o, q, r0 + r);
        }
        for (int j = 0; j < nw; ++j) {
          const float b = bias ? bias[o + j] : 0.f;
          for (int r = 0; r < mr; ++r) y[(r0 + r) * out + o + j] = s[r][j] + b;
        }
        o += nw;
      }
    }
  }
}

}  // namespace

// y [m, out] = x [m, in] · dequantize(w)ᵀ (+ bias) for the packed int4 layout above, by the kernel
// selected now; output rows split across torch's intra-op threads.
void linear_rows_int4(const float* x, int64_t m, int64_t in, const uint8_t* packed, const uint16_t* scales,
                      const uint8_t* zeros, int64_t kp, int64_t group, const float* bias, int64_t out, float* y) {
  const int kernel = g_int4_kernel.load(std::memory_order_relaxed);
  thread_local QuantizedRows buffers;
  // a named reference: a lambda does not capture a thread_local, each thread would see its own
  QuantizedRows& q = buffers;
  quantize_rows(x, m, in, (kp + kStep - 1) / kStep * kStep, kernel != kScalar, q);
  const Int4Weights w{packed, scales, zeros, kp, group};
  at::parallel_for(0, out, 32, [&](int64_t begin, int64_t end) { run_rows(kernel, w, q, m, bias, out, y, begin, end); });
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "int4_linear: x must be contiguous float32 [m, in]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kUInt8 && qweight.is_contiguous(),
              "int4_linear: qweight must be contiguous uint8 [out, padded_in / 2]");
  const int64_t m = x.size(0), in = x.size(1), out = qweight.size(0), kp = qweight.size(1) * 2;
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && kp % group_size == 0 && kp >= in && kp - in < group_size,
              "int4_linear: group size ", group_size, " and padded width ", kp, " do not fit ", in, " inputs");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == out && scales.size(1) == kp / group_size,
              "int4_linear: scales must be contiguous float16 [out, padded_in / group_size]");
  const uint8_t* zp = nullptr;
  if (zeros && zeros->defined()) {
    TORCH_CHECK(zeros->scalar_type() == torch::kUInt8 && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "int4_linear: zeros must be contiguous uint8 shaped as scales");
    zp = zeros->data_ptr<uint8_t>();
  }
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out,
                "int4_linear: bias must be contiguous float32 [out]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, out}, x.options());
  if (m > 0)
    linear_rows_int4(x.data_ptr<float>(), m, in, qweight.data_ptr<uint8_t>(),
                     reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), zp, kp,
                     group_size, bp, out, y.data_ptr<float>());
  return y;
}

std::vector<std::string> int4_kernels() {
  std::vector<std::string> names;
  for (int k = kAvx512Vnni; k >= kScalar; --k)
    if (int4_cpu_has(k)) names.emplace_back(kInt4Names[k]);
  return names;
}

std::string int4_kernel() { return kInt4Names[g_int4_kernel.load(std::memory_order_relaxed)]; }

std::string set_int4_kernel(const std::string& name) {
  for (int k = kScalar; k <= kAvx512Vnni; ++k) {
    if (name == kInt4Names[k]) {
      TORCH_CHECK(int4_cpu_has(k), "set_int4_kernel: this CPU cannot run the '", name, "' kernel; it can run: ",
                  c10::Join(", ", int4_kernels()));
      return kInt4Names[g_int4_kernel.exchange(k)];
    }
  }
  TORCH_CHECK(false, "set_int4_kernel: unknown kernel '", name, "'; choices: scalar, avx2, avx512vnni");
}

// Up to how many rows `Int4Linear.forward` runs this file's kernel before dequantizing the weight
// for float32 F.linear (and up to how many rows the fused decode step takes an int4 model).
// AVX-512 VNNI: measured with benchmarks/int4_ab.py (the default model's 120 linears, group 32,
// 2 threads, Intel Xeon with AVX-512 VNNI + AMX, 2026-11-26), after the unpacked path: the
// kernel took 205 / 341 / 940 ms at M = 128 / 256 / 512 against 350 / 546 / 879 ms for
// dequantize + F.linear (64 before, from an AMD EPYC run of the kernel without that path:
// 164 against 197 ms for F.linear alone at M = 64). The AVX2 and scalar limits are not measured.
// set_int4_kernel_max_rows: a limit set by a test or a benchmark (0: the kernel's own, below).
int64_t max_rows_override = 0;

int64_t int4_kernel_max_rows() {
  if (max_rows_override > 0) return max_rows_override;
  switch (g_int4_kernel.load(std::memory_order_relaxed)) {
    case kAvx512Vnni: return 256;
    case kAvx2: return 32;
    default: return 4;
  }
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size) -> Tensor");
  m.def("int4_kernel_max_rows() -> int", []() -> int64_t { return int4_kernel_max_rows(); });
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("int4_linear", &int4_linear); }

void bind_cpu_int4_gemv(pybind11::module& m) {
  m.def("int4_linear", &int4_linear, "y = x·dequantize(int4 w)ᵀ (+ bias), activations quantized to int8 per 32",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"), pybind11::arg("zeros"),
        pybind11::arg("bias"), pybind11::arg("group_size"));
  m.def("int4_kernels", &int4_kernels, "the int4 kernels this CPU can run, best first: avx512vnni, avx2, scalar");
  m.def("int4_kernel", &int4_kernel, "the kernel the int4 linear layers run now");
  m.def("set_int4_kernel", &set_int4_kernel, "run this int4 kernel for every later int4 linear; returns the previous");
  m.def("set_int4_kernel_max_rows", [](int64_t rows) {
    TORCH_CHECK(rows >= 0, "set_int4_kernel_max_rows: a row count, or 0 for the kernel's own limit");
    return std::exchange(max_rows_override, rows);
  }, "up to how many rows Int4Linear runs the kernel before dequantizing (0: the selected kernel's own "
     "limit); returns the old setting", pybind11::arg("rows"));
  m.def("set_int4_unpack_rows", [](int64_t rows) {
    TORCH_CHECK(rows >= 0, "set_int4_unpack_rows: a row count");
    return std::exchange(unpack_min_rows, rows);
  }, "above how many activation rows the VNNI and AVX2 int4 kernels unpack each weight tile once (same bits); "
     "returns the old value", pybind11::arg("rows"));
}
