// int8 weights × int8 activations over weights packed at load, for any number of rows: the
// int8 model's products at every batch size, in the fused decode step (cpu_decode.cpp) and in
// the eager forward (kernels/cpu_packed.py's PackedInt8Linear), prefill included.
//
// The numbers are llama.cpp's Q8_0 × Q8_0, as the few-row kernels of cpu_int8_gemv.cpp: the
// weights are int8 with one float32 scale per output row (plugins/int8_quantization.py); each
// activation row is quantized per block of 32 values (d = max|x| / 127, q = round(x / d)).
// An output is
//     y[r, o] = fma(acc, scale[o], bias[o]),  acc = the chain over blocks b = 0, 1, ...:
//               acc = fma(float(S[r, o, b]), d[r, b], acc),  S = Σ_{k in b} q[r, k]·w[o, k]
// where S is an exact int32 (|S| <= 32·128·127 < 2^24, so float(S) is exact too). Every kernel
// below computes exactly this, so a row's bits do not depend on the kernel, the tile it lands
// in, how many rows share the call or how many threads split it: batch-invariant.
//
// The layout: W [out, in] is cut into panels of 16 output rows; a panel is stored as
// [in_p / 4, 16, 4] bytes (in_p = in rounded up to 32, zero-padded): for each group of 4
// inputs, the 4 weights of each of the 16 outputs together. That is the operand shape of
// `vpdpbusd`: one 64-byte load is 16 int32 lanes of 4 products each, against 4 activation
// bytes broadcast to every lane. The bytes are stored as w + 128 (unsigned), because
// `vpdpbusd` multiplies unsigned by signed bytes; the activation side starts each block's sum
// at -128·Σq, so the int32 is exactly Σ q·w.
//
// Kernels (function-level target attributes; one -march=native build holds those the compiler
// knows and `__builtin_cpu_supports` picks at run time):
//  - `avx512vnni`: per 4 inputs of a tile of MR rows × NP panels, NP loads, MR broadcasts and
//    MR·NP `vpdpbusd` (64 products each, against 16 for a float32 FMA); per block of 32 inputs
//    one conversion and one FMA per accumulator.
//  - `avxvnni` (AVX-VNNI, the VEX `vpdpbusd` on 256 bits, for the CPUs that have it and no
//    AVX-512: Intel's client cores since Alder Lake, its E-core Xeons): the `avx512vnni` sums
//    on two 8-lane halves of each panel, one instruction per 32 products.
//  - `avx2` (AVX2 + FMA, no VNNI): llama.cpp's sign trick on the same bytes: `vpmaddubsw` of
//    |w| (unsigned) by q with w's sign (signed), pairs into int16 (at most 2·128·127 = 32512:
//    never saturated), then `vpmaddwd` by ones into int32: three instructions where
//    `vpdpbusd` takes one.
//  - `scalar`: the same sums in plain C++ (other CPUs, and the reference in tests).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include "cpu_balanced_for.h"
#include "cpu_build_isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PSI_X86 1
#define PSI_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PSI_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define PSI_INLINE inline __attribute__((always_inline))
#define PSI_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
#endif

namespace {

constexpr int64_t kPanel = 16;          // output rows per panel
constexpr int64_t kBlock = 32;          // activation values per scale
constexpr int64_t kPanelBlock = kPanel * kBlock;  // bytes of one panel's block of 32 inputs
constexpr int64_t kBlockBytes = 128 << 10;  // the quantized rows one row block keeps in L2
constexpr int64_t kPrefetchBytes = 2048;    // the panel bytes an AVX2 tile prefetches ahead
// The AVX-512 tiles prefetch the thread's next tile instead (NextTile, see run_tiles), into L2
// and at the pace they read their own: each step over NP panels' 64-byte lines asks for the next
// NP lines of the next tile, in its order in memory (none past its end), so the next tile is in
// L2 when it starts. Only the first rows of a row block ask, so within a row block no line is
// asked twice. A tile's panels are NP streams that end every 4.6 KB (int4, 576 inputs): a fixed
// distance ahead in each (8 KB, T0, before) reached past the tile's end into panels the tile
// itself or the next one read anyway, and into L1, whose few outstanding misses it filled. The
// model's 120 linears at M = 1, 2 threads, AMD EPYC Zen 4, the two alternated in one process
// (median of 15): int4 2.40 against 2.83 ms (24.8 against 21.1 GB/s; the read bandwidth is 31),
// int8 4.30 against 4.64 (the next tile with the T2 hint; T1, kept, as fast for int4 at M = 1,
// 2.40; at M = 16 only T2 was measured: int4 7.85 against 8.92, int8 8.23 against 9.33). No
// prefetch at all: int4 2.45 at M = 1, 9.30 at M = 16.
// From this many rows the AVX-512 int4 product widens each tile's codes once (tile4u_vnni).
// The model's four projections at M = 16 / 32 / 64, int8 ÷ int4 time, alternated processes on
// an Intel Xeon (AVX-512 VNNI): widened 1.00-1.06 / 0.95-1.03 / 0.93-0.975, not 1.04-1.15 /
// 0.93-1.00 / 0.88-0.93.
constexpr int64_t kUnpackInt4Rows = 32;

// Best first is the order of preference; a CPU need not have every kernel below its best (an
// AMD Zen 4 has AVX-512 VNNI and no AVX-VNNI).
enum class Isa { kScalar, kAvx2, kAvxVnni, kAvx512Vnni };

bool cpu_runs(Isa isa) {
#ifdef PSI_X86
  __builtin_cpu_init();
  // F16C: the int4 tiles' float16 scales (every AVX2 CPU has it; a CPU that hid it gets scalar)
  const bool avx2 = pagedserve_isa::kBuildAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  switch (isa) {
    case Isa::kAvx512Vnni:
      return pagedserve_isa::kBuildAvx512Vnni && avx2 && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvxVnni: return pagedserve_isa::kBuildAvxVnni && avx2 && __builtin_cpu_supports("avxvnni");
    case Isa::kAvx2: return avx2;
    default: break;
  }
#endif
  return isa == Isa::kScalar;
}

Isa forced_isa = Isa::kAvx512Vnni;  // set_packed_int8_isa: at most this one (tests compare them)

// The best kernel this CPU runs, no better than the forced one.
Isa best_isa_up_to(Isa limit) {
  static const bool runs[] = {true, cpu_runs(Isa::kAvx2), cpu_runs(Isa::kAvxVnni), cpu_runs(Isa::kAvx512Vnni)};
  int i = static_cast<int>(limit);
  while (!runs[i]) --i;
  return static_cast<Isa>(i);
}

Isa active_isa() { return best_isa_up_to(forced_isa); }

// The activations of one call, quantized: row r's values q[r·kp ...] (kp = in_p, the padding
// 0), its block scales d[r·nb + b] and -128·Σq of each block nc[r·nb + b] (nb = kp / 32).
// The bytes of the thread's next tile, which the AVX-512 tiles prefetch (lines 0: none).
struct NextTile {
  const uint8_t* at = nullptr;
  int64_t lines = 0;  // 64-byte lines
};

struct Rows {
  const int8_t* q;
  const float* d;
  const int32_t* nc;
  int64_t kp, nb;
};

// One plain loop for every kernel, so the scales and codes are the same bits whichever runs.
void quantize_rows(const float* x, int64_t m, int64_t in, int64_t kp, int8_t* q, float* d, int32_t* nc) {
  const int64_t nb = kp / kBlock;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * in;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * kBlock, n = std::min(kBlock, in - k0);
        float amax = 0.f;
        for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(xr[k0 + k]));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        int8_t* qb = q + r * kp + k0;
        for (int64_t k = 0; k < kBlock; ++k) {
          // round to nearest even, as the vector conversions do; |x·id| <= 127 up to rounding
          const int32_t v = k < n ? static_cast<int32_t>(std::nearbyint(xr[k0 + k] * id)) : 0;
          qb[k] = static_cast<int8_t>(std::clamp(v, -127, 127));
          sum += qb[k];
        }
        d[r * nb + b] = amax / 127.f;
        nc[r * nb + b] = -128 * sum;
      }
    }
  });
}

// c[i][p·16 + j] = the accumulator (before the row scale) of row i against output j of panel p,
// for MR rows at q (rows `rows.kp` apart) and NP panels at w (panel_stride bytes apart).
template <int MR, int NP>
void tile_scalar(const Rows& rows, int64_t r0, const uint8_t* w, int64_t panel_stride, const NextTile&, float* c,
                 int64_t ldc) {
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < kPanel; ++j) {
        const int8_t* q = rows.q + (r0 + i) * rows.kp;
        const uint8_t* wp = w + p * panel_stride;
        float acc = 0.f;
        for (int64_t b = 0; b < rows.nb; ++b) {
          int32_t s = 0;
          for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
            s += q[k] * (static_cast<int32_t>(wp[(k / 4) * 64 + j * 4 + k % 4]) - 128);
          acc = std::fma(static_cast<float>(s), rows.d[(r0 + i) * rows.nb + b], acc);
        }
        c[i * ldc + p * kPanel + j] = acc;
      }
}

#ifdef PSI_X86
// Asks for line `line` of the thread's next tile into L2, if the tile has that line.
PSI_INLINE void prefetch_next(const NextTile& next, int64_t line) {
  if (line < next.lines) _mm_prefetch(reinterpret_cast<const char*>(next.at) + line * 64, _MM_HINT_T1);
}

template <int MR, int NP>
PSI_VNNI void tile_vnni(const Rows& rows, int64_t r0, const uint8_t* w, int64_t panel_stride, const NextTile& next,
                        float* c, int64_t ldc) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_ps();
  const int8_t* q = rows.q + r0 * rows.kp;
  const float* d = rows.d + r0 * rows.nb;
  const int32_t* nc = rows.nc + r0 * rows.nb;
  for (int64_t b = 0; b < rows.nb; ++b) {
    __m512i s[MR][NP];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i start = _mm512_set1_epi32(nc[i * rows.nb + b]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) s[i][p] = start;
    }
    const uint8_t* wb = w + b * kPanelBlock;
#pragma GCC unroll 8
    for (int t = 0; t < kBlock / 4; ++t) {
      __m512i wv[NP];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        prefetch_next(next, (b * (kBlock / 4) + t) * NP + p);
        wv[p] = _mm512_loadu_si512(wb + p * panel_stride + t * 64);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, q + i * rows.kp + b * kBlock + t * 4, 4);
        const __m512i xv = _mm512_set1_epi32(four);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) s[i][p] = _mm512_dpbusd_epi32(s[i][p], wv[p], xv);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 dv = _mm512_set1_ps(d[i * rows.nb + b]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][p]), dv, acc[i][p]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(c + i * ldc + p * kPanel, acc[i][p]);
}

// The end of block b in the 256-bit int8 tiles, for the MR rows of one panel:
// acc[i][h] += float(s[i][h])·d[row i, block b]; and a tile's accumulators stored to c.
template <int MR>
PSI_AVX2 PSI_INLINE void finish_block8_256(const float* d, int64_t nb, int64_t b, const __m256i s[][2],
                                           __m256 acc[][2]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m256 dv = _mm256_set1_ps(d[i * nb + b]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][h]), dv, acc[i][h]);
  }
}

template <int MR, int NP>
PSI_AVX2 PSI_INLINE void store_tile_256(const __m256 acc[][MR][2], float* c, int64_t ldc) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(c + i * ldc + p * kPanel, acc[p][i][0]);
      _mm256_storeu_ps(c + i * ldc + p * kPanel + 8, acc[p][i][1]);
    }
}

template <int MR, int NP>
PSI_AVX2 void tile_avx2(const Rows& rows, int64_t r0, const uint8_t* w, int64_t panel_stride, const NextTile&,
                        float* c, int64_t ldc) {
  const __m256i c128 = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NP][MR][2] = {};
  const int8_t* q = rows.q + r0 * rows.kp;
  for (int64_t b = 0; b < rows.nb; ++b) {
    __m256i s[NP][MR][2] = {};
    const uint8_t* wb = w + b * kPanelBlock;
#pragma GCC unroll 8
    for (int t = 0; t < kBlock / 4; ++t) {
      __m256i ws[NP][2], wa[NP][2];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const uint8_t* wp = wb + p * panel_stride + t * 64;
        _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
        ws[p][0] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)), c128);
        ws[p][1] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32)), c128);
        wa[p][0] = _mm256_abs_epi8(ws[p][0]);
        wa[p][1] = _mm256_abs_epi8(ws[p][1]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, q + i * rows.kp + b * kBlock + t * 4, 4);
        const __m256i xv = _mm256_set1_epi32(four);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h)
            s[p][i][h] = _mm256_add_epi32(
                s[p][i][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[p][h], _mm256_sign_epi8(xv, ws[p][h])), ones));
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) finish_block8_256<MR>(rows.d + r0 * rows.nb, rows.nb, b, s[p], acc[p]);
  }
  store_tile_256<MR, NP>(acc, c, ldc);
}

// The `avx512vnni` tile on 256 bits: each panel is two halves of 8 outputs (bytes 0-31 and
// 32-63 of a 64-byte group), each block's sum starts at -128·Σq as there.
template <int MR, int NP>
PSI_AVXVNNI void tile_avxvnni(const Rows& rows, int64_t r0, const uint8_t* w, int64_t panel_stride, const NextTile&,
                              float* c, int64_t ldc) {
  __m256 acc[NP][MR][2] = {};
  const int8_t* q = rows.q + r0 * rows.kp;
  const int32_t* nc = rows.nc + r0 * rows.nb;
  for (int64_t b = 0; b < rows.nb; ++b) {
    __m256i s[NP][MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256i start = _mm256_set1_epi32(nc[i * rows.nb + b]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) s[p][i][0] = s[p][i][1] = start;
    }
    const uint8_t* wb = w + b * kPanelBlock;
#pragma GCC unroll 8
    for (int t = 0; t < kBlock / 4; ++t) {
      __m256i wv[NP][2];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const uint8_t* wp = wb + p * panel_stride + t * 64;
        _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
        wv[p][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        wv[p][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32));
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, q + i * rows.kp + b * kBlock + t * 4, 4);
        const __m256i xv = _mm256_set1_epi32(four);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) s[p][i][h] = _mm256_dpbusd_avx_epi32(s[p][i][h], wv[p][h], xv);
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) finish_block8_256<MR>(rows.d + r0 * rows.nb, rows.nb, b, s[p], acc[p]);
  }
  store_tile_256<MR, NP>(acc, c, ldc);
}
#endif

// ---- int4 weights ----
// The codes (0..15) of a panel are [in_p / 8, 16, 4] bytes: byte (t, j, i) holds output j's
// code of input 8t + i in its low nibble and of input 8t + 4 + i in its high nibble, so one
// 64-byte load, masked and shifted, is the `vpdpbusd` operand of two groups of 4 inputs (the
// codes are unsigned already). Scales are float16 [panels, groups, 16] (as Q4_0's and GPTQ's:
// a fifth of a group-32 panel's bytes in float32, a ninth in float16) and zero points uint8
// [panels, groups, 16] in sixteenths of a step (z16; none: symmetric, 8, that is 128). An
// output is
//     y[r, o] = acc (+ bias[o]),  acc = the chain over blocks b of 32 inputs, in group g(b):
//               acc = fma(float(S[r, o, b]), d[r, b]·scale[o, g]·(1/16), acc),
//               S = 16·Σ_{k in b} code[o, k]·q[r, k] - z16[o, g]·Σ_{k in b} q[r, k]   (exact int32)
// with d[r, b]·scale[o, g] one rounded float32 product (the scale widened exactly from
// float16), then divided by 16 (exact), in every kernel. Where z16 is 16·z (a symmetric
// panel, or GPTQ's and AWQ's whole zero points) S is 16 times Σ code·q - z·Σq and the
// result the same bits as float(Σ code·q - z·Σq)·(d·scale): the symmetric tiles compute that.
struct Int4Panels {
  const uint8_t* codes;   // panel p0's codes; panels `stride` bytes apart
  const uint16_t* scales; // panel p0's float16 scales (their bits); panels `groups`·16 apart
  const uint8_t* zeros;   // likewise, or null (symmetric)
  int64_t stride, groups, blocks_per_group;
  NextTile next;          // the thread's next tile's codes, prefetched by the AVX-512 tile
};

// A float16's value as float32 (exact), in plain C++ for the scalar tiles.
inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

inline int32_t code_at(const uint8_t* panel, int64_t k, int j) {
  const uint8_t byte = panel[(k / 8) * 64 + j * 4 + k % 4];
  return (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
}

template <int MR, int NP>
void tile4_scalar(const Rows& rows, int64_t r0, const Int4Panels& w, float* c, int64_t ldc) {
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < kPanel; ++j) {
        const int8_t* q = rows.q + (r0 + i) * rows.kp;
        float acc = 0.f;
        for (int64_t b = 0; b < rows.nb; ++b) {
          const int64_t g = b / w.blocks_per_group, at = (p * w.groups + g) * kPanel + j;
          int32_t s = 0;
          for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) s += q[k] * code_at(w.codes + p * w.stride, k, j);
          const int32_t zero16 = w.zeros ? w.zeros[at] : 128;
          s = 16 * s - zero16 * (rows.nc[(r0 + i) * rows.nb + b] / -128);  // nc = -128·Σq
          const float ds = rows.d[(r0 + i) * rows.nb + b] * half_to_float(w.scales[at]);
          acc = std::fma(static_cast<float>(s), ds * 0.0625f, acc);
        }
        c[i * ldc + p * kPanel + j] = acc;
      }
}

#ifdef PSI_X86
// The AVX-512 int4 tiles' block start and end. Each block's sums start at -8·Σq (nc / 16)
// when every zero point is 8, else at 0; the end of block b is acc[i][p] +=
// float(S)·(d·scale) when every zero point is 8, else float(S16 - z16·Σq)·(d·(scale / 16)), the
// panels' scales (and zero points) at their group. With zero points the tiles multiply the
// codes times 16 (0..240: `vpdpbusd` takes them unsigned), so S16 = 16·Σ code·q comes straight
// from the sums, and z16·Σq is one `vpmaddwd` (z16 and Σq, |Σq| <= 32·127, in the low halves of
// int32 lanes whose high halves are 0 and Σq's sign). d·(scale / 16) is (d·scale) / 16 exactly,
// the scalar tile's number.
template <int MR, int NP, bool ZP>
PSI_VNNI PSI_INLINE void start_block4_512(const Rows& rows, int64_t r0, int64_t b, __m512i s[][NP]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512i start = ZP ? _mm512_setzero_si512() : _mm512_set1_epi32(rows.nc[(r0 + i) * rows.nb + b] / 16);
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) s[i][p] = start;
  }
}

template <int MR, int NP, bool ZP>
PSI_VNNI PSI_INLINE void finish_block4_512(const Rows& rows, int64_t r0, int64_t b, const Int4Panels& w,
                                           const __m512i s[][NP], __m512 acc[][NP]) {
  const int64_t g = b / w.blocks_per_group;
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t at = (p * w.groups + g) * kPanel;
    __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + at)));
    __m512i zv = _mm512_setzero_si512();
    if constexpr (ZP) {
      zv = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros + at)));
      sv = _mm512_mul_ps(sv, _mm512_set1_ps(0.0625f));
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m512i exact = s[i][p];
      const __m512 dv = _mm512_set1_ps(rows.d[(r0 + i) * rows.nb + b]);
      if constexpr (ZP)
        exact = _mm512_sub_epi32(exact, _mm512_madd_epi16(zv, _mm512_set1_epi32(rows.nc[(r0 + i) * rows.nb + b] / -128)));
      acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(dv, sv), acc[i][p]);
    }
  }
}

// An AVX-512 int4 tile's accumulators to c.
template <int MR, int NP>
PSI_VNNI PSI_INLINE void store_tile4_512(const __m512 acc[][NP], float* c, int64_t ldc) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(c + i * ldc + p * kPanel, acc[i][p]);
}

// ZP: the panels have zero points (else every zero point is 8: each block's sum starts at
// -8·Σq, one broadcast per row, instead of a multiply per row and panel).
template <int MR, int NP, bool ZP>
PSI_VNNI void tile4_vnni(const Rows& rows, int64_t r0, const Int4Panels& w, float* c, int64_t ldc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NP] = {};
  const int8_t* q = rows.q + r0 * rows.kp;
  for (int64_t b = 0; b < rows.nb; ++b) {
    __m512i s[MR][NP];
    start_block4_512<MR, NP, ZP>(rows, r0, b, s);
    const uint8_t* wb = w.codes + b * (kPanelBlock / 2);
#pragma GCC unroll 4
    for (int t = 0; t < kBlock / 8; ++t) {
      __m512i x0[MR], x1[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t first, second;
        std::memcpy(&first, q + i * rows.kp + b * kBlock + t * 8, 4);
        std::memcpy(&second, q + i * rows.kp + b * kBlock + t * 8 + 4, 4);
        x0[i] = _mm512_set1_epi32(first);
        x1[i] = _mm512_set1_epi32(second);
      }
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        prefetch_next(w.next, (b * (kBlock / 8) + t) * NP + p);
        const __m512i v = _mm512_loadu_si512(wb + p * w.stride + t * 64);
        // with zero points the codes times 16: the low nibble shifted up, the high one in place
        const __m512i lo = ZP ? _mm512_andnot_si512(low, _mm512_slli_epi16(v, 4)) : _mm512_and_si512(v, low);
        const __m512i hi = ZP ? _mm512_andnot_si512(low, v) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) s[i][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i][p], lo, x0[i]), hi, x1[i]);
      }
    }
    finish_block4_512<MR, NP, ZP>(rows, r0, b, w, s, acc);
  }
  store_tile4_512<MR, NP>(acc, c, ldc);
}

// Many rows against the same panels (AVX-512): each panel's codes are first widened to one
// byte each, in the int8 panels' layout [in_p / 4, 16, 4] (unpack_codes, once per tile and
// row block), and this tile runs the int8 tile's loop over them: a load and a `vpdpbusd` per
// 4 inputs of each panel, where tile4_vnni masks and shifts every code again for every 4
// rows. The sums are the same exact int32 and the block end is tile4_vnni's: the same bits.
template <int MR, int NP, bool ZP>
PSI_VNNI void tile4u_vnni(const Rows& rows, int64_t r0, const Int4Panels& w, const uint8_t* u, int64_t ustride,
                          float* c, int64_t ldc) {
  __m512 acc[MR][NP] = {};
  const int8_t* q = rows.q + r0 * rows.kp;
  for (int64_t b = 0; b < rows.nb; ++b) {
    __m512i s[MR][NP];
    start_block4_512<MR, NP, ZP>(rows, r0, b, s);
    const uint8_t* ub = u + b * kPanelBlock;
#pragma GCC unroll 8
    for (int t = 0; t < kBlock / 4; ++t) {
      __m512i wv[NP];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_si512(ub + p * ustride + t * 64);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, q + i * rows.kp + b * kBlock + t * 4, 4);
        const __m512i xv = _mm512_set1_epi32(four);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) s[i][p] = _mm512_dpbusd_epi32(s[i][p], wv[p], xv);
      }
    }
    finish_block4_512<MR, NP, ZP>(rows, r0, b, w, s, acc);
  }
  store_tile4_512<MR, NP>(acc, c, ldc);
}

// The calling thread's widened codes of its current tile (unpack_codes), kept from call to call.
std::vector<uint8_t>& unpacked_tile() {
  thread_local std::vector<uint8_t> u;
  return u;
}

// np panels of int4 codes (`stride` bytes apart, kp inputs) → a byte a code in the int8
// layout at u (panels kp·16 bytes apart): the low nibbles of a 64-byte group of 8 inputs are
// its first 4 inputs in that layout, the high ones the next 4. times16 (zero points): each
// code times 16, as tile4_vnni takes them then.
PSI_VNNI void unpack_codes(const uint8_t* codes, int64_t stride, int np, int64_t kp, bool times16, uint8_t* u) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < np; ++p)
    for (int64_t t = 0; t < kp / 8; ++t) {
      const __m512i v = _mm512_loadu_si512(codes + p * stride + t * 64);
      uint8_t* dst = u + p * kp * kPanel + t * 128;
      if (times16) {
        _mm512_storeu_si512(dst, _mm512_andnot_si512(low, _mm512_slli_epi16(v, 4)));
        _mm512_storeu_si512(dst + 64, _mm512_andnot_si512(low, v));
      } else {
        _mm512_storeu_si512(dst, _mm512_and_si512(v, low));
        _mm512_storeu_si512(dst + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
    }
}

// The parts of the two 256-bit int4 tiles below that are the same. Half h of a 64-byte group
// of codes (8 inputs of 16 outputs; half 0 holds outputs 0-7, half 1 outputs 8-15) as its low
// nibbles (inputs 0-3) and its high ones (inputs 4-7).
PSI_AVX2 PSI_INLINE void codes_half_256(const uint8_t* wp, int h, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * h));
  lo = _mm256_and_si256(v, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

// Each block's sums start at -8·Σq (nc / 16) when every zero point is 8, else at 0.
template <int MR, bool ZP>
PSI_AVX2 PSI_INLINE void start_block4_256(const Rows& rows, int64_t r0, int64_t b, __m256i s[][2]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
    s[i][0] = s[i][1] = ZP ? _mm256_setzero_si256() : _mm256_set1_epi32(rows.nc[(r0 + i) * rows.nb + b] / 16);
}

// The end of block b for the MR rows of one panel, whose scales (and zero points) start at
// `at`: acc[i][h] += float(S)·(d·scale), or with zero points float(16·S - z16·Σq)·(d·(scale / 16)).
template <int MR, bool ZP>
PSI_AVX2 PSI_INLINE void finish_block4_256(const Rows& rows, int64_t r0, int64_t b, const Int4Panels& w, int64_t at,
                                           const __m256i s[][2], __m256 acc[][2]) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + at + 8 * h)));
    __m256i zv = _mm256_setzero_si256();
    if constexpr (ZP) {  // as finish_block4_512 (the codes are not times 16 here: AVX2 pairs would saturate)
      zv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + at + 8 * h)));
      sv = _mm256_mul_ps(sv, _mm256_set1_ps(0.0625f));
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 dv = _mm256_set1_ps(rows.d[(r0 + i) * rows.nb + b]);
      __m256i exact = s[i][h];
      if constexpr (ZP)
        exact = _mm256_sub_epi32(_mm256_slli_epi32(exact, 4),
                                 _mm256_madd_epi16(zv, _mm256_set1_epi32(rows.nc[(r0 + i) * rows.nb + b] / -128)));
      acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(dv, sv), acc[i][h]);
    }
  }
}


// PSI_TILE4_256(name, target, product) defines the AVX2 and the AVX-VNNI int4 tile: the same
// loop, each compiled for its own target only. Per group of 8 inputs, one half of the panels
// at a time (its codes and one row's broadcasts live, beside the rows' int32 sums), and
// PRODUCT(s, lo, hi, x0, x1): s plus the products of the half's codes of inputs 0-3 (lo) and
// 4-7 (hi) by the row's two groups of 4 values. The float accumulators wait in L1 between
// blocks.
//  - AVX2: `vpmaddubsw` of the codes (unsigned, at most 15) by q (signed): pairs of at most
//    2·15·127 = 3810 in int16, never saturated; then `vpmaddwd` by ones into int32.
//  - AVX-VNNI: two `vpdpbusd` (VEX), codes unsigned by q signed, straight into int32; without
//    AVX2's ones vector 16 ymm hold the sums of 4 rows.
#define PSI_TILE4_256(NAME, TARGET, PRODUCT)                                                                          \
  template <int MR, int NP, bool ZP>                                                                                  \
  TARGET void NAME(const Rows& rows, int64_t r0, const Int4Panels& w, float* c, int64_t ldc) {                        \
    [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);                                                       \
    __m256 acc[NP][MR][2] = {};                                                                                       \
    const int8_t* q = rows.q + r0 * rows.kp;                                                                          \
    for (int64_t b = 0; b < rows.nb; ++b) {                                                                           \
      __m256i s[NP][MR][2];                                                                                           \
      _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) start_block4_256<MR, ZP>(rows, r0, b, s[p]);               \
      const uint8_t* wb = w.codes + b * (kPanelBlock / 2);                                                            \
      _Pragma("GCC unroll 4") for (int t = 0; t < kBlock / 8; ++t) {                                                  \
        _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)                                                          \
          _mm_prefetch(reinterpret_cast<const char*>(wb + p * w.stride + t * 64) + kPrefetchBytes, _MM_HINT_T0);      \
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {                                                         \
          __m256i lo[NP], hi[NP];                                                                                     \
          _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)                                                        \
            codes_half_256(wb + p * w.stride + t * 64, h, lo[p], hi[p]);                                              \
          _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                      \
            int32_t first, second;                                                                                    \
            std::memcpy(&first, q + i * rows.kp + b * kBlock + t * 8, 4);                                             \
            std::memcpy(&second, q + i * rows.kp + b * kBlock + t * 8 + 4, 4);                                        \
            const __m256i x0 = _mm256_set1_epi32(first), x1 = _mm256_set1_epi32(second);                              \
            _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)                                                      \
              s[p][i][h] = PRODUCT(s[p][i][h], lo[p], hi[p], x0, x1);                                                 \
          }                                                                                                           \
        }                                                                                                             \
      }                                                                                                               \
      const int64_t g = b / w.blocks_per_group;                                                                       \
      _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)                                                            \
        finish_block4_256<MR, ZP>(rows, r0, b, w, (p * w.groups + g) * kPanel, s[p], acc[p]);                         \
    }                                                                                                                 \
    store_tile_256<MR, NP>(acc, c, ldc);                                                                              \
  }

#define PSI_PRODUCT4_AVX2(S, LO, HI, X0, X1) \
  _mm256_add_epi32(S, _mm256_madd_epi16(                                                   \
                          _mm256_add_epi16(_mm256_maddubs_epi16(LO, X0), _mm256_maddubs_epi16(HI, X1)), ones))
#define PSI_PRODUCT4_AVXVNNI(S, LO, HI, X0, X1) _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(S, LO, X0), HI, X1)
PSI_TILE4_256(tile4_avx2, PSI_AVX2, PSI_PRODUCT4_AVX2)
PSI_TILE4_256(tile4_avxvnni, PSI_AVXVNNI, PSI_PRODUCT4_AVXVNNI)
#undef PSI_TILE4_256
#undef PSI_PRODUCT4_AVX2
#undef PSI_PRODUCT4_AVXVNNI
#endif

// The tiles of each weight kind and instruction set, and their shapes within the registers.
// int8 on AVX-512: 32 zmm hold an int32 and a float accumulator per row and panel, the
// panels' weights and a broadcast; int4 needs two code vectors a panel. AVX2 has 16 ymm and
// two of each a panel. AVX-VNNI needs no sign or ones vectors: 4 rows' int32 sums (8 ymm),
// a panel's two weight halves and a broadcast stay in registers, and the float accumulators
// wait in L1 between blocks (4 rows took 4-7% less time than 3 at 4-256 rows on an Intel Xeon
// with AVX-512 and AVX-VNNI, these tiles forced; 2 rows were not timed).
struct Int8Tiles {
  using Fn = void (*)(const Rows&, int64_t, const uint8_t*, int64_t, const NextTile&, float*, int64_t);
  static constexpr int max_rows(Isa isa) { return isa == Isa::kAvx2 ? 2 : 4; }
  static constexpr int max_panels(Isa isa, int mr) {
    if (isa == Isa::kAvx512Vnni) return mr == 1 ? 8 : mr == 2 ? 5 : mr == 3 ? 4 : 3;
    if (isa == Isa::kAvx2 || isa == Isa::kAvxVnni) return mr == 1 ? 2 : 1;
    return 1;
  }
  template <Isa I, int MR, int NP>
  static Fn fn() {
#ifdef PSI_X86
    if constexpr (I == Isa::kAvx512Vnni) return &tile_vnni<MR, NP>;
    if constexpr (I == Isa::kAvxVnni) return &tile_avxvnni<MR, NP>;
    if constexpr (I == Isa::kAvx2) return &tile_avx2<MR, NP>;
#endif
    return &tile_scalar<MR, NP>;
  }
};

template <bool ZP>
struct Int4Tiles {
  using Fn = void (*)(const Rows&, int64_t, const Int4Panels&, float*, int64_t);
  static constexpr int max_rows(Isa isa) { return isa == Isa::kAvx2 ? 2 : 4; }
  static constexpr int max_panels(Isa isa, int mr) {
    if (isa == Isa::kAvx512Vnni) return mr == 1 ? 8 : mr == 2 ? 4 : mr == 3 ? 3 : 2;
    return 1;
  }
  template <Isa I, int MR, int NP>
  static Fn fn() {
#ifdef PSI_X86
    if constexpr (I == Isa::kAvx512Vnni) return &tile4_vnni<MR, NP, ZP>;
    if constexpr (I == Isa::kAvxVnni) return &tile4_avxvnni<MR, NP, ZP>;
    if constexpr (I == Isa::kAvx2) return &tile4_avx2<MR, NP, ZP>;
#endif
    return &tile4_scalar<MR, NP>;
  }
};

#ifdef PSI_X86
// tile4u_vnni, AVX-512 only: the int8 tile's registers (one code vector a panel).
template <bool ZP>
struct Int4UnpackedTiles {
  using Fn = void (*)(const Rows&, int64_t, const Int4Panels&, const uint8_t*, int64_t, float*, int64_t);
  static constexpr int max_rows(Isa isa) { return Int8Tiles::max_rows(isa); }
  static constexpr int max_panels(Isa isa, int mr) { return Int8Tiles::max_panels(isa, mr); }
  template <Isa I, int MR, int NP>
  static Fn fn() {
    static_assert(I == Isa::kAvx512Vnni);
    return &tile4u_vnni<MR, NP, ZP>;
  }
};
#endif

// The tile of mr rows × np panels (within the bounds above), through templates instantiated
// only for the shapes that run.
template <class T, Isa I, int MR, int NP = 1>
typename T::Fn pick_np(int np) {
  if constexpr (NP < T::max_panels(I, MR)) {
    if (np != NP) return pick_np<T, I, MR, NP + 1>(np);
  }
  return T::template fn<I, MR, NP>();
}

template <class T, Isa I, int MR = 1>
typename T::Fn pick_rows(int mr, int np) {
  if constexpr (MR < T::max_rows(I)) {
    if (mr != MR) return pick_rows<T, I, MR + 1>(mr, np);
  }
  return pick_np<T, I, MR>(np);
}

template <class T>
typename T::Fn pick(Isa isa, int mr, int np) {
  if (isa == Isa::kAvx512Vnni) return pick_rows<T, Isa::kAvx512Vnni>(mr, np);
  if (isa == Isa::kAvxVnni) return pick_rows<T, Isa::kAvxVnni>(mr, np);
  if (isa == Isa::kAvx2) return pick_rows<T, Isa::kAvx2>(mr, np);
  return pick_rows<T, Isa::kScalar>(mr, np);
}

// The activations of m rows quantized into thread-local buffers (reused from call to call),
// zero-padded to kp values (a multiple of 32, at least in).
Rows quantize(const float* x, int64_t m, int64_t in, int64_t kp) {
  const int64_t nb = kp / kBlock;
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> d_buf;
  thread_local std::vector<int32_t> nc_buf;
  q_buf.resize(std::max<int64_t>(1, m * kp));
  d_buf.resize(std::max<int64_t>(1, m * nb));
  nc_buf.resize(std::max<int64_t>(1, m * nb));
  quantize_rows(x, m, in, kp, q_buf.data(), d_buf.data(), nc_buf.data());
  return Rows{q_buf.data(), d_buf.data(), nc_buf.data(), kp, nb};
}

// The loops of both weight kinds: the tiles of `tp` panels split across torch's intra-op
// threads; each thread runs blocks of rows (as many as keep their quantized values in about
// 128 KB of L2) against each of its tiles, so a tile's panels are read from memory once per
// row block (one block of rows, a decode batch: its tiles are balanced across the threads,
// cpu_balanced_for.h). tile(mr, r, p0, np, next_np, c, ldc) computes mr rows from r against np panels
// from p0; the thread's next tile, which the tile may prefetch, is the next_np panels from p0 + np
// (0: none, at its last tile, for a tile taken from another thread's share, or past the first
// rows of the row block, which asked already);
// finish(j, o, acc) is output o's value from its accumulator; prepare(p0, np) runs in the
// thread before it computes a tile's rows of a row block.
template <class Tile, class Finish, class Prepare>
void run_tiles(const Rows& rows, int64_t m, int64_t out, int tm, int tp, const Tile& tile, const Finish& finish,
               float* y, const Prepare& prepare) {
  const int64_t panels = (out + kPanel - 1) / kPanel;
  // Fewer panels a tile where that splits the tiles evenly across the threads: 36 panels (576
  // outputs) in tiles of 8 are 5 tiles, 3 on one thread and 2 on the other; in tiles of 6, 3
  // and 3. The tile width changes no bits (each output is its own chain).
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t even = (panels + tp - 1) / tp;
  if (even % threads != 0 && even < 4 * threads) {
    const int64_t want = (even + threads - 1) / threads * threads;
    tp = static_cast<int>(std::max<int64_t>(1, (panels + want - 1) / want));
  }
  const int64_t block_rows = std::max<int64_t>(tm, kBlockBytes / rows.kp / tm * tm);
  const int64_t tiles = (panels + tp - 1) / tp;
  // tile t's outputs for rows [r0, r1); next_t: the tile the thread will likely run next (-1: none)
  auto run_tile = [&](int64_t t, int64_t r0, int64_t r1, int64_t next_t) {
    float c[4 * 8 * kPanel];  // kMaxMR × kMaxNP × kPanel
    const int64_t ldc = tp * kPanel;
    const int64_t p0 = t * tp;
    const int np = static_cast<int>(std::min<int64_t>(tp, panels - p0));
    const int64_t o0 = p0 * kPanel, on = std::min<int64_t>(np * kPanel, out - o0);
    prepare(p0, np);
    for (int64_t r = r0; r < r1; r += tm) {
      const int mr = static_cast<int>(std::min<int64_t>(tm, r1 - r));
      tile(mr, r, p0, np, r == r0 && next_t >= 0 ? std::min<int64_t>(tp, panels - next_t * tp) : 0, c, ldc);
      for (int i = 0; i < mr; ++i) {
        float* yr = y + (r + i) * out + o0;
        const float* cr = c + i * ldc;
        for (int64_t j = 0; j < on; ++j) yr[j] = finish(o0 + j, cr[j]);
      }
    }
  };
  pagedserve_balanced::for_tiles(tiles, m, block_rows, run_tile);
}

}  // namespace

// Bytes of a packed weight of out × in: ceil(out / 16) panels of in_p × 16.
int64_t packed_int8_bytes(int64_t out, int64_t in) {
  return (out + kPanel - 1) / kPanel * ((in + kBlock - 1) / kBlock * kBlock) * kPanel;
}

// int8 W [out, in] (row-major) → dst [ceil(out / 16), in_p / 4, 16, 4] of w + 128, zero weights
// (128) in the padding.
void pack_int8_rows(const int8_t* src, int64_t out, int64_t in, uint8_t* dst) {
  const int64_t panels = (out + kPanel - 1) / kPanel, kp = (in + kBlock - 1) / kBlock * kBlock;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* dp = dst + p * kp * kPanel;
      std::memset(dp, 128, kp * kPanel);
      for (int64_t j = 0; j < kPanel && p * kPanel + j < out; ++j)
        for (int64_t k = 0; k < in; ++k)
          dp[(k / 4) * 64 + j * 4 + k % 4] = static_cast<uint8_t>(src[(p * kPanel + j) * in + k] + 128);
    }
  });
}

// y[r, o] = (x[r, :] · W[o, :]) · scale[o] (+ bias[o]) for r < m, o < out, as the header says.
void linear_rows_packed_int8(const float* x, int64_t m, int64_t in, const uint8_t* packed, const float* scale,
                             const float* bias, int64_t out, float* y) {
  if (m <= 0) return;
  const Rows rows = quantize(x, m, in, (in + kBlock - 1) / kBlock * kBlock);
  const Isa isa = active_isa();
  const int tm = static_cast<int>(std::min<int64_t>(m, Int8Tiles::max_rows(isa)));
  const int tp = Int8Tiles::max_panels(isa, tm);
  const int64_t stride = rows.kp * kPanel;
  run_tiles(
      rows, m, out, tm, tp,
      [&](int mr, int64_t r, int64_t p0, int np, int64_t next_np, float* c, int64_t ldc) {
        const NextTile next{packed + (p0 + np) * stride, next_np * stride / 64};
        pick<Int8Tiles>(isa, mr, np)(rows, r, packed + p0 * stride, stride, next, c, ldc);
      },
      [&](int64_t o, float acc) { return std::fma(acc, scale[o], bias ? bias[o] : 0.f); }, y, [](int64_t, int) {});
}

// y[r, o] = x[r, :] · W[o, :] (+ bias[o]) for int4 W packed as the int4 section says: codes
// [panels, kp / 8, 16, 4] (kp: in rounded up to the group size), float16 scales [panels,
// groups, 16], zeros likewise (uint8, sixteenths) or null.
void linear_rows_packed_int4(const float* x, int64_t m, int64_t in, int64_t kp, const uint8_t* codes,
                             const uint16_t* scales, const uint8_t* zeros, int64_t groups, const float* bias, int64_t out,
                             float* y) {
  if (m <= 0) return;
  const Rows rows = quantize(x, m, in, kp);
  const Isa isa = active_isa();
  const int64_t stride = rows.kp * kPanel / 2;
  const auto panels_at = [&](int64_t p0, int np, int64_t next_np) {
    return Int4Panels{codes + p0 * stride, scales + p0 * groups * kPanel, zeros ? zeros + p0 * groups * kPanel : nullptr,
                      stride, groups, rows.nb / groups, NextTile{codes + (p0 + np) * stride, next_np * stride / 64}};
  };
  const auto finish = [&](int64_t o, float acc) { return bias ? acc + bias[o] : acc; };
#ifdef PSI_X86
  if (isa == Isa::kAvx512Vnni && m >= kUnpackInt4Rows) {
    const int tm = Int8Tiles::max_rows(isa), tp = Int8Tiles::max_panels(isa, tm);
    const int64_t ustride = rows.kp * kPanel;
    run_tiles(
        rows, m, out, tm, tp,
        [&](int mr, int64_t r, int64_t p0, int np, int64_t, float* c, int64_t ldc) {
          const auto fn = zeros ? pick_rows<Int4UnpackedTiles<true>, Isa::kAvx512Vnni>(mr, np)
                                : pick_rows<Int4UnpackedTiles<false>, Isa::kAvx512Vnni>(mr, np);
          fn(rows, r, panels_at(p0, np, 0), unpacked_tile().data(), ustride, c, ldc);
        },
        finish, y,
        [&](int64_t p0, int np) {
          std::vector<uint8_t>& u = unpacked_tile();
          u.resize(static_cast<size_t>(np * ustride));
          unpack_codes(codes + p0 * stride, stride, np, rows.kp, zeros != nullptr, u.data());
        });
    return;
  }
#endif
  const int tm = static_cast<int>(std::min<int64_t>(m, Int4Tiles<true>::max_rows(isa)));
  const int tp = Int4Tiles<true>::max_panels(isa, tm);
  run_tiles(
      rows, m, out, tm, tp,
      [&](int mr, int64_t r, int64_t p0, int np, int64_t next_np, float* c, int64_t ldc) {
        const auto fn = zeros ? pick<Int4Tiles<true>>(isa, mr, np) : pick<Int4Tiles<false>>(isa, mr, np);
        fn(rows, r, panels_at(p0, np, next_np), c, ldc);
      },
      finish, y, [](int64_t, int) {});
}

namespace {
const char* const kIsaNames[] = {"scalar", "avx2", "avxvnni", "avx512vnni"};  // by Isa
}  // namespace

// The kernel in use: avx512vnni, avxvnni, avx2 or scalar.
const char* packed_int8_isa() { return kIsaNames[static_cast<int>(active_isa())]; }

// At most this kernel: the best this CPU runs at or below it in the order above (tests compare
// them); false for an unknown name.
bool set_packed_int8_isa(const std::string& name) {
  for (int i = 0; i < 4; ++i)
    if (name == kIsaNames[i]) {
      forced_isa = static_cast<Isa>(i);
      return true;
    }
  return false;
}
